"""Goodput under overload: deadline scheduling with early drop against the policy before it.

The bench graph (bench/graph.py: classify → tag → generate on the engine benchmark's
Qwen3) is served over real HTTP twice in one process, with the same models:

- ``deadline``: the engine orders waiting work by deadline (``scheduling: deadline``)
  and the server refuses at admission what its estimate says cannot make its deadline
  (503, ``deadline_admission``);
- ``current``: the order before deadlines (``scheduling: graph``: deeper, then older)
  and admission by capacity only. Both cut a request at its deadline (504), as a
  graph ``timeout`` always did.

Its capacity is measured first (closed loop, requests/s). Then the same open-loop
Poisson schedule at ``--load`` × that capacity is sent to each, half the requests with
a tight deadline and half with a loose one (multiples of one request's latency
alone). Goodput = requests answered 200 within their deadline (client clock) per
second of the schedule. Runs alternate between the two, so load from elsewhere hits
both alike; medians of ``--runs``.

    python bench/slo.py [--runs 3] [--seconds 30] [--load 2.0] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import graph as bench_graph
import peers

from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

TIGHT, LOOSE = 2.0, 6.0  # deadlines, in multiples of one request's latency alone
CLIENTS = 64  # closed-loop clients that measure capacity (enough to fill the batches)
WARM_CLIENTS = 8  # closed-loop clients that warm each server up (and measure its rate)
TIMEOUT_LINE = "timeout: {loose}s\n"


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the schedule's start
    text: str
    deadline: float  # seconds


@dataclass(frozen=True)
class Outcome:
    arrival: Arrival
    status: int
    latency: float

    @property
    def good(self) -> bool:
        return self.status == 200 and self.latency <= self.arrival.deadline


def serve(graph_file: Path, scheduling: str, admission: bool) -> ServerThread:
    engine = EngineConfig(pool_bytes=256 << 20, max_num_batched_tokens=1024, scheduling=scheduling)
    config = ServerConfig(
        engine=engine, deadline_admission=admission, max_inflight=4096, access_log=False
    )
    return ServerThread(create_app([graph_file], config)).start()


async def _post(http: httpx.AsyncClient, text: str, timeout: float | None = None) -> int:
    body: dict = {"inputs": {"text": text}}
    if timeout is not None:
        body["timeout"] = timeout
    return (await http.post("/v1/graphs/app", json=body)).status_code


def alone_latency(server: ServerThread, texts: list[str]) -> float:
    async def run() -> list[float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            times = []
            for text in texts:
                start = time.perf_counter()
                assert await _post(http, text) == 200
                times.append(time.perf_counter() - start)
            return times

    return statistics.median(asyncio.run(run()))


def capacity(server: ServerThread, texts: list[str], clients: int, seconds: float) -> float:
    """Requests/s answered by ``clients`` closed-loop clients (no deadline pressure)."""

    codes: dict[int, int] = {}

    async def run() -> int:
        stop = time.perf_counter() + seconds
        done = 0

        async def client(i: int) -> None:
            nonlocal done
            while time.perf_counter() < stop:
                code = await _post(http, texts[(i + done) % len(texts)])
                codes[code] = codes.get(code, 0) + 1
                done += code == 200

        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            await asyncio.gather(*(client(i) for i in range(clients)))
        return done

    start = time.perf_counter()
    done = asyncio.run(run())
    if done == 0:
        raise SystemExit(f"no request answered while measuring capacity: {codes}")
    return done / (time.perf_counter() - start)


def schedule(rate: float, seconds: float, texts: list[str], alone: float, seed: int):
    """Poisson arrivals at ``rate``; each request tight or loose at random (seeded)."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < seconds:
        deadline = (TIGHT if rng.random() < 0.5 else LOOSE) * alone
        arrivals.append(Arrival(t, rng.choice(texts), deadline))
        t += rng.expovariate(rate)
    return arrivals


def open_loop(server: ServerThread, arrivals: list[Arrival]) -> list[Outcome]:
    async def one(http: httpx.AsyncClient, arrival: Arrival, start: float) -> Outcome:
        await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
        sent = time.perf_counter()
        try:
            status = await _post(http, arrival.text, arrival.deadline)
        except httpx.HTTPError:
            status = 0
        return Outcome(arrival, status, time.perf_counter() - sent)

    async def run() -> list[Outcome]:
        limits = httpx.Limits(max_connections=len(arrivals) + 1)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            start = time.perf_counter()
            return await asyncio.gather(*(one(http, a, start) for a in arrivals))

    return asyncio.run(run())


