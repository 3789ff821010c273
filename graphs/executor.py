"""Runs one request through a compiled graph.

``prepare`` checks a request once (inputs against the graph's schema, asked outputs
against its outputs) and mints its id; ``run`` walks it. Every node the asked outputs
need becomes a task that waits for its parents, applies the skip rule and its
``when:``, renders its templates (compiled once per graph) and hands its kind's
``run`` (graphs/nodes.py) one typed call on its model's client, so each model
batches items from all in-flight requests. A failure names its node; ``on_error``
decides whether it fails the request, skips the node or stands in a default.
Leaving early (error, timeout, client gone) cancels the other nodes, and each
node's engine work is aborted by the client call it was waiting on.

A node that ``follows`` a generate node runs on its text as it streams (see
graphs/streams.py): the generate node pushes its text into a ``Feed`` instead of
emitting token events, and its followers read pieces of it. A guard's ``cut_when``
ends the whole run at once, with the followed node's text cut at what was shown.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from pydantic import ValidationError

from trae_groups.engine.deadlines import Deadline, Priority, tightest
from trae_groups.engine.errors import DeadlineExceeded
from trae_groups.engine.protocol import ModelClient, new_request_id
from trae_groups.graphs import tracing
from trae_groups.graphs.compile import CompiledGraph
from trae_groups.graphs.errors import GraphError, GraphTimeout, NodeError, first_error
from trae_groups.graphs.nodes import KINDS, GenerateNode, NodeCall, PythonNode, generate_request
from trae_groups.graphs.routing import VersionedModel
from trae_groups.graphs.streams import (
    Cut,
    Feed,
    cut_at_text_end,
    follow_pieces,
    follow_with_generator,
    prefill_as_text_arrives,
)

log = logging.getLogger("trae_groups.graphs")


class InputError(GraphError, ValueError):
    """The request's inputs do not fit the graph's input schema; names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class NodeRecord:
    """What happened to one node of one request."""

    status: str = "pending"  # ok | skipped | failed | default | cancelled | cut
    started: float | None = None
    finished: float | None = None
    error: str | None = None
    reason: str | None = None
    usage: dict = field(default_factory=dict)  # generate nodes: tokens, prompt_tokens, ...
    phases: Any = None  # generate nodes: the engine's EnginePhases, for traces

    @property
    def ms(self) -> float | None:
        if self.started is None or self.finished is None:
            return None
        return round((self.finished - self.started) * 1000, 3)


@dataclass
class RunResult:
    request_id: str
    outputs: dict[str, Any]
    nodes: dict[str, NodeRecord]
    ms: float
    versions: dict[str, str] = field(default_factory=dict)  # model → version this request used
    cut: dict | None = None  # a guard cut a stream: {node, follows, piece}


@dataclass
class Event:
    """A streamed event: node_started, node_finished, node_skipped, token, piece (a
    follower's result for one piece), then result or cut (``result`` set), or error
    (``error`` set)."""

    type: str
    data: dict = field(default_factory=dict)
    result: RunResult | None = None
    error: BaseException | None = None


EventSink = Callable[[Event], None]


@dataclass(frozen=True)
class Prepared:
    """A request checked once: validated inputs, the outputs asked (None: all), its
    id, time limit and deadline (the tightest of the limit and an absolute one; every
    node's engine work carries it). ``run`` trusts it."""

    inputs: dict[str, Any]
    outputs: tuple[str, ...] | None
    request_id: str
    timeout: float | None
    session: str | None = None  # keeps a user's requests on one engine replica
    deadline: Deadline | None = None
    traceparent: str | None = None  # the caller's W3C trace context (graphs/tracing.py)
    tracestate: str | None = None
    #: generate node -> the most tokens this request lets it write (below its own max_tokens)
    max_tokens: Mapping[str, int] = field(default_factory=dict)

    @property
    def limit(self) -> float | None:
        """Seconds the run may take from now: the deadline's, when its policy drops;
        None (no limit) when it finishes late (``on_deadline: finish``)."""
        if self.deadline is None:
            return self.timeout
        return max(0.0, self.deadline.remaining()) if self.deadline.drop else None


