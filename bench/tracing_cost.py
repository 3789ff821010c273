"""What tracing costs a served request: `trae serve` with tracing off, sampled out, and on.

Three `trae serve` processes (each with its engine process, as deployed) serve the same
graph of tiny models (classifier and tagger, then a 4-token LLM reply), on 127.0.0.1:

- **off**: no OTEL_* variable, the default; a request pays one ``is None`` check.
- **sampled out**: tracing on (OTLP endpoint set) with ``OTEL_TRACES_SAMPLER=always_off``:
  every tracing path runs (ids, the context carried to the engine process, spans started)
  but the SDK hands out its no-op spans and exports nothing.
- **on**: every span recorded and exported over OTLP/HTTP (batched, protobuf) to a sink on
  127.0.0.1 that answers 200 and drops them: the production path, minus the network.

Per run, each server gets the same closed-loop load (aiohttp clients, as `trae bench
--url`): graph requests (`POST /v1/graphs/tiny`: 7 spans in the front, 3 in the engine
process) and OpenAI chat completions on the LLM (5 spans, 1 in the engine process).
Modes alternate inside each run so drift of a shared machine lands on all alike;
medians of --runs, ratios against off, and server CPU per request (front and engine
process together).

    python bench/tracing_cost.py [--clients 16] [--requests 320] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build_encoder, build_llm  # noqa: E402
from trae_groups import loadgen  # noqa: E402

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
CHAT = {
    "model": "dialog",
    "messages": [{"role": "user", "content": "hello where is my order?"}],
    "max_tokens": 4,
    "temperature": 0,
}
MODES = ("off", "sampled out", "on")


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes every export and keeps nothing."""

    spans_bytes = 0

    def do_POST(self) -> None:
        _Sink.spans_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (lscpu failed)"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its descendants (the engine process)."""
    ticks, stats = os.sysconf("SC_CLK_TCK"), {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue  # it exited
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [child for child, (parent, _cpu) in stats.items() if parent == p]
    return total


async def chat_load(load: loadgen.Load, url: str) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=load.clients)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def call() -> None:
            async with session.post(f"{url}/v1/chat/completions", json=CHAT) as response:
                body = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {body[:200]!r}")

        return await loadgen.drive(load, call)


def measured(run, pid: int) -> dict:
    before = tree_cpu(pid)
    report = asyncio.run(run)
    report["server_cpu_ms"] = (tree_cpu(pid) - before) * 1000 / max(1, report["requests"])
    return report


def start_server(graph: Path, mode: str, sink: str) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if mode != "off":
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink
    if mode == "sampled out":
        env["OTEL_TRACES_SAMPLER"] = "always_off"
    port = loadgen.free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "trae_groups.cli", "--log-level", "warning", "serve", str(graph),
         "--port", str(port), "--pool-bytes", "64MiB"],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return server, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trae-tracing-bench-"))
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    build_encoder(root / "ner", "tag", ["O", "B-LOC", "I-LOC"], seed=1)
    build_llm(root / "dialog", "llama")
    graph = root / "tiny.yaml"
    graph.write_text(GRAPH.format(root=root))
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}"

    load = loadgen.Load(args.clients, args.requests)
    workloads = {
        "graph": lambda url: loadgen.over_http(load, url, "tiny", INPUTS, 120),
        "chat": lambda url: chat_load(load, url),
    }
    reports: dict[tuple[str, str], list[dict]] = {(w, m): [] for w in workloads for m in MODES}
    servers = {mode: start_server(graph, mode, sink_url) for mode in MODES}
    try:
        for _server, url in servers.values():
            loadgen.wait_ready(url)
        for _server, url in servers.values():  # warm-up: first compiles, caches, pools
            asyncio.run(loadgen.over_http(loadgen.Load(4, 32), url, "tiny", INPUTS, 120))
            asyncio.run(chat_load(loadgen.Load(4, 32), url))
        for run in range(args.runs):
            order = MODES if run % 2 == 0 else MODES[::-1]
            for workload, make in workloads.items():
                for mode in order:
                    server, url = servers[mode]
                    reports[(workload, mode)].append(measured(make(url), server.pid))
    finally:
        for server, _url in servers.values():
            server.terminate()
        for server, _url in servers.values():
            server.wait(60)
        sink.shutdown()

    def med(workload: str, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in reports[(workload, mode)])

    print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs)")
    print(
        f"medians of {args.runs} runs; {args.requests} requests per run at {args.clients} clients"
    )
    print(f"exported to the sink: {_Sink.spans_bytes / 1e6:.1f} MB of OTLP protobuf")
    for workload in workloads:
        print(f"{workload}:")
        off_rps, off_p50 = med(workload, "off", "throughput_rps"), med(workload, "off", "p50_ms")
        for mode in MODES:
            errors = sum(r["errors"] for r in reports[(workload, mode)])
            rps, p50 = med(workload, mode, "throughput_rps"), med(workload, mode, "p50_ms")
            print(f"  {mode:11s}: {rps:7.1f} req/s ({rps / off_rps:5.3f}x of off)"
                  f"   p50 {p50:7.2f} ms ({p50 / off_p50:5.3f}x)   p99 {med(workload, mode, 'p99_ms'):7.2f} ms"
                  f"   server CPU {med(workload, mode, 'server_cpu_ms'):5.2f} ms/request"
                  f"   errors {errors}")  # fmt: skip


if __name__ == "__main__":
    main()