def summary(outcomes: list[Outcome], seconds: float) -> dict:
    tight = [o for o in outcomes if o.arrival.deadline == min(a.arrival.deadline for a in outcomes)]
    ok = [o.latency for o in outcomes if o.status == 200]
    codes: dict[int, int] = {}
    for o in outcomes:
        codes[o.status] = codes.get(o.status, 0) + 1
    return {
        "goodput": sum(o.good for o in outcomes) / seconds,
        "good_tight": sum(o.good for o in tight) / max(1, len(tight)),
        "good_loose": sum(o.good for o in outcomes if o not in tight)
        / max(1, len(outcomes) - len(tight)),
        "p99_ok": statistics.quantiles(ok, n=100)[98] if len(ok) >= 2 else float("nan"),
        "ok_late": sum(1 for o in outcomes if o.status == 200 and not o.good),
        "codes": dict(sorted(codes.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the schedule")
    parser.add_argument("--load", type=float, default=2.0, help="arrival rate / capacity")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds, args.new_tokens = 1, 5.0, 8
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    peers.quiet_known_warnings()
    rng = random.Random(0)
    vocab_words = bench_graph.words(3000, rng)
    texts = [" ".join(rng.choices(vocab_words, k=rng.randint(12, 24))) for _ in range(64)]
    root = Path(tempfile.mkdtemp(prefix="trae-slo-bench-"))
    folders = {
        **bench_graph.build_encoders(root, vocab_words),
        "dialog": bench_graph.build_dialog(root, vocab_words),
    }
    text = bench_graph.GRAPH.format(new=args.new_tokens, **folders)
    policies = {"deadline": ("deadline", True), "current": ("graph", False)}
    servers: dict[str, ServerThread] = {}
    # latency alone and capacity first, on a server without a time limit (64 requests
    # at once take longer than a loose deadline on a busy machine: they would all 504)
    (root / "app.yaml").write_text(text)
    probe = serve(root / "app.yaml", "graph", False)
    alone = alone_latency(probe, texts[:5])
    cap = capacity(probe, texts, clients=CLIENTS, seconds=max(4.0, args.seconds / 3))
    probe.stop()
    rate = args.load * cap
    # the graph's own timeout is the loose deadline, so capacity admission (both
    # policies) has the budget a user would give it
    timed = text.replace("inputs:", TIMEOUT_LINE.format(loose=LOOSE * alone) + "inputs:", 1)
    (root / "app.yaml").write_text(timed)
    for name, (scheduling, admission) in policies.items():
        servers[name] = serve(root / "app.yaml", scheduling, admission)
    for server in servers.values():  # both measure their rate alike before the schedule
        capacity(server, texts, clients=WARM_CLIENTS, seconds=4.0)
    print(f"bench graph classify → tag → generate({args.new_tokens}); {torch.get_num_threads()} "
          f"threads; {peers.machine_load()}")  # fmt: skip
    print(f"  one request alone: {alone * 1000:.0f} ms; capacity {cap:.2f} req/s ({CLIENTS} closed-loop clients); "
          f"open loop at {rate:.2f} req/s ({args.load:g}x) for {args.seconds:g} s; deadlines "
          f"{TIGHT:g}x ({TIGHT * alone:.2f} s) and {LOOSE:g}x ({LOOSE * alone:.2f} s), half each")  # fmt: skip
    results: dict[str, list[dict]] = {name: [] for name in servers}
    for run in range(args.runs):
        arrivals = schedule(rate, args.seconds, texts, alone, seed=run)
        order = list(servers) if run % 2 == 0 else list(reversed(servers))
        for name in order:
            outcome = summary(open_loop(servers[name], arrivals), args.seconds)
            results[name].append(outcome)
            print(f"  run {run + 1} {name:8s} goodput {outcome['goodput']:6.2f} req/s  "
                  f"tight in time {outcome['good_tight']:5.1%}  loose {outcome['good_loose']:5.1%}  "
                  f"p99 of 200s {outcome['p99_ok']:.2f} s  late 200s {outcome['ok_late']}  "
                  f"codes {outcome['codes']}")  # fmt: skip
    for server in servers.values():
        server.stop()
    ratios = [
        d["goodput"] / c["goodput"] if c["goodput"] else float("inf")
        for d, c in zip(results["deadline"], results["current"], strict=True)
    ]
    med = {n: statistics.median(r["goodput"] for r in rs) for n, rs in results.items()}
    print(f"  goodput (median): deadline {med['deadline']:.2f} req/s, current {med['current']:.2f} "
          f"req/s; ratio per run {[round(r, 2) for r in ratios]}, median "
          f"{statistics.median(ratios):.2f}x (target >= 1.5x)")  # fmt: skip


if __name__ == "__main__":
    main()