class _Request:
    """One request's state while it runs: its context (inputs and node results)."""

    def __init__(self, executor: GraphExecutor, prepared: Prepared, on_event: EventSink | None):
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.context: dict[str, Any] = {"inputs": prepared.inputs}
        self.arrival = time.time()  # wall clock: the engine ranks by it across processes
        needed = executor.graph.needed_for(prepared.outputs)
        self.records = {name: NodeRecord() for name in needed}
        self.done = {name: anyio.Event() for name in needed}
        self.skipped: set[str] = set()
        # each model's version, fixed at the start: a version removed later still serves it
        self.versions = {n: m.choose(prepared.inputs) for n, m in executor.models.items()}
        self.clients = {n: executor.models[n].clients[v] for n, v in self.versions.items()}
        self.emit: EventSink = on_event or (lambda event: None)
        self.feeds = self._feeds(executor.graph, needed)
        self.cut: Cut | None = None
        self.scope: anyio.CancelScope | None = None  # the run's: a cut cancels it
        self.trace: tracing.RunTrace | None = None  # while tracing is on (graphs/tracing.py)

    def event(self, type: str, data: dict) -> None:
        """Emit an event of this request (what nodes and feeds are handed as ``emit``)."""
        self.emit(Event(type, data))

    def _feeds(self, graph: CompiledGraph, needed: tuple[str, ...]) -> dict[str, Feed]:
        """A feed for each generate node that a node of this run follows."""
        feeds = {}
        for name in needed:
            followers = [f for f in graph.followers(name) if f in self.records]
            if followers:
                nodes = {f: graph.spec.nodes[f] for f in followers}
                feeds[name] = Feed(
                    name,
                    {f: node.follows for f, node in nodes.items()},
                    {f for f, node in nodes.items() if node.holds},
                    self.event,
                )
        return feeds

    def stop(self, cut: Cut) -> None:
        """A guard cut its stream: the followed node ends with the text shown so far,
        and every node still running is cancelled (its engine work aborted)."""
        if self.cut is not None:
            return
        self.cut = cut
        feed = self.feeds[cut.follows]
        self.context[cut.follows] = {
            "text": cut.safe_text,
            "tokens": feed.tokens,
            "finish_reason": "cut",
        }
        record = self.records[cut.follows]
        record.status = "cut"
        record.usage = {"tokens": feed.tokens, "finish_reason": "cut"}
        self.context[cut.node] = cut.result
        self.records[cut.node].status = "ok"
        self.scope.cancel()


