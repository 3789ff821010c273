"""Scale-out overhead: the same graph and requests in one process and on Ray Serve.

A graph of tiny models (classifier → 8-token LLM reply) is served three ways, one
after another, in this run: ``trae serve`` in a subprocess (one process, the
peer), then on a local Ray cluster with the LLM in a group of 1 and of 2 replicas.
For each: p50/p99 latency and req/s at 1 client and at --clients; the hop cost (a
bare DeploymentHandle call to an engine replica, p50); streaming cost per token
(an OpenAI streamed completion of --tokens tokens: total time over tokens, Ray
minus one process); and each replica's memory (PSS and shared clean pages, from
/proc/PID/smaps_rollup: memory-mapped weights are shared through the page cache).
On 2 cores Ray cannot be faster: the question is what the hops cost.

    python bench/ray_serve.py [--clients 16] [--requests 160] [--runs 3] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build_encoder, build_llm  # noqa: E402
from trae_groups import loadgen  # noqa: E402

GRAPH = """
name: tiny
models:
  intent: {{source: {root}/intent, task: classify, max_queue_delay_ms: 2}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "{{{{ intent.label }}}}: {{{{ inputs.text }}}}"
    params: {{max_tokens: 8}}
outputs: {{intent: intent.label, reply: reply.text}}
deploy:
  ingress: {{num_cpus: 0.1}}
  groups:
    engine: {{num_cpus: 0.1}}
    llm: {{models: [dialog], replicas: {replicas}, num_cpus: 0.1}}
"""
INPUTS = {"text": "hello where is my order to paris"}


def latency(url: str, clients: int, requests: int) -> dict:
    load = loadgen.Load(clients, requests)
    return asyncio.run(loadgen.over_http(load, url, "tiny", INPUTS, 120))


def stream_seconds_per_token(url: str, tokens: int) -> float:
    """One streamed completion of ``tokens`` tokens: wall time per token."""
    body = {"model": "tiny/dialog", "prompt": "hello", "max_tokens": tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for _ in response.iter_lines():
            pass
    return (time.perf_counter() - start) / tokens


def measure(url: str, args: argparse.Namespace) -> dict:
    one, many, per_token = [], [], []
    latency(url, 1, 10)  # warm-up
    for _ in range(args.runs):
        one.append(latency(url, 1, max(20, args.requests // 8)))
        many.append(latency(url, args.clients, args.requests))
        per_token.append(stream_seconds_per_token(url, args.tokens))

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {
        "p50_1": med(one, "p50_ms"), "p99_1": med(one, "p99_ms"), "rps_1": med(one, "throughput_rps"),
        "p50_n": med(many, "p50_ms"), "p99_n": med(many, "p99_ms"), "rps_n": med(many, "throughput_rps"),
        "ms_per_token": statistics.median(per_token) * 1000,
        "errors": sum(r["errors"] for r in one + many),
    }  # fmt: skip


def one_process(graph: Path, args: argparse.Namespace) -> dict:
    port = loadgen.free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trae_groups.cli",
            "--log-level",
            "warning",
            "serve",
            str(graph),
            "--port",
            str(port),
            "--no-access-log",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        loadgen.wait_ready(url)
        return measure(url, args)
    finally:
        server.terminate()
        server.wait(60)


def memory(pid: int) -> dict[str, float]:
    """PSS and shared clean pages of a process, in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value) / 1024
    return {"pss_mb": fields.get("Pss", 0.0), "shared_clean_mb": fields.get("Shared_Clean", 0.0)}


def on_ray(graph_for, args: argparse.Namespace, replicas: int, port: int) -> dict:
    import ray
    from ray import serve

    from trae_groups.cluster.app import build
    from trae_groups.cluster.board import board

    graph = graph_for(replicas)
    serve.run(build([graph]), name="trae", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    loadgen.wait_ready(url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # every replica posting its stats
        posts = ray.get(board("trae").read.remote())
        if sum(g == "llm" for g, _pid, _s in posts.values()) == replicas:
            break
        time.sleep(0.5)
    result = measure(url, args)
    handle = serve.get_deployment_handle("tiny-engine", app_name="trae")
    handle.pid.remote().result()
    hops = []
    for _ in range(200):
        start = time.perf_counter()
        handle.pid.remote().result()
        hops.append(time.perf_counter() - start)
    result["hop_ms"] = statistics.median(hops) * 1000
    posts = ray.get(board("trae").read.remote())
    result["replicas"] = {r: {"group": g, **memory(pid)} for r, (g, pid, _s) in posts.items()}
    serve.delete("trae")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="trae-bench-ray-"))
    models = tmp / "models"
    build_encoder(models / "intent", "classify", ["greet", "order", "spam"], seed=3)
    build_llm(models / "dialog", "llama", max_position_embeddings=4096)

    def graph_for(replicas: int) -> Path:
        path = tmp / f"tiny-{replicas}.yaml"
        path.write_text(GRAPH.format(root=models, replicas=replicas))
        return path

    results = {"one process": one_process(graph_for(1), args)}
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = loadgen.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for replicas in (1, 2):
            results[f"ray, {replicas} LLM replica(s)"] = on_ray(graph_for, args, replicas, port)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    base = results["one process"]
    print(f"clients {args.clients}, requests {args.requests}, medians of {args.runs} runs, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    header = "| | p50 @1 ms | p99 @1 ms | req/s @1 | p50 @N ms | p99 @N ms | req/s @N | ms/token streamed | handle hop p50 ms |"
    print(header)
    print("|" + "---|" * 9)
    for name, r in results.items():
        print(f"| {name} | {r['p50_1']:.1f} | {r['p99_1']:.1f} | {r['rps_1']:.1f} | {r['p50_n']:.1f} "
              f"| {r['p99_n']:.1f} | {r['rps_n']:.1f} | {r['ms_per_token']:.2f} "
              f"| {r.get('hop_ms', 0):.2f} |")  # fmt: skip
    for name, r in results.items():
        if name == "one process":
            continue
        print(f"{name}: p50 @1 = {r['p50_1'] / base['p50_1']:.2f}x one process; "
              f"streamed-token overhead {r['ms_per_token'] - base['ms_per_token']:+.2f} ms/token; "
              f"req/s @N = {r['rps_n'] / base['rps_n']:.2f}x; errors {r['errors']}")  # fmt: skip
        for replica, m in r["replicas"].items():
            print(f"  replica {replica} ({m['group']}): PSS {m['pss_mb']:.0f} MB, "
                  f"shared clean {m['shared_clean_mb']:.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
