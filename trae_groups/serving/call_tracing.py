"""The trace of one OpenAI request (graphs/tracing.py has the switch and the graph spans).

An OpenAI route is a span ``openai <endpoint>`` (its parent: the request's W3C
``traceparent``/``tracestate`` headers) with, for a model call, one child ``model
<name>`` holding the engine's phases of each generation (queued, prefill, decode, and
the events first token and finished), as a generate node's span does; for a chat graph,
the graph run's own spans (``graph <name>``, its nodes) are the child. The ids are fixed
when the request is admitted and the spans built when it ends (``RunScope.end``), so the
model span can already be the parent the engine's side names (``carry``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from trae_groups.graphs import tracing

MODEL = "model"  # the key of the model span among the request's children


@dataclass
class ModelCall:
    """What one request did on its model: filled as it runs, read when it ends."""

    name: str
    attributes: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    ends: list[Any] = field(default_factory=list)  # each generation's finished chunk

    def ended(self, chunk: Any = None) -> None:
        """A generation finished (its last chunk), or the call's work as a whole (None)."""
        self.finished = time.perf_counter()
        if chunk is not None:
            self.ends.append(chunk)


class CallTrace:
    """One OpenAI request's spans; made only while tracing is on (``start``)."""

    def __init__(self, endpoint: str, model: str, headers: Mapping[str, str]):
        self.run = tracing.RunTrace(headers.get("traceparent"), headers.get("tracestate"))
        self.endpoint, self.model = endpoint, model
        self.request_id: str | None = None
        self.call: ModelCall | None = None
        self.code: int | None = None
        self.error: BaseException | None = None

    @classmethod
    def start(cls, endpoint: str, model: str, headers: Mapping[str, str]) -> CallTrace | None:
        return cls(endpoint, model, headers) if tracing.enabled() else None

    def parent(self) -> str:
        """The traceparent a graph run of this request takes: its span is the parent."""
        return self.run.headers()["traceparent"]

    def model_call(
        self, name: str, kind: str, engine_model: str, adapter: str | None, **counts: int
    ) -> ModelCall:
        """The request's work on its model (one span, made when the request ends):
        ``name`` is the graph's name for it, ``engine_model`` the engine's."""
        attributes: dict[str, Any] = {"trae.node.kind": kind, "trae.engine.model": engine_model}
        if adapter:
            attributes["trae.node.adapter"] = adapter
        attributes.update({f"trae.{key}": value for key, value in counts.items()})
        self.call = ModelCall(name, attributes)
        return self.call

    def settled(self, code: int, error: BaseException | None) -> None:
        self.code, self.error = code, error

    def finish(self) -> None:
        """Build and send the spans (once, when the request is released; not when the
        sampler left the request out)."""
        run, end = self.run, time.time_ns()
        if not tracing.enabled() or not run.sampled:
            return
        attributes = {"trae.endpoint": self.endpoint, "trae.model": self.model}
        if self.request_id:
            attributes["trae.request_id"] = self.request_id
        if self.code is not None:
            attributes["http.response.status_code"] = self.code
        status = tracing.error_of(self.error, attributes)
        if self.call is not None:
            self._model_span(run.context())
        run.span(
            f"openai {self.endpoint}", None, run.parent, run.wall_ns, max(end, run.wall_ns),
            attributes, kind=tracing.server_kind(), status=status,
        )  # fmt: skip

    def _model_span(self, parent: Any) -> None:
        call, run = self.call, self.run
        attributes = {"trae.node.model": call.name, **call.attributes}
        ends = call.ends
        if ends:
            attributes["trae.node.tokens"] = sum(c.completion_tokens for c in ends)
            attributes["trae.node.prompt_tokens"] = sum(
                c.prompt_tokens for c in ends if c.index == 0
            )
            attributes["trae.node.finish_reason"] = ends[0].finish_reason or "stop"
        start = run.ns(call.started)
        end = max(start, run.ns(call.finished or time.perf_counter()))
        context = run.context(MODEL)
        events: list = []
        for i, chunk in enumerate(c for c in ends if c.phases is not None):
            which = {"trae.generation": i} if len(ends) > 1 else {}
            events += tracing.phase_spans(
                run, context, chunk.phases, chunk.finish_reason, start, end, **which
            )
        run.span(f"model {call.name}", MODEL, parent, start, end, attributes, events=tuple(events))


@contextlib.contextmanager
def carrying(trace: CallTrace | None) -> Iterator[None]:
    """The request's model span as the current work's trace context: what its engine calls
    carry (nothing while tracing is off)."""
    if trace is None:
        yield
        return
    token = tracing.carry(trace.run.headers(MODEL))
    try:
        yield
    finally:
        tracing.uncarry(token)