class GraphExecutor:
    def __init__(
        self,
        graph: CompiledGraph,
        models: Mapping[str, VersionedModel | ModelClient],
        functions: Mapping[str, Callable[..., Any]] | None = None,
    ):
        self.graph = graph
        self.models = {
            name: m if isinstance(m, VersionedModel) else VersionedModel.single(name, m)
            for name, m in models.items()
        }
        self.functions = dict(functions or {})
        self.input_model = graph.spec.input_model()

    @property
    def clients(self) -> dict[str, ModelClient]:
        """Each model's client of its first version."""
        return {name: next(iter(m.clients.values())) for name, m in self.models.items()}

    # -- checking a request, once ----------------------------------------------------
    def prepare(
        self,
        inputs: Any,
        *,
        outputs: list[str] | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        session: str | None = None,
        deadline: float | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        max_tokens: Mapping[str, int] | None = None,
    ) -> Prepared:
        """Check a request (InputError names the field) and mint its id. ``deadline``
        (epoch seconds, e.g. a header's) tightens the time limit; ``max_tokens`` lowers
        generate nodes' own (node -> tokens)."""
        spec = self.graph.spec
        unknown = [o for o in outputs or [] if o not in spec.outputs]
        if unknown:
            raise InputError(
                "outputs", f"unknown output {unknown[0]!r}; known: {', '.join(spec.outputs)}"
            )
        if not isinstance(inputs, dict):
            raise InputError("(body)", "inputs must be an object")
        try:
            valid = self.input_model.model_validate(inputs).model_dump()
        except ValidationError as exc:
            where, message = first_error(exc)
            raise InputError(where or "(inputs)", message) from None
        limit = spec.timeout if timeout is None else min(timeout, spec.timeout or timeout)
        return Prepared(
            valid,
            None if outputs is None else tuple(outputs),
            request_id or new_request_id(spec.name),
            limit,
            session,
            tightest(limit, deadline, drop=spec.on_deadline == "drop"),
            traceparent=traceparent,
            tracestate=tracestate,
            max_tokens=dict(max_tokens or {}),
        )

    # -- the request path ------------------------------------------------------------
    async def run(
        self, request: Prepared | dict, *, on_event: EventSink | None = None, **prepare: Any
    ) -> RunResult:
        """Run one request (a Prepared one, or inputs that ``prepare`` checks here with
        ``outputs``, ``timeout``, ``request_id``)."""
        prepared = request if isinstance(request, Prepared) else self.prepare(request, **prepare)
        state = _Request(self, prepared, on_event)
        if tracing.enabled():
            state.trace = tracing.RunTrace(prepared.traceparent, prepared.tracestate)
        start = time.perf_counter()
        try:
            await self._run_nodes(state, prepared)
        except BaseException as exc:
            self._trace(state, exc)
            raise
        self._trace(state, None)
        result = RunResult(
            prepared.request_id,
            self.graph.outputs(state.context, prepared.outputs, partial=state.cut is not None),
            state.records,
            round((time.perf_counter() - start) * 1000, 3),
            versions={m: v for m, v in state.versions.items() if len(self.models[m].clients) > 1},
            cut=state.cut.body() if state.cut else None,
        )
        return result

    async def _run_nodes(self, state: _Request, prepared: Prepared) -> None:
        try:
            with anyio.fail_after(prepared.limit):
                async with anyio.create_task_group() as group:
                    state.scope = group.cancel_scope
                    for name in state.records:
                        group.start_soon(self._run_node, state, name)
        except TimeoutError:
            raise _timed_out(state) from None
        except BaseExceptionGroup as group_error:
            error = _first_graph_error(group_error)
            raise (_timed_out(state) if isinstance(error, DeadlineExceeded) else error) from None

    def _trace(self, state: _Request, error: BaseException | None) -> None:
        if state.trace is None:
            return
        spec = self.graph.spec
        tracing.record_run(
            spec.name, state.request_id, state.trace, spec.nodes, state.records, state.versions,
            error,
        )  # fmt: skip

    async def _run_node(self, request: _Request, name: str) -> None:
        record = request.records[name]
        node = self.graph.spec.nodes[name]
        feed = request.feeds.get(name)  # this node's stream, when others follow it
        try:
            for parent in self.graph.parents(name):
                await request.done[parent].wait()
            if node.follows is not None:  # until its stream starts, or is skipped
                await request.feeds[node.follows.node].opened.wait()
            if self._skip(request, name):
                return
            record.started = time.perf_counter()
            record.status = "running"
            request.emit(Event("node_started", {"node": name}))
            if feed is not None:
                feed.opened.set()
            on_text = feed.push if feed is not None else None
            try:
                with anyio.fail_after(node.timeout):
                    if node.follows is not None:
                        value = await self._follow(request, name, on_text)
                    else:
                        value = await self._call(request, name, on_text=on_text)
                    if feed is not None:  # its text reaches the client once guards pass it
                        feed.finish()
                        await feed.wait_passed()
            except TimeoutError:
                raise GraphTimeout(name, node.timeout) from None
            if isinstance(value, Cut):
                request.stop(value)
                return
            request.context[name] = value
            record.status = "ok"
            if isinstance(node, GenerateNode):
                record.usage = {k: value[k] for k in ("tokens", "prompt_tokens", "finish_reason")}
        except DeadlineExceeded:  # the engine dropped the work: the request's miss, not on_error's
            raise
        except Exception as exc:
            self._handle_failure(request, name, exc)
        finally:
            if record.status in ("pending", "running"):
                record.status = "cancelled"
            if feed is not None and record.status in ("skipped", "default"):
                feed.opened.set()
                feed.finish()  # its followers get no (more) pieces
            if node.holds and request.cut is None and record.status in ("ok", "skipped", "default"):
                request.feeds[node.follows.node].stop_holding(name)
            record.finished = time.perf_counter() if record.started else None
            if record.status != "skipped" and record.started is not None:
                data = {"node": name, "status": record.status, "ms": record.ms, **record.usage}
                request.emit(Event("node_finished", data))
            request.done[name].set()

    def _skip(self, request: _Request, name: str) -> bool:
        """The skip rule (docs/graphs.md): a skipped non-optional parent, or a false `when:`."""
        because = self.graph.skipped_because(name, request.skipped)
        reason = f"parent '{because}' was skipped" if because else None
        # a condition that raises is a node failure: on_error applies
        if reason is None and not self.graph.templates[name].should_run(request.context):
            reason = "condition is false"
        if reason is None:
            return False
        request.skipped.add(name)
        request.context[name] = None
        request.records[name].status = "skipped"
        request.records[name].reason = reason
        request.emit(Event("node_skipped", {"node": name, "reason": reason}))
        return True

    def _handle_failure(self, request: _Request, name: str, exc: Exception) -> None:
        node = self.graph.spec.nodes[name]
        record = request.records[name]
        record.error = (
            f"{type(exc).__name__}: {exc}" if not isinstance(exc, GraphTimeout) else str(exc)
        )
        if node.on_error == "skip":
            record.status = "skipped"
            record.reason = f"failed: {record.error}"
            request.skipped.add(name)
            request.context[name] = None
        elif node.on_error == "default":
            record.status = "default"
            request.context[name] = node.default
        else:
            record.status = "failed"
            if isinstance(exc, GraphTimeout):
                raise exc
            raise NodeError(name, exc) from exc

    def _node_call(self, request: _Request, name: str, payload: dict, **extra: Any) -> NodeCall:
        node = self.graph.spec.nodes[name]
        model = getattr(node, "model", None)
        return NodeCall(
            name=name,
            node=node,
            payload=payload,
            request_id=request.request_id,
            priority=Priority(self.graph.depth[name], request.arrival, request.prepared.deadline),
            session=request.prepared.session,
            client=request.clients[model] if model is not None else None,
            function=self.functions.get(name),
            emit=request.event,
            max_tokens=request.prepared.max_tokens.get(name),
            **extra,
        )

    async def _call(
        self, request: _Request, name: str, context: Mapping[str, Any] | None = None, **extra
    ) -> Any:
        """One node's work: render its templates, then its kind runs it."""
        context = request.context if context is None else context
        payload = self.graph.templates[name].render(context)
        source = self.graph.references.get(name)
        if source is not None:  # speculative follows: the text it drafts from
            value = context.get(source)
            text = value.get("text") if isinstance(value, Mapping) else None
            extra["reference"] = text if isinstance(text, str) else None
        call = self._node_call(request, name, payload, **extra)
        # traced: the node's engine calls carry its span's context to the engine's side
        trace = request.trace
        carrying = trace and tracing.carry(trace.headers(tracing.node_key(name)))
        try:
            return await KINDS[call.node.kind].run(call)
        finally:
            request.records[name].phases = call.engine.get("phases")
            if trace is not None:
                tracing.uncarry(carrying)

    # -- streamed edges ---------------------------------------------------------
    async def _follow(self, request: _Request, name: str, on_text) -> Any:
        """A follower's work: per piece of the followed stream, or (a generate node)
        prefilling its prompt as the text arrives, then once at the end."""
        node = self.graph.spec.nodes[name]
        followed = node.follows.node
        feed = request.feeds[followed]
        with_view = lambda view: {**request.context, followed: view}  # noqa: E731
        if isinstance(node, GenerateNode):
            await prefill_as_text_arrives(
                feed, name, prefill=lambda view: self._prefill(request, name, with_view(view))
            )
            await request.done[followed].wait()
            return await self._call(request, name, on_text=on_text)
        cut = self.graph.templates[name].cut_when
        should_cut = (
            None
            if cut is None
            else lambda view, value: cut.evaluate({**with_view(view), name: value})
        )
        function = self.functions.get(name)
        if isinstance(node, PythonNode) and inspect.isasyncgenfunction(function):
            args = self.graph.templates[name].render(with_view(feed.view(None)))["args"]
            return await follow_with_generator(
                feed, name, start=lambda texts: function(texts, **args), should_cut=should_cut,
                emit=request.event,
            )  # fmt: skip
        return await follow_pieces(
            feed,
            name,
            run_piece=lambda view: self._call(request, name, with_view(view)),
            should_cut=should_cut,
            emit=request.event,
        )

    async def _prefill(self, request: _Request, name: str, context: Mapping[str, Any]) -> None:
        """Cache the KV of a generate follower's prompt up to the text so far. Best
        effort: what fails here fails again, with its real error, in the final call."""
        try:
            prefix = cut_at_text_end(self.graph.templates[name].render(context))
            if prefix is None:
                return
            call = self._node_call(request, name, prefix)
            warm = generate_request(call, prefix, f"{call.work_id}/prefix", prefix_only=True)
            with tracing.early_prefill(request.trace, name) as traced:  # None while off
                async with contextlib.aclosing(call.client.generate(warm)) as chunks:
                    async for chunk in chunks:
                        if traced is not None:
                            traced.chunk = chunk
        except Exception as exc:
            log.debug("prefill of %s/%s skipped: %s", request.request_id, name, exc)

    # -- streaming ------------------------------------------------------------
    async def stream(self, request: Prepared | dict, **prepare: Any) -> AsyncIterator[Event]:
        """Events as they happen; ends with ``result`` or ``error`` (a GraphError).
        Closing it cancels the run, and with it every node's engine work."""
        prepared = request if isinstance(request, Prepared) else self.prepare(request, **prepare)
        send, receive = anyio.create_memory_object_stream[Event](max_buffer_size=1 << 16)

        def sink(event: Event) -> None:
            # nodes cancelled after the reader left still report: those events go nowhere
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                send.send_nowait(event)

        async def produce() -> None:
            async with send:
                try:
                    result = await self.run(prepared, on_event=sink)
                    ending = "cut" if result.cut else "result"
                    sink(Event(ending, {"outputs": result.outputs}, result=result))
                except GraphError as exc:
                    sink(Event("error", error_body(exc), error=exc))

        async with anyio.create_task_group() as group, receive:
            group.start_soon(produce)
            try:
                async for event in receive:
                    yield event
            finally:
                group.cancel_scope.cancel()


def _timed_out(request: _Request) -> GraphTimeout:
    """The graph's time ran out (its deadline passed): the nodes it had not finished."""
    dropped = tuple(n for n, r in request.records.items() if r.status == "cancelled")
    return GraphTimeout(None, request.prepared.timeout, dropped)


def error_body(exc: BaseException) -> dict:
    body = {"type": type(exc).__name__, "message": str(exc)}
    node = getattr(exc, "node", None)
    if node:
        body["node"] = node
    field_name = getattr(exc, "field", None)
    if field_name:
        body["field"] = field_name
    return body


def _first_graph_error(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_graph_error(exc)
        if isinstance(exc, GraphError):
            return exc
    return group.exceptions[0]
