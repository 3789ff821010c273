"""OpenTelemetry traces of requests: one span per request, a child span per node.

Off unless configured: ``configure()`` (embedded apps, tests), ``trae serve --otlp-endpoint
URL``, or the standard variables (``OTEL_TRACES_EXPORTER=otlp``,
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). The SDK is the
optional extra ``trae-groups[otel]``; while off nothing of it is imported and a request
pays one ``is None`` check. ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name
the service when set; ``trae-groups`` (``trae-groups-engine`` in an engine process or a
Ray engine replica) otherwise.

Spans are made when a request ends, from the executor's own ``NodeRecord`` times, so
tracing adds nothing to a node's path and a node's span is exactly the time its record
says: the request span is named ``graph <name>`` (its parent is the request's W3C
``traceparent`` header when it sends one), each node's span ``node <name>`` with its kind,
model, version, adapter, status (ok, skipped, failed, default, cancelled, cut), the
reason it was skipped, and for a generate node the tokens, prompt tokens and finish
reason. Inside a generate node's span, the engine's phases (``EnginePhases``, the times its
last output reports) are child spans ``queued`` (received to first scheduled), ``prefill``
(to the first token) and ``decode`` (to the last token, with the finish reason), and the
node span has the events ``first token`` and ``finished``; a generate follower's early
prefills (``follows:``) are child spans ``early prefill``.

Each span is built whole, once its times are known, as the SDK's ``ReadableSpan``, and
handed to the span processor: the sampler is asked once per request, when it starts, and
its decision travels in the flags (see ``_emit``).

Across processes. A request's span ids are fixed when it starts (``RunTrace``), though its
spans are built when it ends: while a node runs (or an early prefill), its span's W3C
context is the current ``carried()`` one, and the engine clients send it with the work
(the engine process's messages, the Ray replica's call). On the other side ``served_span``
makes that process's own span, ``engine <model>``, a child of that span in the same trace,
when tracing is on there too (``trae serve`` passes its OTEL_* variables on; a Ray replica
reads its own).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

_provider: Any = None  # an SDK TracerProvider once configured; None: tracing off
_processor: Any = None  # its span processor: where finished spans go
_sdk: Any = None  # the SDK names the spans are built of, imported by configure()

#: The variables that turn tracing on at start-up (configure_from_env)
ENV_SWITCHES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)
#: The service a process's spans name when the OTEL_* variables name none
SERVICE = "trae-groups"
ENGINE_SERVICE = "trae-groups-engine"  # an engine process, a Ray engine replica

#: The W3C trace context of the span the current work belongs to, as headers
#: (``traceparent``, and ``tracestate`` when the caller sent one): what engine calls carry
_carried: ContextVar[dict[str, str] | None] = ContextVar("trae_trace_carried", default=None)


def configure(
    exporter: Any = None, endpoint: str | None = None, service_name: str = SERVICE
) -> None:
    """Turn tracing on: spans go to ``exporter`` (any SDK SpanExporter, sent as each span
    ends) or, by default, to OTLP over HTTP at ``endpoint`` (None: the OTEL_* variables),
    batched. ``service_name`` is the default: ``OTEL_SERVICE_NAME`` (or ``service.name``
    in ``OTEL_RESOURCE_ATTRIBUTES``) wins, as with any OpenTelemetry SDK."""
    global _provider, _processor, _sdk
    try:
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
    provider = TracerProvider(resource=_resource(service_name))
    provider.add_span_processor(processor)  # shutdown and flush reach it through the provider
    _sdk = _sdk_names()
    _provider, _processor = provider, processor


def _resource(service_name: str) -> Any:
    """The SDK's resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, the SDK's own
    attributes), named ``service_name`` only when those variables name no service."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    if OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        return Resource.create()
    return Resource.create({SERVICE_NAME: service_name})


def _sdk_names() -> SimpleNamespace:
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import (
        NonRecordingSpan,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
        TraceState,
        get_current_span,
        set_span_in_context,
    )
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return SimpleNamespace(
        Event=Event, ReadableSpan=ReadableSpan, SpanContext=SpanContext, SpanKind=SpanKind,
        Status=Status, StatusCode=StatusCode, TraceFlags=TraceFlags, TraceState=TraceState,
        get_current_span=get_current_span, NonRecordingSpan=NonRecordingSpan,
        in_context=set_span_in_context, propagator=TraceContextTextMapPropagator(),
        scope=InstrumentationScope("trae_groups"), unset=Status(StatusCode.UNSET),
    )  # fmt: skip


def configure_from_env(service_name: str = SERVICE) -> bool:
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
    global _provider, _processor
    if _provider is not None:
        _provider.shutdown()
    _provider = _processor = None


def flush() -> None:
    """Send the spans still batched (a server's shutdown)."""
    if _provider is not None:
        _provider.force_flush()


def enabled() -> bool:
    return _provider is not None


