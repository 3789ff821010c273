"""Server overhead: the same graph and load over HTTP and in process, in one run.

A graph of tiny models (classifier → tagger → a 4-token LLM reply) is served by
`trae serve` in a subprocess on 127.0.0.1; 64 concurrent clients send it requests
over HTTP (aiohttp, as `trae bench --url` does). Then the same load runs in process
through the executor.
Server overhead per request = p50 over HTTP − p50 in process (HTTP parsing,
validation, JSON, the client's own cost), at --clients and at one client; the
difference of the means is printed too, because in a closed loop the two latency
distributions differ in shape (in process, all clients move in lock-step). CPU time
per request is reported for the server (its front and engine processes), the client and
the in-process run: on a machine where the engine already keeps every core busy, each extra CPU
millisecond of HTTP work per request shows up, multiplied by the queue, in a
closed-loop p50. Medians of --runs.

    python bench/server.py [--clients 64] [--requests 640] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build_encoder, build_llm  # noqa: E402
from trae_groups import loadgen  # noqa: E402
from trae_groups.engine import EngineConfig  # noqa: E402
from trae_groups.graphs.loader import load_graph  # noqa: E402
from trae_groups.graphs.runtime import ModelRuntime, settle_heap  # noqa: E402

GRAPH = """
name: tiny
models:
  intent: {{source: {root}/intent, task: classify, max_queue_delay_ms: 2}}
  ner: {{source: {root}/ner, task: tag, max_queue_delay_ms: 2}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  entities: {{model: ner, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "{{{{ intent.label }}}}: {{{{ inputs.text }}}}"
    params: {{max_tokens: 4, temperature: 0}}
outputs: {{intent: intent.label, reply: reply.text}}
"""
INPUTS = {"text": "hello where is my order to paris"}


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) a process and its children have used (``trae serve``
    runs its engine in a child process); None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return total + sum(process_cpu(int(child)) or 0.0 for child in children)


def measured(run: Coroutine[Any, Any, dict], server_pid: int | None = None) -> dict:
    """One run's report plus CPU ms per request: this process's (the client, or the
    whole in-process stack) and the server process's."""
    cpu, server = time.process_time(), server_pid and process_cpu(server_pid)
    report = asyncio.run(run)
    n = max(1, report["requests"])
    report["cpu_ms"] = (time.process_time() - cpu) * 1000 / n
    if server_pid and server is not None:
        report["server_cpu_ms"] = (process_cpu(server_pid) - server) * 1000 / n
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="trae-server-bench-"))
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    build_encoder(root / "ner", "tag", ["O", "B-LOC", "I-LOC"], seed=1)
    build_llm(root / "dialog", "llama")
    graph = root / "tiny.yaml"
    graph.write_text(GRAPH.format(root=root))
    loads = {"many": loadgen.Load(args.clients, args.requests), "one": loadgen.Load(1, 100)}
    http: dict[str, list[dict]] = {k: [] for k in loads}
    local: dict[str, list[dict]] = {k: [] for k in loads}

    port = loadgen.free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "trae_groups.cli", "--log-level", "warning", "serve", str(graph),
         "--port", str(port), "--pool-bytes", "64MiB"], env=env,
    )  # fmt: skip
    runtime = None
    try:
        loadgen.wait_ready(url)
        spec = load_graph(graph)
        runtime = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=64 << 20))
        executor = runtime.bind(spec)
        runtime.start()
        settle_heap()  # as trae serve does after loading (ServerConfig.freeze_gc)
        asyncio.run(loadgen.over_http(loadgen.Load(8, 32), url, "tiny", INPUTS, 60))  # warm-up
        asyncio.run(loadgen.in_process(loadgen.Load(8, 32), executor, INPUTS))
        # HTTP and in-process runs alternate, so that drift of a shared machine's speed
        # during the benchmark lands on both sides alike
        for _ in range(args.runs):
            for kind, load in loads.items():
                run = loadgen.over_http(load, url, "tiny", INPUTS, 120)
                http[kind].append(measured(run, server.pid))
                local[kind].append(measured(loadgen.in_process(load, executor, INPUTS)))
    finally:
        server.terminate()
        server.wait(60)
        if runtime is not None:
            runtime.shutdown()
        gc.unfreeze()

    def med(reports, key):
        return statistics.median(r[key] for r in reports)

    print(
        f"medians of {args.runs} runs; {args.requests} requests per run at {args.clients} clients"
    )
    for kind, load in loads.items():
        print(f"{load.clients} client(s):")
        for label, reports in (("over HTTP", http[kind]), ("in process", local[kind])):
            errors = sum(r["errors"] for r in reports)
            cpu = f"{med(reports, 'cpu_ms'):5.2f}"
            if "server_cpu_ms" in reports[0]:
                cpu = f"{med(reports, 'server_cpu_ms'):5.2f} (server) + {cpu} (client)"
            print(f"  {label:10s}: {med(reports, 'throughput_rps'):7.1f} req/s   p50 {med(reports, 'p50_ms'):7.2f} ms"
                  f"   p99 {med(reports, 'p99_ms'):7.2f} ms   errors {errors}   CPU ms/request {cpu}")  # fmt: skip
        overhead = med(http[kind], "p50_ms") - med(local[kind], "p50_ms")
        mean = med(http[kind], "mean_ms") - med(local[kind], "mean_ms")
        print(f"  overhead per request (p50 HTTP - p50 in process): {overhead:.2f} ms (target <= 2 ms)"
              f"; mean HTTP - mean in process: {mean:.2f} ms")  # fmt: skip
    if "server_cpu_ms" in http["many"][0]:
        extra = med(http["many"], "server_cpu_ms") - med(local["many"], "cpu_ms")
        print(
            f"server CPU per request beyond the in-process run, {args.clients} clients: {extra:.2f} ms"
        )


if __name__ == "__main__":
    main()
