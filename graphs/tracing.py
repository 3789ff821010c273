"""OpenTelemetry traces of requests: one span per request, a child span per node.

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

Across processes. A request's span ids are fixed when it starts (``RunTrace``), though its
spans are built when it ends: while a node runs, its span's W3C context is the current
``carried()`` one, and the engine clients send it with the work (the engine process's
messages, the Ray replica's call). On the other side ``served_span`` makes that process's
own span, ``engine <model>``, a child of the node's span in the same trace, when tracing is
on there too (``trae serve`` passes its OTEL_* variables on; a Ray replica reads its own).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from typing import Any

_tracer: Any = None  # an SDK tracer once configured; None: tracing off
_provider: Any = None

#: The variables that turn tracing on at start-up (configure_from_env)
ENV_SWITCHES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)

#: The W3C trace context of the span the current work belongs to, as headers
#: (``traceparent``, and ``tracestate`` when the caller sent one): what engine calls carry
_carried: ContextVar[dict[str, str] | None] = ContextVar("trae_trace_carried", default=None)
#: (trace id, span id) the next span takes: a span built late keeps the ids it was given
_reserved: ContextVar[tuple[int, int] | None] = ContextVar("trae_trace_reserved", default=None)


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
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}), id_generator=_ids()()
    )
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("trae_groups")


def configure_from_env(service_name: str = "trae-groups") -> bool:
    """``configure()`` when the standard variables ask for OTLP traces; whether they did."""
    wanted = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if wanted == "none":
        return False
    if wanted == "otlp" or any(os.environ.get(name) for name in ENV_SWITCHES):
        configure(service_name=service_name)
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


@functools.cache
def _ids() -> type:
    """The SDK's random ids, except for a span built with the ids reserved for it."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class ReservedIds(RandomIdGenerator):
        def generate_span_id(self) -> int:
            reserved = _reserved.get()
            return reserved[1] if reserved else super().generate_span_id()

        def generate_trace_id(self) -> int:
            reserved = _reserved.get()
            return reserved[0] if reserved else super().generate_trace_id()

    return ReservedIds


def _random_id(bits: int) -> int:
    """A W3C id (never zero, the invalid one), as the SDK makes them."""
    return random.getrandbits(bits) or 1


# -- the context that crosses to the engine -------------------------------------------------
def carried() -> dict[str, str] | None:
    """The W3C headers the current work's engine calls carry (None: not traced)."""
    return _carried.get()


def carry(headers: dict[str, str] | None) -> Token:
    """Make ``headers`` the current work's trace context; ``uncarry`` the token after."""
    return _carried.set(headers)


def uncarry(token: Token) -> None:
    _carried.reset(token)


@contextlib.contextmanager
def served_span(name: str, headers: Mapping[str, str] | None, **attributes: Any) -> Iterator[None]:
    """The span of work that came from another process with ``headers`` (its W3C trace
    context), as a child of the caller's span; nothing while tracing is off here or the
    caller sent no context. An exception marks the span failed."""
    if _tracer is None or not headers:
        yield
        return
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(dict(headers))
    span = _tracer.start_span(
        name,
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"process.pid": os.getpid(), **attributes},
    )
    try:
        yield
    except Exception as exc:
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()


# -- one request's trace ---------------------------------------------------------------
class RunClock:
    """A request's start on both clocks: NodeRecords hold perf_counter times, spans epoch ns."""

    def __init__(self) -> None:
        self.wall_ns = time.time_ns()
        self.perf = time.perf_counter()

    def ns(self, perf: float | None) -> int:
        return self.wall_ns + int(((perf if perf is not None else self.perf) - self.perf) * 1e9)


class RunTrace(RunClock):
    """A traced request's clock and span ids, fixed when it starts: its spans are built
    when it ends, but work sent meanwhile to another process already names them as
    parents. ``traceparent``/``tracestate``: the caller's W3C headers, if it sent them."""

    def __init__(self, traceparent: str | None = None, tracestate: str | None = None) -> None:
        super().__init__()
        caller = _caller(traceparent, tracestate)
        self.parent = caller[0] if caller else None  # an OTel context: the request span's parent
        self.trace_id = caller[1].trace_id if caller else _random_id(128)
        self.tracestate = tracestate if caller else None
        self.flags = int(_sampled(self.parent, self.trace_id))
        self.span_id = _random_id(64)
        self._children: dict[str, int] = {}

    def child_id(self, key: str) -> int:
        """The span id of the request's child ``key`` (a node), the same on every call."""
        if key not in self._children:
            self._children[key] = _random_id(64)
        return self._children[key]

    def headers(self, key: str | None = None) -> dict[str, str]:
        """The W3C headers naming the request's span (or its child ``key``'s) as parent."""
        span = self.span_id if key is None else self.child_id(key)
        headers = {"traceparent": f"00-{self.trace_id:032x}-{span:016x}-{self.flags:02x}"}
        if self.tracestate:
            headers["tracestate"] = self.tracestate
        return headers

    def start_span(self, name: str, key: str | None, context: Any, start_ns: int, **options: Any):
        """A span of this request with its reserved ids (``key``: a child's; None: the
        request's own)."""
        span_id = self.span_id if key is None else self.child_id(key)
        token = _reserved.set((self.trace_id, span_id))
        try:
            return _tracer.start_span(name, context=context, start_time=start_ns, **options)
        finally:
            _reserved.reset(token)


