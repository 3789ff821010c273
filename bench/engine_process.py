"""The engine in its own process against the engine in the HTTP process: served, same run.

    python bench/engine_process.py --model-dir FOLDER [--dtype float32] [--rounds 2]

One causal LM folder (for example SmolLM2-135M) served by ``trae serve`` in a subprocess,
``--engine-process`` and ``--no-engine-process`` alternately, ``--rounds`` rounds each
(medians). Each round streams OpenAI completions (greedy, ``ignore_eos``, ``--new``
tokens, a short prompt) over HTTP: ``--requests-1`` one after the other, then
``--clients`` concurrent clients sending ``--per-client`` each.

- inter-token latency at concurrency 1: per request, (time of its last text chunk -
  time of its first) / (new - 1), as the client sees it; the median over requests
- throughput at concurrency ``--clients``: completion tokens / wall seconds of the burst
- CPU seconds the front (``trae serve`` itself) and the engine process used during the
  burst, per 1000 tokens: what a second front process (``--api-workers``) could take
  off the engine's cores

Prints the split / one-process ratio of each. Never asserts: absolute figures drift on a
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


def start(graph: Path, split: bool, pool: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flag = "--engine-process" if split else "--no-engine-process"
    server = subprocess.Popen(
        [sys.executable, "-m", "trae_groups.cli", "--log-level", "warning", "serve", str(graph),
         flag, "--port", str(port), "--pool-bytes", pool, "--no-access-log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(3000):
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            sys.exit(f"trae serve {flag} exited with {server.returncode}")
        time.sleep(0.1)
    server.kill()
    sys.exit("trae serve never got ready")


async def one(http: httpx.AsyncClient, new: int) -> tuple[float, int]:
    """One streamed completion: (seconds per token after the first, text chunks)."""
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
    return (times[-1] - times[0]) / max(1, new - 1), len(times)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pids(pid: int) -> list[int]:
    """The server's child processes (the engine process, when split)."""
    try:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(p) for p in found]


async def round_(url: str, args: argparse.Namespace, pid: int) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await one(http, args.new)  # warm-up
        itl = [(await one(http, args.new))[0] for _ in range(args.requests_1)]

        async def client() -> None:
            for _ in range(args.per_client):
                await one(http, args.new)

        children = engine_pids(pid)
        cpu = [cpu_seconds(pid), sum(map(cpu_seconds, children))]
        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall = time.perf_counter() - began
        used = [cpu_seconds(pid) - cpu[0], sum(map(cpu_seconds, children)) - cpu[1]]
    tokens = args.clients * args.per_client * args.new
    return {"itl_ms": 1000 * statistics.median(itl), "tok_s": tokens / wall,
            "front_cpu": 1000 * used[0] / tokens, "engine_cpu": 1000 * used[1] / tokens}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    results: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for split in (r % 2 == 0, r % 2 != 0):  # the order alternates from round to round
            server, url = start(graph, split, args.pool_bytes)
            try:
                report = asyncio.run(round_(url, args, server.pid))
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(120)
            results[split].append(report)
            name = "split" if split else "one process"
            print(f"round {r + 1} {name:11}: ITL@1 {report['itl_ms']:6.2f} ms/token, "
                  f"c={args.clients} {report['tok_s']:7.1f} tok/s, CPU s per 1000 tokens: "
                  f"front {report['front_cpu']:.2f}, engine process {report['engine_cpu']:.2f}",
                  flush=True)  # fmt: skip
    keys = ("itl_ms", "tok_s", "front_cpu", "engine_cpu")
    med = {s: {k: statistics.median(x[k] for x in results[s]) for k in keys} for s in results}
    print(f"\n{args.model_dir.name}, {args.dtype}, {os.cpu_count()} CPUs, {args.rounds} rounds "
          f"(medians); split / one process:")  # fmt: skip
    for key, label in (("itl_ms", "inter-token latency at c=1"),
                       ("tok_s", f"throughput at c={args.clients}")):  # fmt: skip
        a, b = med[True][key], med[False][key]
        print(f"  {label:30} split {a:8.2f}  one process {b:8.2f}  ratio {a / b:.3f}")
    front, engine = med[True]["front_cpu"], med[True]["engine_cpu"]
    print(
        f"  split, CPU s per 1000 tokens at c={args.clients}: front {front:.2f}, engine "
        f"process {engine:.2f} (the front's share: {front / max(1e-9, front + engine):.0%})"
    )


if __name__ == "__main__":
    main()
