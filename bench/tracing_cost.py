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

On a shared machine the served figures swing with the other work (an idle wait costs CPU
too, so CPU per request follows latency). ``--in-process`` asks the narrower question:
one process serves the graph (a server thread, its engine process as deployed), one
client sends requests one at a time, and tracing is switched off and on in place, in
alternating rounds; the CPU time (user + system, the process and its engine process,
client included alike) per request is compared, with the sink in a process of its own:

    python bench/tracing_cost.py --in-process [--requests 200] [--runs 5]

``--spans`` isolates the tracing work itself: what one graph request (3 nodes, a generate
node's phases, an engine span per node) and one chat completion make of spans, through
the same functions, exported over OTLP/HTTP to the sink process; CPU time per request,
building (the request's thread) and exporting (the batch processor's thread) apart:

    python bench/tracing_cost.py --spans [--requests 2000]
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


def build_graph() -> Path:
    root = Path(tempfile.mkdtemp(prefix="trae-tracing-bench-"))
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    build_encoder(root / "ner", "tag", ["O", "B-LOC", "I-LOC"], seed=1)
    build_llm(root / "dialog", "llama")
    graph = root / "tiny.yaml"
    graph.write_text(GRAPH.format(root=root))
    return graph


def serve_sink(port: int) -> None:
    """The sink alone (``--sink PORT``): a process of its own for ``--in-process``."""
    http.server.ThreadingHTTPServer(("127.0.0.1", port), _Sink).serve_forever()


def in_process(args: argparse.Namespace) -> None:
    """Tracing off and on in one serving process, requests one at a time (module doc)."""
    import httpx

    from trae_groups.engine import EngineConfig
    from trae_groups.graphs import tracing
    from trae_groups.serving.server import ServerConfig, ServerThread, create_app

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # the engine process batches like the front
    port = loadgen.free_port()
    sink = subprocess.Popen([sys.executable, __file__, "--sink", str(port)])
    config = ServerConfig(engine=EngineConfig(pool_bytes=64 << 20), engine_process=True)
    calls = {
        "graph": ("/v1/graphs/tiny", {"inputs": INPUTS}),
        "chat": ("/v1/chat/completions", CHAT),
    }
    cpu: dict[tuple[str, str], list[float]] = {(w, m): [] for w in calls for m in ("off", "on")}
    try:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"  # the engine's
        with (
            ServerThread(create_app([build_graph()], config)) as server,
            httpx.Client(base_url=server.url, timeout=120) as client,
        ):
            tracing.shutdown()  # the front switches in place; the engine process stays on

            def served_cpu() -> float:  # this process and its engine process, not the sink
                return tree_cpu(os.getpid()) - tree_cpu(sink.pid)

            def measure(workload: str, mode: str, n: int) -> float:
                path, body = calls[workload]
                before = served_cpu()
                for _ in range(n):
                    answer = client.post(path, json=body)
                    assert answer.status_code == 200, answer.text
                if mode == "on":
                    tracing.flush()  # the export of what it recorded counts too
                return (served_cpu() - before) * 1000 / n

            for workload in calls:  # warm-up
                measure(workload, "off", 32)
            for run in range(args.runs):
                for mode in ("off", "on") if run % 2 == 0 else ("on", "off"):
                    if mode == "on":
                        tracing.configure(endpoint=f"http://127.0.0.1:{port}/v1/traces")
                    for workload in calls:
                        cpu[(workload, mode)].append(measure(workload, mode, args.requests))
                    tracing.shutdown()
    finally:
        sink.terminate()
        sink.wait(30)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs); load average "
          f"{os.getloadavg()[0]:.1f}; {args.runs} runs of {args.requests} sequential requests")  # fmt: skip
    for workload in calls:
        off, on = (statistics.median(cpu[(workload, m)]) for m in ("off", "on"))
        print(f"{workload}: CPU per request off {off:6.2f} ms, on {on:6.2f} ms"
              f" ({on / off:5.3f}x of off, +{on - off:5.2f} ms)"
              f"   runs off {[round(x, 2) for x in cpu[(workload, 'off')]]}"
              f" on {[round(x, 2) for x in cpu[(workload, 'on')]]}")  # fmt: skip


def spans_only(args: argparse.Namespace) -> None:
    """The spans of one graph request and one chat, ``--requests`` times each (module doc)."""
    import time
    from types import SimpleNamespace

    from trae_groups.engine.protocol import EnginePhases, GenerationChunk
    from trae_groups.graphs import tracing
    from trae_groups.graphs.executor import NodeRecord
    from trae_groups.serving.call_tracing import CallTrace, carrying

    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(16 * args.requests)  # none dropped
    port = loadgen.free_port()
    sink = subprocess.Popen([sys.executable, __file__, "--sink", str(port)])
    nodes = {
        "intent": SimpleNamespace(kind="classify", model="intent", adapter=None),
        "entities": SimpleNamespace(kind="tag", model="ner", adapter=None),
        "reply": SimpleNamespace(kind="generate", model="dialog", adapter=None),
    }
    caller = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}

    def phases() -> EnginePhases:
        now = time.time()
        return EnginePhases(now, now + 0.001, now + 0.002, now + 0.004)

    def graph_request() -> None:
        trace, records = tracing.RunTrace(caller["traceparent"]), {}
        for name in nodes:
            token = tracing.carry(trace.headers(tracing.node_key(name)))
            with tracing.served_span(f"engine {name}", tracing.carried(), **{"trae.model": name}):
                pass  # the engine process's span, here in the same process
            tracing.uncarry(token)
            now = time.perf_counter()
            records[name] = NodeRecord(status="ok", started=now, finished=now + 0.01)
        records["reply"].usage = {"tokens": 4, "prompt_tokens": 12, "finish_reason": "length"}
        records["reply"].phases = phases()
        tracing.record_run("tiny", "tiny-1", trace, nodes, records, {}, None)

    def chat_request() -> None:
        trace = CallTrace.start("chat", "dialog", caller)
        call = trace.model_call("dialog", "generate", "dialog", None)
        with carrying(trace), tracing.served_span("engine dialog", tracing.carried()):
            pass
        call.ended(GenerationChunk("x", "", (), True, "length", 12, 4, phases=phases()))
        trace.request_id = "chatcmpl-1"
        trace.settled(200, None)
        trace.finish()

    time.sleep(5)  # the sink process imports what this file imports
    tracing.configure(endpoint=f"http://127.0.0.1:{port}/v1/traces")
    try:
        print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs); load average "
              f"{os.getloadavg()[0]:.1f}; {args.requests} requests of each")  # fmt: skip
        for request in (graph_request, chat_request):
            for _ in range(100):  # warm-up
                request()
            tracing.flush()
            cpu, own = time.process_time(), time.thread_time()
            for _ in range(args.requests):
                request()
            own = time.thread_time() - own
            tracing.flush()
            cpu = time.process_time() - cpu
            n = args.requests / 1000
            print(f"{request.__name__}: {cpu / n:.3f} ms CPU per request (building "
                  f"{own / n:.3f} ms, exporting {(cpu - own) / n:.3f} ms)")  # fmt: skip
    finally:
        tracing.shutdown()
        sink.terminate()
        sink.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--in-process", action="store_true", help="tracing off/on in place")
    parser.add_argument("--spans", action="store_true", help="the tracing work alone")
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sink:
        return serve_sink(args.sink)
    if args.in_process:
        return in_process(args)
    if args.spans:
        return spans_only(args)
    graph = build_graph()
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