def _caller(traceparent: str | None, tracestate: str | None) -> tuple[Any, Any] | None:
    """The caller's span from its W3C headers, as (OTel context, span context); None when
    it sent none or a malformed one."""
    if not traceparent:
        return None
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers = {"traceparent": traceparent}
    if tracestate:
        headers["tracestate"] = tracestate
    context = TraceContextTextMapPropagator().extract(headers)
    span = get_current_span(context).get_span_context()
    return (context, span) if span.is_valid else None


def _sampled(parent: Any, trace_id: int) -> bool:
    """Whether the sampler will record a request span of this trace, asked when the request
    starts: the engine's side records its spans by the flag it is sent (parent-based)."""
    if _provider is None:
        return True
    return _provider.sampler.should_sample(parent, trace_id, "request").decision.is_sampled()


def node_key(name: str) -> str:
    return f"node {name}"


def record_run(
    graph: str,
    request_id: str,
    trace: RunTrace,
    nodes: Mapping[str, Any],
    records: Mapping[str, Any],
    versions: Mapping[str, str],
    error: BaseException | None,
) -> None:
    """Emit one finished request's spans (no-op while tracing is off)."""
    if _tracer is None:
        return
    from opentelemetry.trace import SpanKind, set_span_in_context

    end = time.time_ns()
    root = trace.start_span(
        f"graph {graph}",
        None,
        trace.parent,
        trace.wall_ns,
        kind=SpanKind.SERVER,
        attributes={"trae.graph": graph, "trae.request_id": request_id},
    )
    if error is not None:
        set_error(root, error)
    inside = set_span_in_context(root)
    for name, record in records.items():
        _node_span(name, nodes[name], record, versions, trace, inside)
    root.end(end_time=end)


def set_error(span: Any, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.set_attribute("trae.error_type", type(error).__name__)


def _node_span(name, node, record, versions, trace: RunTrace, context) -> None:
    from opentelemetry.trace import Status, StatusCode

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
    start = trace.ns(record.started)
    span = trace.start_span(f"node {name}", node_key(name), context, start, attributes=attributes)
    if record.status == "failed":
        span.set_status(Status(StatusCode.ERROR, record.error or "failed"))
    end = max(start, trace.ns(record.finished)) if record.finished else start
    if record.phases is not None:
        phase_spans(span, record.phases, record.usage.get("finish_reason"), start, end)
    span.end(end_time=end)


#: A generation's phases as child spans: (name, from, to) over EnginePhases' fields
PHASES = (
    ("queued", "received", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("decode", "first_token", "last_token"),
)


def phase_spans(
    parent: Any, phases: Any, finish_reason: str | None, start: int, end: int, **attributes: Any
) -> None:
    """The engine's phases inside ``parent`` (times clamped into it: the engine's clock is
    read in its own process)."""
    from opentelemetry.trace import set_span_in_context

    inside = set_span_in_context(parent)

    def ns(seconds: float) -> int:
        return min(end, max(start, int(seconds * 1e9)))

    finished = {"trae.finish_reason": finish_reason} if finish_reason else {}
    for name, begin, until in PHASES:
        a, b = getattr(phases, begin), getattr(phases, until)
        if a is None or b is None:
            continue
        extra = finished if name == "decode" else {}
        child = _tracer.start_span(
            name, context=inside, start_time=ns(a), attributes={**attributes, **extra}
        )
        child.end(end_time=max(ns(a), ns(b)))
    if phases.first_token is not None:
        parent.add_event("first token", attributes=attributes, timestamp=ns(phases.first_token))
    if phases.last_token is not None:
        parent.add_event(
            "finished", attributes={**attributes, **finished}, timestamp=ns(phases.last_token)
        )
