"""One request's run scope: admission to release, its outcome recorded once.

Every route that runs work on a served graph (``POST /v1/graphs/{name}`` and the OpenAI
routes) enters one ``RunScope``, so the per-request protocol is written once::

    async with RunScope(state, served) as run:  # 503 not ready / draining, 429 full
        prepared = run.prepare(inputs, ...)  # 422 bad inputs, 503 past the deadline estimate
        result = await run.executor.run(prepared)
        run.succeeded(result)  # recorded before the answer goes out
        return answer  # leaving the scope releases the executor

What the scope owns:

- **admission**: ready, the graph's in-flight cap, its capacity (trae_groups/serving/admission.py),
  and pinning the request to the executor it was admitted on (a reload does not change it
  mid-request);
- **deadline admission**, when the run is prepared (``prepare``);
- **the outcome, recorded exactly once on every exit**: an answer (``succeeded``), an error
  (``failed``, or an exception leaving the scope), or the client leaving (no outcome by the
  end: 499). A graph run's outcome goes to the graph's metrics, service rate and node
  times; an OpenAI request's to ``trae_openai_requests_total`` too;
- **release**, however the request ends. A streamed answer outlives the route: ``stream``
  hands the scope to the ``EventStream``, which ends it when the stream ends.

A new per-request concern (a trace span, an outcome metric) belongs in ``_settle`` (once,
with the outcome) or ``end`` (once, at release).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

from trae_groups.engine.deadlines import Deadline
from trae_groups.graphs.errors import GraphTimeout, NodeError
from trae_groups.graphs.executor import GraphExecutor, Prepared, RunResult
from trae_groups.serving.admission import overloaded, unreachable
from trae_groups.serving.app_state import AppState, ServedGraph
from trae_groups.serving.http_errors import (
    deadline_unreachable,
    error_body,
    overloaded_error,
    queue_full,
    status_of,
)
from trae_groups.serving.http_io import Emit, EventStream

CLIENT_GONE = 499  # the status metrics record when the client left first (nginx's)


class RunScope:
    """One admitted request, from admission to release (see the module docstring).

    ``graph``: the request runs the graph, so its outcome is the graph's (a chat graph
    through the OpenAI routes too); False for an OpenAI call on one of its models.
    ``endpoint``: (OpenAI endpoint, model id) when it came through an OpenAI route.
    """

    def __init__(
        self,
        state: AppState,
        served: ServedGraph,
        *,
        graph: bool = True,
        endpoint: tuple[str, str] | None = None,
        trace: Any = None,
    ):
        self.state = state
        self.served = served
        self.graph = graph
        self.endpoint = endpoint
        self.trace = trace  # an OpenAI request's CallTrace (serving/call_tracing.py), if traced
        self.executor: GraphExecutor | None = None  # set at admission
        self.deadline: Deadline | None = None  # set when the run is prepared
        self.start = time.perf_counter()  # the run's start (perf_counter), for latencies
        self._closers: list[Callable[[], None]] = []
        self._settled = False
        self._streaming = False
        self._ended = False

    # -- the scope -------------------------------------------------------------------
    async def __aenter__(self) -> RunScope:
        self._admit()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._streaming and error is None:
            return  # the EventStream ends the scope when the stream ends
        if isinstance(error, Exception):
            self.failed(error)
        self.end()

    def _admit(self) -> None:
        """503 (not ready, draining), 429 (the graph's cap, or its queue would outlast
        the time limit), else the request is in flight on the graph's executor now."""
        state, served = self.state, self.served
        state.require_ready(served.name)
        if served.inflight >= served.limit:
            state.metrics.observe_rejected(served.name, "queue_full")
            raise queue_full(served.name, served.limit, max(1, state.config.retry_after_s))
        budget = served.spec.timeout or state.config.max_queue_wait_s
        retry = overloaded(served.rate, served.inflight, budget)
        if retry is not None:
            state.metrics.observe_rejected(served.name, "overloaded")
            raise overloaded_error(served.name, budget, retry)
        state.entered(served)
        self.executor = served.enter()

    def prepare(self, inputs: Mapping[str, Any], **options: Any) -> Prepared:
        """The graph run, checked (``GraphExecutor.prepare``: 422) and admitted by its
        deadline; the run's clock starts here."""
        prepared = self.executor.prepare(inputs, **options)
        self.deadline = prepared.deadline
        self._admit_deadline(prepared.deadline)
        self.start = time.perf_counter()
        return prepared

    def _admit_deadline(self, deadline: Deadline | None) -> None:
        """503 with Retry-After and the estimate when the graph drops late work and the
        estimate says the request cannot make its deadline (trae_groups/serving/admission.py)."""
        if deadline is None or not deadline.drop or not self.state.config.deadline_admission:
            return
        served, graph = self.served, self.executor.graph
        path = served.node_times.critical_path(graph.order, graph.parents)
        refusal = unreachable(served.rate, served.inflight, path, deadline.remaining())
        if refusal is not None:
            self.state.metrics.observe_rejected(served.name, "deadline")
            raise deadline_unreachable(served.name, refusal)

    def closing(self, close: Callable[[], None]) -> None:
        """Run ``close()`` when the scope ends, before the release (an engine abort)."""
        self._closers.append(close)

    def stream(
        self, produce: Callable[[Emit], Awaitable[None]], headers: Mapping[str, str] | None = None
    ) -> EventStream:
        """The answer as Server-Sent Events; the scope ends when the stream does."""
        self._streaming = True
        return EventStream(produce, self.end, headers)

    def end(self) -> None:
        """Record the outcome if none was (the client left: 499), close, release.
        Idempotent: a stream's close and the scope's exit may both call it."""
        if self._ended:
            return
        self._ended = True
        self._settle(CLIENT_GONE)
        try:
            for close in self._closers:
                close()
        finally:
            self.served.leave(self.executor)
            self.state.released(self.served)
            if self.trace is not None:
                self.trace.finish()

    # -- the outcome, once -----------------------------------------------------------
    def succeeded(self, result: RunResult | None = None) -> None:
        """The answer is ready; ``result``: the graph run's (None for a model call)."""
        self._settle(200, result)

    def failed(self, error: BaseException) -> None:
        """The request ends with ``error`` (its status and body from http_errors)."""
        self._settle(status_of(error), error=error)

    def _settle(
        self, code: int, result: RunResult | None = None, error: BaseException | None = None
    ) -> None:
        """The first outcome is the request's; later ones are ignored."""
        if self._settled:
            return
        self._settled = True
        if self.trace is not None:
            self.trace.settled(code, error)
        if self.graph:
            self._record_graph(code, result, error)
        if self.endpoint is not None:
            endpoint, model = self.endpoint
            self.state.metrics.openai_requests.labels(endpoint, model, str(code)).inc()
            if code == 200 and not self.graph:  # a model call ran to its result
                self.served.rate.completed_one()

    def _record_graph(
        self, code: int, result: RunResult | None, error: BaseException | None
    ) -> None:
        """A graph run's outcome: requests, errors, node outcomes, deadline misses and
        goodput in metrics; a result also teaches the service rate and node times."""
        metrics, served, name = self.state.metrics, self.served, self.served.name
        if error is not None:
            metrics.observe_request(name, code)
            metrics.observe_error(name, error_body(error)["error"]["type"])
            if isinstance(error, NodeError):
                metrics.node_errors.labels(name, error.node).inc()
            if self.deadline is not None and isinstance(error, GraphTimeout) and error.node is None:
                metrics.observe_deadline_miss(name, "dropped", error.dropped)
        elif result is None:
            metrics.observe_request(name, CLIENT_GONE)
        else:
            served.rate.completed_one()
            for node, record in result.nodes.items():
                if record.status == "ok" and record.ms is not None:
                    served.node_times.observe(node, record.ms / 1000.0)
            metrics.observe_request(name, 200, time.perf_counter() - self.start)
            metrics.observe_nodes(name, result.nodes, self.start, node_versions(served, result))
            self._observe_in_time(result)

    def _observe_in_time(self, result: RunResult) -> None:
        """An answer is goodput when it came within its deadline (always, without one);
        a late one (``on_deadline: finish``) is a miss, as are its nodes that ended late."""
        name, deadline = self.served.name, self.deadline
        if deadline is None or not deadline.passed():
            self.state.metrics.goodput.labels(name).inc()
            return
        # the deadline on the run's perf_counter clock, to compare with node records
        due = time.perf_counter() + deadline.remaining()
        late = tuple(
            n for n, r in result.nodes.items() if r.finished is not None and r.finished > due
        )
        self.state.metrics.observe_deadline_miss(name, "late", late)


def node_versions(served: ServedGraph, result: RunResult) -> dict[str, str]:
    """The model version each node of a run used: the run's pick for a model with
    several versions, else the model's only one ("default" for a plain ``source:``)."""
    versions = {}
    for node in result.nodes:
        model = getattr(served.spec.nodes.get(node), "model", None)
        if model is not None and model in served.spec.models:
            only = next(iter(served.spec.models[model].sources))
            versions[node] = result.versions.get(model, only)
    return versions