def _random_id(bits: int) -> int:
    """A W3C id (never zero, the invalid one), as the SDK makes them."""
    return random.getrandbits(bits) or 1


# -- spans, built whole --------------------------------------------------------------------
# Every span here is built once its times are known (a request's when it ends, an engine
# call's when it returns) and handed to the span processor as the SDK's ReadableSpan: the
# sampler was asked once, when the request started (RunTrace), and its decision travels in
# the flags; building through a live SDK span would ask it again for every span, check
# and copy every attribute and take a lock per change, for spans that are already over.
def _emit(
    name: str,
    context: Any,
    parent: Any,
    start: int,
    end: int,
    attributes: dict[str, Any],
    kind: Any = None,
    events: tuple = (),
    status: Any = None,
) -> None:
    """Send one finished span (SDK SpanContexts ``context``, ``parent``; epoch ns)."""
    span = _sdk.ReadableSpan(
        name, context, parent, _provider.resource, attributes, events,
        kind=kind or _sdk.SpanKind.INTERNAL, status=status or _sdk.unset,
        start_time=start, end_time=max(start, end), instrumentation_scope=_sdk.scope,
    )  # fmt: skip
    _processor.on_end(span)


def _error_status(error: str) -> Any:
    return _sdk.Status(_sdk.StatusCode.ERROR, error)


def described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _parent_of(headers: Mapping[str, str]) -> Any:
    """The span a W3C ``traceparent``/``tracestate`` names (an SDK SpanContext), or None
    when it is missing or malformed."""
    context = _sdk.propagator.extract(headers)
    span = _sdk.get_current_span(context).get_span_context()
    return span if span.is_valid else None


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
    context), as a child of the caller's span; nothing while tracing is off here, the
    caller sent no context or did not sample it. An exception marks the span failed."""
    parent = _parent_of(headers) if _provider is not None and headers else None
    if parent is None or not parent.trace_flags.sampled:
        yield
        return
    start, status = time.time_ns(), None
    try:
        yield
    except Exception as exc:
        status = _error_status(described(exc))
        raise
    finally:
        context = _sdk.SpanContext(
            parent.trace_id, _random_id(64), False, parent.trace_flags, parent.trace_state
        )
        attributes = {"process.pid": os.getpid(), **attributes}
        _emit(name, context, parent, start, time.time_ns(), attributes, server_kind(),
              status=status)  # fmt: skip


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
        self.parent = caller  # an SDK SpanContext: the request span's parent, or None
        self.trace_id = caller.trace_id if caller else _random_id(128)
        self.tracestate = tracestate if caller else None
        self.flags = int(_sampled(caller, self.trace_id))
        self.span_id = _random_id(64)
        self._children: dict[str, int] = {}
        self.prefills: dict[str, list[EarlyPrefill]] = {}  # node -> its early prefills

    @property
    def sampled(self) -> bool:
        return bool(self.flags)

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

    def context(self, key: str | None = None) -> Any:
        """The SDK SpanContext of the request's span (or of its child ``key``)."""
        span = self.span_id if key is None else self.child_id(key)
        state = self.parent.trace_state if self.parent is not None else None
        return _sdk.SpanContext(self.trace_id, span, False, _sdk.TraceFlags(self.flags), state)

    def span(
        self,
        name: str,
        key: str | None,
        parent: Any,
        start: int,
        end: int,
        attributes: dict[str, Any],
        **options: Any,
    ) -> Any:
        """Send this request's span ``key`` (None: the request's own) under ``parent``;
        its SpanContext, the parent of its children."""
        context = self.context(key)
        _emit(name, context, parent, start, end, attributes, **options)
        return context

    def phase(self, name: str, parent: Any, start: int, end: int, **attributes: Any) -> None:
        """A span of this request no engine call names (a phase): a fresh id."""
        context = _sdk.SpanContext(
            self.trace_id, _random_id(64), False, parent.trace_flags, parent.trace_state
        )
        _emit(name, context, parent, start, end, attributes)


def _caller(traceparent: str | None, tracestate: str | None) -> Any:
    """The caller's span from its W3C headers (an SDK SpanContext); None when it sent
    none or a malformed one."""
    if not traceparent:
        return None
    headers = {"traceparent": traceparent}
    if tracestate:
        headers["tracestate"] = tracestate
    return _parent_of(headers)


def _sampled(parent: Any, trace_id: int) -> bool:
    """Whether the sampler records a request span of this trace, asked once, when the
    request starts: its spans here and the engine's side follow the flag (parent-based)."""
    if _provider is None:
        return True
    context = None if parent is None else _sdk.in_context(_sdk.NonRecordingSpan(parent))
    return _provider.sampler.should_sample(context, trace_id, "request").decision.is_sampled()


def node_key(name: str) -> str:
    return f"node {name}"


@dataclass
class EarlyPrefill:
    """One early prefill of a generate follower (``follows:``): its span's key among the
    request's children, its perf_counter times, its last chunk and what failed it."""

    key: str
    started: float
    finished: float | None = None
    chunk: Any = None  # the engine's last chunk: prompt and cached tokens
    error: str | None = None


