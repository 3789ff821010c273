"""OpenTelemetry traces of graph requests: one span per request, a child span per node.

Off unless configured: ``configure()`` (embedded apps, tests), ``trae serve --otlp-endpoint
URL``, or the standard variables (``OTEL_TRACES_EXPORTER=otlp``,
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). The SDK is the
optional extra ``trae-groups[otel]``; while off nothing of it is imported and a request
pays one ``is None`` check.

Spans are made when a request ends, from the executor's own ``NodeRecord`` times, so
tracing adds nothing to a node's path and a node's span is exactly the time its record
says: the request span is named ``graph <name>`` (its parent is the request's W3C
``traceparent`` header when it sends one), each node's span ``node <name>`` with its kind,
model, version, adapter, status (ok, skipped, failed, default, cancelled, cut), the
reason it was skipped, and for a generate node the tokens, prompt tokens and finish
reason. Inside a generate node's span, the engine's phases (``EnginePhases``, the times its
last output reports) are child spans ``queued`` (received to first scheduled), ``prefill``
(to the first token) and ``decode`` (to the last token, with the finish reason), and the
node span has the events ``first token`` and ``finished``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

_tracer: Any = None  # an SDK tracer once configured; None: tracing off
_provider: Any = None

#: The variables that turn tracing on at start-up (configure_from_env)
ENV_SWITCHES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


def configure(
    exporter: Any = None, endpoint: str | None = None, service_name: str = "trae-groups"
) -> None:
    """Turn tracing on: spans go to ``exporter`` (any SDK SpanExporter, sent as each span
    ends) or, by default, to OTLP over HTTP at ``endpoint`` (None: the OTEL_* variables),
    batched."""
    global _tracer, _provider
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "tracing needs the OpenTelemetry SDK: pip install 'trae-groups[otel]'"
        ) from exc
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
    else:
        processor = SimpleSpanProcessor(exporter)
    shutdown()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("trae_groups")


def configure_from_env() -> bool:
    """``configure()`` when the standard variables ask for OTLP traces; whether they did."""
    wanted = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if wanted == "none":
        return False
    if wanted == "otlp" or any(os.environ.get(name) for name in ENV_SWITCHES):
        configure()
        return True
    return False


def shutdown() -> None:
    """Flush and stop: spans still batched are sent; tracing is off afterwards."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


def flush() -> None:
    """Send the spans still batched (a server's shutdown)."""
    if _provider is not None:
        _provider.force_flush()


def enabled() -> bool:
    return _tracer is not None


class RunClock:
    """A request's start on both clocks: NodeRecords hold perf_counter times, spans epoch ns."""

    def __init__(self) -> None:
        self.wall_ns = time.time_ns()
        self.perf = time.perf_counter()

    def ns(self, perf: float | None) -> int:
        return self.wall_ns + int(((perf if perf is not None else self.perf) - self.perf) * 1e9)


def record_run(
    graph: str,
    request_id: str,
    traceparent: str | None,
    clock: RunClock,
    nodes: Mapping[str, Any],
    records: Mapping[str, Any],
    versions: Mapping[str, str],
    error: BaseException | None,
) -> None:
    """Emit one finished request's spans (no-op while tracing is off)."""
    if _tracer is None:
        return
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = None
    if traceparent:
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    end = time.time_ns()
    root = _tracer.start_span(
        f"graph {graph}",
        context=parent,
        kind=SpanKind.SERVER,
        start_time=clock.wall_ns,
        attributes={"trae.graph": graph, "trae.request_id": request_id},
    )
    if error is not None:
        root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        root.set_attribute("trae.error_type", type(error).__name__)
    inside = set_span_in_context(root)
    for name, record in records.items():
        _node_span(name, nodes[name], record, versions, clock, inside, Status, StatusCode)
    root.end(end_time=end)


def _node_span(name, node, record, versions, clock, context, Status, StatusCode) -> None:
    model = getattr(node, "model", None)
    attributes: dict[str, Any] = {
        "trae.node": name,
        "trae.node.kind": getattr(node, "kind", None) or "python",
        "trae.node.status": record.status,
    }
    if model is not None:
        attributes["trae.node.model"] = model
        attributes["trae.node.version"] = versions.get(model, "default")
    if getattr(node, "adapter", None):
        attributes["trae.node.adapter"] = node.adapter
    if record.reason:
        attributes["trae.node.reason"] = record.reason
    for key in ("tokens", "prompt_tokens", "finish_reason"):
        if key in record.usage:
            attributes[f"trae.node.{key}"] = record.usage[key]
    start = clock.ns(record.started)
    span = _tracer.start_span(
        f"node {name}", context=context, start_time=start, attributes=attributes
    )
    if record.status == "failed":
        span.set_status(Status(StatusCode.ERROR, record.error or "failed"))
    end = max(start, clock.ns(record.finished)) if record.finished else start
    if record.phases is not None:
        _phase_spans(span, record.phases, record.usage.get("finish_reason"), start, end)
    span.end(end_time=end)


#: A generation's phases as child spans: (name, from, to) over EnginePhases' fields
PHASES = (
    ("queued", "received", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("decode", "first_token", "last_token"),
)


def _phase_spans(node_span, phases, finish_reason, start: int, end: int) -> None:
    """The engine's phases inside a node's span (times clamped into it: the engine's
    clock is read in its own process)."""
    from opentelemetry.trace import set_span_in_context

    inside = set_span_in_context(node_span)

    def ns(seconds: float) -> int:
        return min(end, max(start, int(seconds * 1e9)))

    for name, begin, until in PHASES:
        a, b = getattr(phases, begin), getattr(phases, until)
        if a is None or b is None:
            continue
        attributes = (
            {"trae.finish_reason": finish_reason} if name == "decode" and finish_reason else {}
        )
        child = _tracer.start_span(name, context=inside, start_time=ns(a), attributes=attributes)
        child.end(end_time=max(ns(a), ns(b)))
    if phases.first_token is not None:
        node_span.add_event("first token", timestamp=ns(phases.first_token))
    if phases.last_token is not None:
        finished = {"trae.finish_reason": finish_reason} if finish_reason else {}
        node_span.add_event("finished", attributes=finished, timestamp=ns(phases.last_token))
