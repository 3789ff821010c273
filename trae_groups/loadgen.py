"""A small load generator for ``trae bench``: N concurrent clients share M requests,
in process (the executor) or over HTTP; the report has throughput and p50/p99.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trae_groups.bench")


@dataclass(frozen=True)
class Load:
    clients: int
    requests: int


def sample_inputs(spec) -> dict:
    """A plausible value for every required input (benchmarks without --input)."""
    samples = {
        "str": "hello, where is my order to paris?",
        "int": 1,
        "float": 0.5,
        "bool": True,
        "list[str]": ["hello", "world"],
        "messages": [{"role": "user", "content": "hello, where is my order?"}],
    }
    return {name: samples[i.type] for name, i in spec.inputs.items() if not i.optional}


async def in_process(load: Load, executor: Any, inputs: dict) -> dict:
    report = await drive(load, lambda: executor.run(inputs))
    return {"graph": executor.graph.spec.name, "target": "in-process", **report}


async def over_http(load: Load, url: str, graph: str, inputs: dict, timeout: float) -> dict:
    """The load over HTTP/1.1 keep-alive connections, one per client.

    aiohttp, not httpx: a load generator must cost far less than the server it
    measures, and httpx's pool spent about 12 ms of CPU per request at 64 connections
    here (aiohttp about 0.4 ms), enough to starve a 2-core server of the CPU it needs.
    """
    import aiohttp

    endpoint = f"{url.rstrip('/')}/v1/graphs/{graph}"
    connector = aiohttp.TCPConnector(limit=load.clients)
    limit = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=limit) as session:

        async def call() -> None:
            async with session.post(endpoint, json={"inputs": inputs}) as response:
                body = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {body[:200]!r}")

        report = await drive(load, call)
    return {"graph": graph, "target": url, **report}


async def drive(load: Load, call: Callable[[], Awaitable[Any]]) -> dict:
    """``load.clients`` workers share ``load.requests`` calls; failures are counted."""
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    remaining = iter(range(load.requests))

    async def client() -> None:
        nonlocal errors, first_error
        for _ in remaining:
            start = time.perf_counter()
            try:
                await call()
            except Exception as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                log.debug("request failed: %s", exc)
                continue
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(load.clients)))
    seconds = time.perf_counter() - start
    return {
        "clients": load.clients,
        "requests": len(latencies) + errors,
        "errors": errors,
        "seconds": seconds,
        "throughput_rps": len(latencies) / seconds if seconds > 0 else 0.0,
        "mean_ms": sum(latencies) / len(latencies) * 1000 if latencies else 0.0,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "first_error": first_error,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for a server a benchmark starts)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 180.0) -> None:
    """Poll ``url``/ready until it answers 200; RuntimeError after ``timeout``."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not get ready within {timeout:g} s")