@contextlib.contextmanager
def early_prefill(trace: RunTrace | None, node: str) -> Iterator[EarlyPrefill | None]:
    """While a follower ``node`` caches its prompt so far: a span ``early prefill`` (built
    with the node's, when the request ends) whose context its engine calls carry, so the
    engine's side of the prefill joins the request's trace too. None while off."""
    if trace is None:
        yield None
        return
    done = trace.prefills.setdefault(node, [])
    prefill = EarlyPrefill(f"{node_key(node)}/early prefill {len(done)}", time.perf_counter())
    done.append(prefill)
    token = carry(trace.headers(prefill.key))
    try:
        yield prefill
    except Exception as exc:
        prefill.error = described(exc)
        raise
    finally:
        prefill.finished = time.perf_counter()
        uncarry(token)


def record_run(
    graph: str,
    request_id: str,
    trace: RunTrace,
    nodes: Mapping[str, Any],
    records: Mapping[str, Any],
    versions: Mapping[str, str],
    error: BaseException | None,
) -> None:
    """Emit one finished request's spans (no-op while tracing is off or not sampled)."""
    if _provider is None or not trace.sampled:
        return
    end = time.time_ns()
    root = trace.context()
    for name, record in records.items():
        _node_span(name, nodes[name], record, versions, trace, root)
    attributes = {"trae.graph": graph, "trae.request_id": request_id}
    status = error_of(error, attributes)
    trace.span(f"graph {graph}", None, trace.parent, trace.wall_ns, end, attributes,
               kind=server_kind(), status=status)  # fmt: skip


def server_kind() -> Any:
    """SpanKind.SERVER: a request span's (and an engine call's) kind."""
    return _sdk.SpanKind.SERVER


def error_of(error: BaseException | None, attributes: dict[str, Any]) -> Any:
    """The status of a span that ``error`` failed (None: it did not), and its
    ``trae.error_type`` in ``attributes``."""
    if error is None:
        return None
    attributes["trae.error_type"] = type(error).__name__
    return _error_status(described(error))


def _node_span(name, node, record, versions, trace: RunTrace, parent) -> None:
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
    key = node_key(name)
    start = trace.ns(record.started)
    end = max(start, trace.ns(record.finished)) if record.finished else start
    context = trace.context(key)
    events: tuple = ()
    if record.phases is not None:
        finish = record.usage.get("finish_reason")
        events = phase_spans(trace, context, record.phases, finish, start, end)
    for i, prefill in enumerate(trace.prefills.get(name, ())):
        _prefill_span(i, prefill, trace, context, start, end)
    status = _error_status(record.error or "failed") if record.status == "failed" else None
    trace.span(f"node {name}", key, parent, start, end, attributes, events=events, status=status)


def _prefill_span(
    index: int, prefill: EarlyPrefill, trace: RunTrace, node: Any, start: int, end: int
) -> None:
    """One early prefill inside its node's span (clamped into it), with its reserved id."""
    attributes: dict[str, Any] = {"trae.prefix": index}
    if prefill.chunk is not None:
        attributes["trae.prompt_tokens"] = prefill.chunk.prompt_tokens
        attributes["trae.cached_tokens"] = prefill.chunk.cached_tokens
    begin = min(end, max(start, trace.ns(prefill.started)))
    finished = trace.ns(prefill.finished) if prefill.finished is not None else end
    status = _error_status(prefill.error) if prefill.error is not None else None
    trace.span("early prefill", prefill.key, node, begin, min(end, finished), attributes,
               status=status)  # fmt: skip


#: A generation's phases as child spans: (name, from, to) over EnginePhases' fields
PHASES = (
    ("queued", "received", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("decode", "first_token", "last_token"),
)


def phase_spans(
    trace: RunTrace,
    parent: Any,
    phases: Any,
    finish_reason: str | None,
    start: int,
    end: int,
    **attributes: Any,
) -> tuple:
    """The engine's phases as spans inside ``parent`` (a SpanContext; times clamped into
    it: the engine's clock is read in its own process); the parent's events ``first
    token`` and ``finished``, returned for it to carry."""

    def ns(seconds: float) -> int:
        return min(end, max(start, int(seconds * 1e9)))

    finished = {"trae.finish_reason": finish_reason} if finish_reason else {}
    for name, begin, until in PHASES:
        a, b = getattr(phases, begin), getattr(phases, until)
        if a is None or b is None:
            continue
        extra = finished if name == "decode" else {}
        trace.phase(name, parent, ns(a), max(ns(a), ns(b)), **attributes, **extra)
    events = []
    if phases.first_token is not None:
        events.append(_sdk.Event("first token", attributes, ns(phases.first_token)))
    if phases.last_token is not None:
        events.append(_sdk.Event("finished", {**attributes, **finished}, ns(phases.last_token)))
    return tuple(events)
