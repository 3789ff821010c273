"""Prometheus metrics for one app, on its own registry (never the global one), so two
apps in one process never collide.

Two sources. The request path observes what it sees as it happens (graph and node
outcomes, latencies, tokens as they stream). The engine's counters are read when
``/metrics`` is scraped, by a collector, so the engine thread never pays for
metrics. See docs/serving.md for the list.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from trae_groups.engine.protocol import EngineStats, ModelStats, Window

if TYPE_CHECKING:  # torch's module; `trae validate` reads this one's buckets without torch
    from trae_groups.engine.memory_pool import PoolStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# 1 ms to 120 s, 1-2.5-5 a decade and finer past 10 s: a CPU's p99 of a graph with an LLM
# in it is seconds to tens of seconds, and a histogram_quantile reads no higher than the
# largest finite bound (a 500 ms top once reported a p99 of 500 ms that was over 10 s)
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
)  # fmt: skip
INFERENCE_MS_BUCKETS = tuple(round(b * 1000, 3) for b in LATENCY_BUCKETS)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class NodeInfo:
    """What a node runs on, for labels: its kind and its engine worker's name."""

    kind: str
    model: str


class Metrics:
    """Every metric of one app; the server calls the ``observe_*`` methods. ``buckets``:
    histogram name -> upper bounds, for those of ``HISTOGRAM_BUCKETS`` that change."""

    def __init__(self, buckets: Mapping[str, Iterable[float]] | None = None) -> None:
        unknown = sorted(set(buckets or {}) - set(HISTOGRAM_BUCKETS))
        if unknown:
            raise ValueError(f"buckets: not histograms of ours: {', '.join(unknown)}")
        self.buckets = {**HISTOGRAM_BUCKETS, **{k: tuple(v) for k, v in (buckets or {}).items()}}
        r = self.registry = CollectorRegistry()
        graph, node = ["graph"], ["graph", "node"]
        versioned = [*node, "version"]  # the model version the node ran ("" for python nodes)
        self.requests = Counter(
            "trae_graph_requests", "Graph requests answered, by HTTP status", [*graph, "code"],
            registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "trae_graph_errors", "Graph requests that failed, by error type", [*graph, "type"],
            registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "trae_graph_rejected",
            "Requests turned away before running (queue_full, overloaded, deadline, "
            "not_ready, draining)",
            [*graph, "reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "trae_graph_inflight_requests", "Requests running now", graph, registry=r
        )
        self.latency = Histogram(
            "trae_graph_latency_seconds", "Graph request latency (run time)", graph,
            buckets=self.buckets["trae_graph_latency_seconds"], registry=r,
        )  # fmt: skip
        self.inference_latency = Histogram(
            "inference_latency", "Graph inference latency in milliseconds", graph,
            buckets=self.buckets["inference_latency"], registry=r,
        )  # fmt: skip
        self.node_runs = Counter(
            "trae_node_runs", "Node outcomes (ok, skipped, failed, default, cancelled)",
            [*versioned, "status"], registry=r,
        )  # fmt: skip
        self.node_errors = Counter(
            "trae_node_errors", "Nodes that failed (also those on_error skipped or defaulted)",
            node, registry=r,
        )  # fmt: skip
        self.node_latency = Histogram(
            "trae_node_latency_seconds", "Node run time, start to result", versioned,
            buckets=self.buckets["trae_node_latency_seconds"], registry=r,
        )  # fmt: skip
        self.node_queue = Histogram(
            "trae_node_queue_seconds",
            "Time from the request's start to the node's start (waiting for its parents; "
            "time in the engine's queue is trae_engine_queue_seconds, per model)",
            versioned, buckets=self.buckets["trae_node_queue_seconds"], registry=r,
        )  # fmt: skip
        self.deadline_misses = Counter(
            "trae_graph_deadline_misses",
            "Requests that missed their deadline: dropped at it (on_deadline: drop) or "
            "answered late (finish)", [*graph, "action"], registry=r,
        )  # fmt: skip
        self.node_deadline_misses = Counter(
            "trae_node_deadline_misses",
            "Nodes unfinished at their request's deadline: dropped, or finished late",
            [*node, "action"], registry=r,
        )  # fmt: skip
        self.goodput = Counter(
            "trae_graph_goodput",
            "Requests answered within their deadline (every answer, for requests without one)",
            graph, registry=r,
        )  # fmt: skip
        self.openai_requests = Counter(
            "trae_openai_requests", "OpenAI-compatible requests, by endpoint, model and status",
            ["endpoint", "model", "code"], registry=r,
        )  # fmt: skip

    # -- the request path -----------------------------------------------------------
    def observe_request(self, graph: str, code: int, seconds: float | None = None) -> None:
        self.requests.labels(graph, str(code)).inc()
        if seconds is not None:
            self.latency.labels(graph).observe(seconds)
            self.inference_latency.labels(graph).observe(seconds * 1000.0)

    def observe_error(self, graph: str, error_type: str) -> None:
        self.errors.labels(graph, error_type).inc()

    def observe_rejected(self, graph: str, reason: str) -> None:
        self.rejected.labels(graph, reason).inc()

    def observe_deadline_miss(self, graph: str, action: str, nodes: Iterable[str]) -> None:
        """One request missed its deadline; ``nodes``: those unfinished at it."""
        self.deadline_misses.labels(graph, action).inc()
        for node in nodes:
            self.node_deadline_misses.labels(graph, node, action).inc()

    def observe_nodes(
        self,
        graph: str,
        result_nodes: Mapping[str, Any],
        start: float,
        versions: Mapping[str, str] | None = None,
    ) -> None:
        """Per-node outcomes of one finished (or failed) run; ``start`` is perf_counter;
        ``versions``: node → the model version it ran (a canary's series stand apart)."""
        for name, record in result_nodes.items():
            version = (versions or {}).get(name, "")
            self.node_runs.labels(graph, name, version, record.status).inc()
            if record.error is not None:  # failed, whatever its on_error made of it
                self.node_errors.labels(graph, name).inc()
            if record.started is not None:
                queued = max(0.0, record.started - start)
                self.node_queue.labels(graph, name, version).observe(queued)
            if record.ms is not None:
                self.node_latency.labels(graph, name, version).observe(record.ms / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def watch_engine(
        self,
        stats: Callable[[], Mapping[str, EngineStats]],
        graphs: Callable[[], Mapping[str, Mapping[str, NodeInfo]]],
        ready: Callable[[], bool],
    ) -> EngineCollector:
        collector = EngineCollector(stats, graphs, ready, self.buckets)
        self.registry.register(collector)
        return collector


# ---------------------------------------------------------------- engine, at scrape time


class _CumulativeHistogram:
    """Bucket counts kept across scrapes, fed by the new values since the last one."""

    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def add(self, values: Iterable[float]) -> None:
        for value in values:
            i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
            self.counts[i] += 1
            self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        return _cumulate(zip(self.bounds, self.counts, strict=False), sum(self.counts))


def _cumulate(pairs: Iterable[tuple[float, int]], total: int) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, count in pairs:
        running += count
        out.append((_le(bound), running))
    out.append(("+Inf", total))
    return out


def _le(bound: float) -> str:
    return str(float(bound))


def _histogram_from_sizes(sizes: Mapping[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets from an encoder's {batch size: how many batches}."""
    per_bucket = [0] * len(BATCH_BUCKETS)
    total = 0
    for size, count in sizes.items():
        total += count
        for i, bound in enumerate(BATCH_BUCKETS):
            if size <= bound:
                per_bucket[i] += count
                break
    summed = float(sum(size * count for size, count in sizes.items()))
    return _cumulate(zip(BATCH_BUCKETS, per_bucket, strict=True), total), summed


class EngineCollector(Collector):
    """Reads the engine's counters when /metrics is scraped."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, EngineStats]],
        graphs: Callable[[], Mapping[str, Mapping[str, NodeInfo]]],
        ready: Callable[[], bool],
        buckets: Mapping[str, tuple[float, ...]] | None = None,
    ):
        self._buckets = buckets or {}  # a graph's monitoring: section's, by histogram name
        self._stats = stats  # replica -> its engine's stats ("local" in one process)
        self._graphs = graphs
        self._ready = ready
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, ...], _CumulativeHistogram] = {}
        self._seen: dict[tuple[str, ...], int] = {}
        self._busy_marks: dict[str, tuple[float, float]] = {}  # replica -> (busy, wall)

    def describe(self) -> list[Metric]:
        return []  # names are dynamic; never collect at registration

    def collect(self) -> Iterable[Metric]:
        ready = GaugeMetricFamily("trae_ready", "1 when every model is loaded and serving")
        ready.add_metric([], 1.0 if self._ready() else 0.0)
        yield ready
        yield from _process_metrics()
        yield from self._node_info()
        merged: dict[str, Metric] = {}
        with self._lock:
            for replica, stats in sorted(self._stats().items()):
                families = chain(
                    self._engine(replica, stats),
                    self._pool(stats.pool, stats.models),
                    self._workers(replica, stats.models),
                    _memory_metrics(stats),
                )
                for family in families:  # every engine series carries its replica
                    into = merged.setdefault(
                        family.name,
                        Metric(family.name, family.documentation, family.type, family.unit),
                    )
                    into.samples.extend(
                        s._replace(labels={"replica": replica, **s.labels}) for s in family.samples
                    )
        yield from merged.values()

    def _node_info(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "trae_node_info", "Which model each node runs on (1)", labels=["graph", "node", "kind", "model"]
        )  # fmt: skip
        for graph, nodes in self._graphs().items():
            for node, node_info in nodes.items():
                info.add_metric([graph, node, node_info.kind, node_info.model], 1.0)
        yield info

    def _engine(self, replica: str, stats: EngineStats) -> Iterable[Metric]:
        info = InfoMetricFamily("trae_engine", "The engine's attention backend and device")
        info.add_metric(
            [],
            {"attention_backend": stats.attention_backend, "device": stats.device,
             "dtype": stats.dtype, "kv_cache_dtype": stats.kv_cache_dtype},
        )  # fmt: skip
        yield info
        steps = CounterMetricFamily("trae_engine_steps", "Batches the engine loop has run")
        steps.add_metric([], float(stats.steps))
        yield steps
        yield _counter(
            "trae_engine_busy_seconds", "Time the engine thread spent stepping", stats.busy_seconds
        )
        gauge = GaugeMetricFamily(
            "device_utilization",
            "Fraction of wall time the engine thread was busy stepping, since the last scrape",
            labels=["device"],
        )
        now = time.monotonic()
        last_busy, last_wall = self._busy_marks.get(replica, (0.0, now))
        self._busy_marks[replica] = (stats.busy_seconds, now)
        elapsed = now - last_wall
        share = (stats.busy_seconds - last_busy) / elapsed if elapsed > 0 else 0.0
        gauge.add_metric([stats.device], min(1.0, max(0.0, share)))
        yield gauge

    def _pool(self, stats: PoolStats, models: Iterable[str]) -> Iterable[Metric]:
        pages = GaugeMetricFamily("trae_pool_pages", "Pool pages by state", labels=["state"])
        for state in ("used", "free", "cached"):
            pages.add_metric([state], float(getattr(stats, f"{state}_pages")))
        yield pages
        yield _gauge("trae_pool_capacity_pages", "Pages in the pool", stats.num_pages)
        yield _gauge("trae_pool_page_bytes", "Bytes per page", stats.page_bytes)
        yield _gauge("trae_pool_usage_percent", "Pool pages in use, percent", 100 * stats.usage)
        by_model = GaugeMetricFamily(
            "trae_pool_model_pages", "Pages a model holds", labels=["model", "state"]
        )
        percent = GaugeMetricFamily(
            "trae_pool_model_usage_percent",
            "Percent of the pool a model holds in use",
            labels=["model"],
        )
        used = {_model_of(k): v for k, v in stats.pages_by_owner.items()}
        cached = {_model_of(k): v for k, v in stats.cached_by_owner.items()}
        for model in sorted(set(models) | set(used) | set(cached)):
            by_model.add_metric([model, "used"], float(used.get(model, 0)))
            by_model.add_metric([model, "cached"], float(cached.get(model, 0)))
            percent.add_metric([model], 100.0 * used.get(model, 0) / max(1, stats.num_pages))
        yield by_model
        yield percent
        yield _gauge(
            "trae_prefix_cache_hit_rate", "Prefix-cache hits per lookup", stats.prefix_hit_rate
        )
        yield _counter("trae_prefix_cache_queries", "Prefix-cache lookups", stats.prefix_queries)
        yield _counter("trae_prefix_cache_hits", "Prefix-cache hits", stats.prefix_hits)
        yield _counter("trae_pool_evictions", "Cached pages evicted for room", stats.evictions)

    def _workers(self, replica: str, models: Mapping[str, ModelStats]) -> Iterable[Metric]:
        llms = {name: m for name, m in models.items() if m.kind == "llm"}
        encoders = {name: m for name, m in models.items() if m.kind == "encoder"}
        yield from _llm_metrics(llms)
        yield from _encoder_metrics(encoders)
        for name, doc, window, buckets, among in _WINDOWS:
            family = HistogramMetricFamily(name, doc, labels=["model"])
            for model, m in (llms if among == "llm" else models).items():
                key = (replica, window, model)
                bounds = self._buckets.get(name, buckets)
                hist = self._window(key, bounds, m.windows.get(window, Window()))
                family.add_metric([model], hist.buckets(), hist.total)
            yield family

    def _window(
        self, key: tuple[str, ...], buckets: tuple[float, ...], window: Window
    ) -> _CumulativeHistogram:
        """A histogram kept across scrapes from a model's recent-values window and its
        running count: the values new since the last scrape are the window's tail."""
        hist = self._windows.setdefault(key, _CumulativeHistogram(buckets))
        new = min(len(window.recent), window.count - self._seen.get(key, 0))
        if new > 0:
            hist.add(window.recent[-new:])
        self._seen[key] = window.count
        return hist


#: Histograms built at scrape time from the engine's windows: (name, meaning, window,
#: buckets, which models). Time to first token has one definition: from the engine
#: receiving the request to the step that sampled its first token.
_WINDOWS = (
    ("trae_engine_queue_seconds",
     "Time from submit to the first batch that runs it (LLM admission, encoder batch)",
     "queue_seconds", TOKEN_BUCKETS, "all"),
    ("trae_time_to_first_token_seconds",
     "Time to first token: the engine receiving the request to its first token",
     "ttft_seconds", TOKEN_BUCKETS, "llm"),
    ("trae_inter_token_latency_seconds", "Time between two tokens of one sequence",
     "itl_seconds", TOKEN_BUCKETS, "llm"),
    ("trae_llm_batch_tokens", "Tokens per LLM step (prefill chunks plus decodes)",
     "batch_tokens", BATCH_BUCKETS, "llm"),
)  # fmt: skip

#: The histograms whose bounds a graph's ``monitoring:`` section may set, and their
#: defaults (graphs/monitoring.py reads the section; serving/buckets.py checks it).
HISTOGRAM_BUCKETS: dict[str, tuple[float, ...]] = {
    "trae_graph_latency_seconds": LATENCY_BUCKETS,
    "inference_latency": INFERENCE_MS_BUCKETS,
    "trae_node_latency_seconds": LATENCY_BUCKETS,
    "trae_node_queue_seconds": LATENCY_BUCKETS,
    **{name: buckets for name, _doc, _window, buckets, _among in _WINDOWS},
}


def _llm_metrics(stats: Mapping[str, ModelStats]) -> Iterable[Metric]:
    gauges = [
        ("trae_llm_running_requests", "Sequences being decoded or prefilled", "running"),
        ("trae_llm_waiting_requests", "Sequences waiting for admission", "waiting"),
    ]
    for name, doc, attr in gauges:
        family = GaugeMetricFamily(name, doc, labels=["model"])
        for model, m in stats.items():
            family.add_metric([model], float(getattr(m, attr)))
        yield family
    cache = [  # engine/constraints.py: measured bytes of compiled constraints kept for reuse
        ("trae_llm_constraint_cache_bytes", "Bytes of compiled constraints cached",
         "constraint_cache_bytes"),
        ("trae_llm_constraint_cache_entries", "Compiled constraints cached",
         "constraint_cache_entries"),
    ]  # fmt: skip
    for name, doc, key in cache:
        family = GaugeMetricFamily(name, doc, labels=["model"])
        for model, m in stats.items():
            if key in m.counters:
                family.add_metric([model], m.counters[key])
        yield family
    counters = [
        ("trae_llm_generated_tokens", "Tokens generated", "generated_tokens"),
        ("trae_llm_prompt_tokens", "Prompt tokens prefilled", "prompt_tokens"),
        ("trae_llm_cached_prompt_tokens", "Prompt tokens the prefix cache served", "cached_tokens"),
        ("trae_llm_preemptions", "Sequences preempted for room", "preemptions"),
        ("trae_llm_steps", "Batches run", "steps"),
        (
            "trae_llm_deadline_drops",
            "Sequences the engine dropped past their deadline",
            "deadline_drops",
        ),
        (
            "trae_llm_constraint_refusals",
            "Constraints refused for compiling to more than max_constraint_bytes",
            "constraint_refusals",
        ),
    ]
    for name, doc, key in counters:
        family = CounterMetricFamily(name, doc, labels=["model"])
        for model, m in stats.items():
            family.add_metric([model], m.counters.get(key, 0.0))
        yield family
    yield from _speculative_metrics(stats)


def _speculative_metrics(stats: Mapping[str, ModelStats]) -> Iterable[Metric]:
    """Speculative decoding (engine/speculative.py), for the models that speculate."""
    families = [
        (CounterMetricFamily, "trae_llm_spec_proposed_tokens",
         "Tokens proposed by speculative decoding and verified", "spec_proposed_tokens"),
        (CounterMetricFamily, "trae_llm_spec_accepted_tokens",
         "Proposed tokens the model agreed with (kept)", "spec_accepted_tokens"),
        (CounterMetricFamily, "trae_llm_spec_drafting_seconds",
         "Time spent proposing tokens", "spec_drafting_seconds"),
        (CounterMetricFamily, "trae_llm_spec_off_steps",
         "Steps without speculation because the batch was large", "spec_off_steps"),
        (CounterMetricFamily, "trae_llm_spec_reference_proposed_tokens",
         "Of the proposed tokens, those taken from a reference text (method follows)",
         "spec_reference_proposed_tokens"),
        (CounterMetricFamily, "trae_llm_spec_reference_accepted_tokens",
         "Of the accepted tokens, those taken from a reference text (method follows)",
         "spec_reference_accepted_tokens"),
        (GaugeMetricFamily, "trae_llm_spec_acceptance_rate",
         "Accepted over proposed tokens since start", "spec_acceptance_rate"),
    ]  # fmt: skip
    for kind, name, doc, key in families:
        family = kind(name, doc, labels=["model"])
        for model, m in stats.items():
            if key in m.counters:
                family.add_metric([model], m.counters[key])
        yield family


def _encoder_metrics(stats: Mapping[str, ModelStats]) -> Iterable[Metric]:
    queue = GaugeMetricFamily("trae_encoder_queue_items", "Items waiting", labels=["model"])
    batches = CounterMetricFamily("trae_encoder_batches", "Batches run", labels=["model"])
    items = CounterMetricFamily("trae_encoder_items", "Items encoded", labels=["model"])
    drops = CounterMetricFamily(
        "trae_encoder_deadline_drops", "Items the engine dropped past their deadline",
        labels=["model"],
    )  # fmt: skip
    padding = GaugeMetricFamily(
        "trae_encoder_padding_ratio", "Padded tokens per real token", labels=["model"]
    )
    sizes = HistogramMetricFamily(
        "trae_encoder_batch_size", "Items per encoder batch", labels=["model"]
    )
    for model, m in stats.items():
        queue.add_metric([model], float(m.waiting))
        batches.add_metric([model], m.counters.get("batches", 0.0))
        items.add_metric([model], m.counters.get("items", 0.0))
        drops.add_metric([model], m.counters.get("deadline_drops", 0.0))
        padding.add_metric([model], m.counters.get("padding_ratio", 0.0))
        buckets, summed = _histogram_from_sizes(m.batch_sizes)
        sizes.add_metric([model], buckets, summed)
    yield from (queue, batches, items, drops, padding, sizes)


#: A scrape reads rss, anon and file from the kernel's counters; pss needs a walk of every
#: mapping (engine/memory.py process_memory), done at most this often and reused between.
PSS_EVERY_S = 15.0
_pss: list = [-PSS_EVERY_S, None]  # when last read, its value (None: not known here)


def _process_memory() -> dict[str, int]:
    from trae_groups.monitor import process_memory

    now = time.monotonic()
    if now - _pss[0] >= PSS_EVERY_S:
        full = process_memory()
        _pss[:] = [now, full.get("pss")]
        return full
    cheap = process_memory(pss=False)
    return cheap if _pss[1] is None else cheap | {"pss": _pss[1]}


def _process_metrics() -> Iterable[Metric]:
    """This process's memory as the MemoryProfiler samples it (trae_groups/monitor.py)."""
    from trae_groups.monitor import device_memory

    process = GaugeMetricFamily(
        "trae_process_memory_bytes",
        "Resident memory of this process: rss, pss, anon (heap, private copies), file "
        "(mapped weight files)",
        labels=["kind"],
    )
    for kind, value in _process_memory().items():
        process.add_metric([kind], float(value))
    yield process
    device = GaugeMetricFamily(
        "trae_device_memory_bytes",
        "CUDA memory: allocated by tensors, reserved by torch, used (all processes), total",
        labels=["kind"],
    )
    for kind, value in device_memory().items():
        device.add_metric([kind], float(value))
    yield device


def _memory_metrics(stats: EngineStats) -> Iterable[Metric]:
    """Weights each model holds (packed and quantized included) and on-demand residency."""
    held = GaugeMetricFamily(
        "trae_model_weight_bytes",
        "Bytes of weights a loaded model holds: total, shared (also used by another "
        "model) and private (copies only it can use: packed, quantized)",
        labels=["model", "kind"],
    )
    params = GaugeMetricFamily(
        "trae_model_parameters", "Weight elements a loaded model holds", labels=["model"]
    )
    for model, w in sorted(stats.weights.items()):
        for kind, value in (("total", w.bytes), ("shared", w.shared_bytes),
                            ("private", w.private_bytes)):  # fmt: skip
            held.add_metric([model, kind], float(value))
        params.add_metric([model], float(w.parameters))
    yield held
    yield params
    if stats.weight_budget is not None:
        yield _gauge("trae_weight_budget_bytes", "Weight bytes held at most", stats.weight_budget)
    resident = GaugeMetricFamily(
        "trae_model_resident", "1 while an on-demand model is loaded", labels=["model"]
    )
    waiting = GaugeMetricFamily(
        "trae_model_load_waiting_requests",
        "Requests waiting for an on-demand model to load",
        labels=["model"],
    )
    loads = CounterMetricFamily("trae_model_loads", "On-demand model loads", labels=["model"])
    evictions = CounterMetricFamily(
        "trae_model_evictions", "On-demand models evicted for room", labels=["model"]
    )
    for model, r in sorted(stats.residency.items()):
        resident.add_metric([model], 1.0 if r.resident else 0.0)
        waiting.add_metric([model], float(r.waiting))
        loads.add_metric([model], float(r.loads))
        evictions.add_metric([model], float(r.evictions))
    yield from (resident, waiting, loads, evictions)


def _model_of(owner: str) -> str:
    return owner.removeprefix("encoder:")


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], float(value) if not math.isnan(value) else 0.0)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], float(value))
    return family
