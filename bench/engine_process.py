"""The engine in its own process against the engine in the HTTP process: served, same run.

    python bench/engine_process.py --model-dir FOLDER [--dtype float32] [--rounds 2]

One causal LM folder (for example SmolLM2-135M) served by ``trae serve`` in a subprocess,
in each of ``--modes``: ``one`` (``--no-engine-process``), ``split`` (the engine process,
the default) and ``split2`` (the engine process and two HTTP fronts,
``--api-workers 2``); ``--rounds`` rounds, the order rotating from round to round
(medians). Each round streams OpenAI completions (greedy, ``ignore_eos``, ``--new``
tokens, a short prompt) over HTTP: ``--requests-1`` one after the other, then
``--clients`` concurrent clients sending ``--per-client`` each.

- inter-token latency at concurrency 1: per request, (time of its last text chunk -
  time of its first) / (new - 1), as the client sees it; the median over requests
- throughput at concurrency ``--clients``: completion tokens / wall seconds of the burst
- CPU seconds the fronts (``trae serve`` and its API workers) and the engine process
  used during the burst, per 1000 tokens: what more front processes could take off the
  engine's cores

Prints each mode's ratio to ``one``. Never asserts: absolute figures drift on a
shared machine; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

GRAPH = """
name: bench
timeout: 900  # admission's capacity bound (429 Overloaded) goes by it: the burst must pass
models:
  llm: {{source: {folder}, task: generate, dtype: {dtype}}}
inputs: {{text: str}}
nodes:
  reply: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 8}}}}
outputs: {{reply: reply.text}}
"""
PROMPT = "Once upon a time, in a small village by the sea,"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODES = {
    "one": ["--no-engine-process"],
    "split": ["--engine-process"],
    "split2": ["--engine-process", "--api-workers", "2"],
}


def start(graph: Path, mode: str, pool: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "trae_groups.cli", "--log-level", "warning", "serve", str(graph),
         *MODES[mode], "--port", str(port), "--pool-bytes", pool, "--no-access-log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(3000):
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                time.sleep(2.0)  # an API worker may get ready a moment after front 0
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            sys.exit(f"trae serve ({mode}) exited with {server.returncode}")
        time.sleep(0.1)
    server.kill()
    sys.exit("trae serve never got ready")


async def one(http: httpx.AsyncClient, new: int) -> float:
    """One streamed completion: seconds per token after the first."""
    body = {"model": "bench/llm", "prompt": PROMPT, "max_tokens": new, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return (times[-1] - times[0]) / max(1, new - 1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(pid: int) -> tuple[list[int], list[int]]:
    """The server's front processes (it and its API workers) and its engine process."""
    children = []  # the engine process is a child of the thread that loaded the models
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    engine = [c for c in children if b"engine_process" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return [pid, *(c for c in children if c not in engine)], engine


def cpu(pids: list[int]) -> float:
    return sum(map(cpu_seconds, pids))


async def round_(url: str, args: argparse.Namespace, pid: int) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await one(http, args.new)  # warm-up
        itl = [await one(http, args.new) for _ in range(args.requests_1)]

        async def client() -> None:
            for _ in range(args.per_client):
                await one(http, args.new)

        fronts, engine = processes(pid)
        before = cpu(fronts), cpu(engine)
        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall = time.perf_counter() - began
        used = cpu(fronts) - before[0], cpu(engine) - before[1]
    tokens = args.clients * args.per_client * args.new
    return {"itl_ms": 1000 * statistics.median(itl), "tok_s": tokens / wall,
            "front_cpu": 1000 * used[0] / tokens, "engine_cpu": 1000 * used[1] / tokens}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=64, help="tokens per completion")
    parser.add_argument("--requests-1", type=int, default=8, help="requests at concurrency 1")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--pool-bytes", default="1GiB")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="trae-bench-split-")
    graph = Path(folder) / "bench.yaml"
    graph.write_text(GRAPH.format(folder=args.model_dir.resolve(), dtype=args.dtype))
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
        for mode in order:
            server, url = start(graph, mode, args.pool_bytes)
            try:
                report = asyncio.run(round_(url, args, server.pid))
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(120)
            results[mode].append(report)
            print(f"round {r + 1} {mode:6}: ITL@1 {report['itl_ms']:6.2f} ms/token, "
                  f"c={args.clients} {report['tok_s']:7.1f} tok/s, CPU s per 1000 tokens: "
                  f"fronts {report['front_cpu']:.2f}, engine process {report['engine_cpu']:.2f}",
                  flush=True)  # fmt: skip
    keys = ("itl_ms", "tok_s", "front_cpu", "engine_cpu")
    med = {m: {k: statistics.median(x[k] for x in results[m]) for k in keys} for m in results}
    base = med.get("one")
    print(f"\n{args.model_dir.name}, {args.dtype}, {os.cpu_count()} CPUs, {args.rounds} rounds "
          f"(medians; ratio: to one process)")  # fmt: skip
    for mode, m in med.items():
        ratios = (
            f"  ITL x{m['itl_ms'] / base['itl_ms']:.3f}, throughput x{m['tok_s'] / base['tok_s']:.3f}"
            if base
            else ""
        )
        print(f"  {mode:6} ITL@1 {m['itl_ms']:6.2f} ms  c={args.clients} {m['tok_s']:7.1f} tok/s"
              f"  CPU/1000 tok: fronts {m['front_cpu']:.2f} engine {m['engine_cpu']:.2f}{ratios}")  # fmt: skip


if __name__ == "__main__":
    main()
