"""The live graph page: ``GET /dashboard`` (one self-contained HTML page, no CDN, so it
works offline) and ``GET /v1/stats``, the JSON it polls.

``/v1/stats`` gives each served graph as its DAG with every node's figures, each engine
model's queue and batches, and the memory pool. Every figure is read from the app's own
metrics registry, the samples ``/metrics`` exports, so a number on the page and the same
number on a Grafana panel never disagree. Figures are running totals and cumulative
histograms; the page turns two readings into rates and quantiles, as PromQL does.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from trae_groups.serving.app_state import AppState, ServedGraph

__all__ = ["dashboard", "snapshot", "stats"]


class Samples:
    """One reading of a registry: sample name → [(labels, value)]."""

    def __init__(self, registry: CollectorRegistry):
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in registry.collect():
            for s in family.samples:
                self.by_name[s.name].append((s.labels, s.value))

    def total(self, name: str, **match: str) -> float:
        """The sum of a sample's series whose labels match (over the others: version,
        replica, status...)."""
        return sum(v for labels, v in self.by_name.get(name, ()) if _matches(labels, match))

    def by(self, name: str, key: str, **match: str) -> dict[str, float]:
        """A sample summed per value of one label."""
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.by_name.get(name, ()):
            if _matches(labels, match):
                out[labels.get(key, "")] += v
        return dict(out)

    def histogram(self, name: str, **match: str) -> dict[str, Any]:
        """A histogram summed over the labels not matched: cumulative bucket counts by
        upper bound (``+Inf`` last), count and sum."""
        buckets = self.by(f"{name}_bucket", "le", **match)
        bounds = sorted(buckets, key=float)
        return {
            "le": [float(b) if b != "+Inf" else None for b in bounds],
            "counts": [buckets[b] for b in bounds],
            "count": self.total(f"{name}_count", **match),
            "sum": self.total(f"{name}_sum", **match),
        }


def _matches(labels: Mapping[str, str], match: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def _node(served: ServedGraph, name: str, samples: Samples) -> dict[str, Any]:
    graph, info = served.graph, served.nodes.get(name)
    node = served.spec.nodes[name]
    where = {"graph": served.name, "node": name}
    return {
        "name": name,
        "kind": node.kind,
        "model": info.model if info is not None else "",  # the engine worker it runs on
        "depth": graph.depth[name],
        "parents": list(graph.parents(name)),
        "runs": samples.by("trae_node_runs_total", "status", **where),
        "errors": samples.total("trae_node_errors_total", **where),
        "latency": samples.histogram("trae_node_latency_seconds", **where),
    }


def _graph(served: ServedGraph, samples: Samples) -> dict[str, Any]:
    where = {"graph": served.name}
    return {
        "name": served.name,
        "nodes": [_node(served, name, samples) for name in served.graph.order],
        "inflight": served.inflight,
        "requests": samples.by("trae_graph_requests_total", "code", **where),
        "rejected": samples.by("trae_graph_rejected_total", "reason", **where),
        "deadline_misses": samples.total("trae_graph_deadline_misses_total", **where),
        "latency": samples.histogram("trae_graph_latency_seconds", **where),
    }


def _models(samples: Samples) -> dict[str, dict[str, Any]]:
    """Each engine model, summed over replicas: its queue now, what is running, its
    batches (tokens per step for an LLM, items per batch for an encoder)."""
    models: dict[str, dict[str, Any]] = {}
    for model, waiting in samples.by("trae_llm_waiting_requests", "model").items():
        models[model] = {
            "kind": "llm",
            "waiting": waiting,
            "running": samples.total("trae_llm_running_requests", model=model),
            "batch": samples.histogram("trae_llm_batch_tokens", model=model),
        }
    for model, waiting in samples.by("trae_encoder_queue_items", "model").items():
        models[model] = {
            "kind": "encoder",
            "waiting": waiting,
            "running": 0.0,
            "batch": samples.histogram("trae_encoder_batch_size", model=model),
        }
    for model, entry in models.items():
        entry["queue"] = samples.histogram("trae_engine_queue_seconds", model=model)
        entry["pages"] = samples.total("trae_pool_model_pages", model=model, state="used")
    return models


def _pool(samples: Samples) -> dict[str, float]:
    """The memory pool (every replica's pools added up), in pages."""
    pages = samples.by("trae_pool_pages", "state")
    return {
        "capacity": samples.total("trae_pool_capacity_pages"),
        "used": pages.get("used", 0.0),
        "cached": pages.get("cached", 0.0),
        "free": pages.get("free", 0.0),
    }


def snapshot(state: AppState) -> dict[str, Any]:
    """One reading of everything the page draws (blocking: it collects the registry,
    which reads the engine's stats)."""
    samples = Samples(state.metrics.registry)
    return {
        "time": time.time(),
        "ready": samples.total("trae_ready") == 1.0,
        "graphs": [_graph(served, samples) for served in state.graphs.values()],
        "models": _models(samples),
        "pool": _pool(samples),
    }


async def stats(request: Request) -> Response:
    """``GET /v1/stats``: the snapshot, read on the thread /metrics renders on, so it
    answers while python nodes fill the shared pool (server.metrics)."""
    from trae_groups.serving.server import _METRICS_THREAD

    state: AppState = request.app.state.trae
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(_METRICS_THREAD, snapshot, state)
    return JSONResponse(body, headers={"cache-control": "no-store"})


@cache
def page() -> str:
    return resources.files("trae_groups.serving").joinpath("dashboard.html").read_text("utf-8")


async def dashboard(request: Request) -> Response:
    """``GET /dashboard``: the page; everything it needs is inline."""
    return HTMLResponse(page(), headers={"cache-control": "no-store"})
