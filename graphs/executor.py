"""Runs one request through a compiled graph.

Every node the requested outputs need becomes a task that waits for its parents,
applies the skip rule and its ``when:``, renders its input and submits one item to
its model's client — so each model batches items from all in-flight requests. A
failure names its node; ``on_error`` decides whether it fails the request, skips
the node or stands in a default. Leaving early (error, timeout, client gone)
cancels the other nodes, and their engine work is aborted.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from pydantic import ValidationError

from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.worker import Priority
from trae_groups.graphs.compile import CompiledGraph
from trae_groups.graphs.errors import GraphError, GraphTimeout, NodeError
from trae_groups.graphs.routing import VersionedModel
from trae_groups.graphs.spec import GenerateNode, PythonNode
from trae_groups.graphs.templates import evaluate_condition, render_template

_request_ids = itertools.count()


class InputError(GraphError, ValueError):
    """The request's inputs do not fit the graph's input schema; names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"inputs.{field}: {message}")
        self.field = field
        self.message = message


class ModelClient(Protocol):
    """How the executor reaches a model: a local engine worker or, later, a remote one."""

    async def encode(self, text: str, *, request_id: str, priority: Priority) -> dict: ...

    def generate(
        self, prompt: str, params: SamplingParams, *, request_id: str, priority: Priority
    ) -> AsyncIterator[Any]: ...

    def chat_prompt(self, messages: list[dict]) -> str: ...

    def abort(self, request_id: str) -> None: ...


@dataclass
class NodeRecord:
    """What happened to one node of one request."""

    status: str = "pending"  # ok | skipped | failed | default | cancelled
    started: float | None = None
    finished: float | None = None
    error: str | None = None
    reason: str | None = None
    usage: dict = field(
        default_factory=dict
    )  # generate nodes: tokens, prompt_tokens, finish_reason

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


@dataclass
class Event:
    """A streamed event: node_started, node_finished, token, result, error."""

    type: str
    data: dict = field(default_factory=dict)


EventSink = Callable[[Event], None]


class _Request:
    """One request's state: its context (inputs and node results) and records."""

    def __init__(self, graph: CompiledGraph, inputs: dict, request_id: str, on_event):
        self.graph = graph
        self.context: dict[str, Any] = {"inputs": inputs}
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.records: dict[str, NodeRecord] = {}
        self.done: dict[str, anyio.Event] = {}
        self.skipped: set[str] = set()
        self.versions: dict[str, str] = {}
        self.clients: dict[
            str, ModelClient
        ] = {}  # fixed at the start: a version removed later still serves it
        self.emit: EventSink = on_event or (lambda event: None)

    def priority(self, node: str) -> Priority:
        return Priority(depth=self.graph.depth[node], arrival=self.arrival)


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

    # -- the request path ------------------------------------------------------
    def validate_inputs(self, inputs: Any) -> dict:
        if not isinstance(inputs, dict):
            raise InputError("(body)", "inputs must be an object")
        try:
            return self.input_model.model_validate(inputs).model_dump()
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(inputs)"
            raise InputError(where, first["msg"]) from None

    async def run(
        self,
        inputs: dict,
        *,
        outputs: list[str] | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        on_event: EventSink | None = None,
    ) -> RunResult:
        spec = self.graph.spec
        unknown = [o for o in outputs or [] if o not in spec.outputs]
        if unknown:
            raise InputError(
                "outputs", f"unknown output {unknown[0]!r}; known: {sorted(spec.outputs)}"
            )
        request = _Request(
            self.graph,
            self.validate_inputs(inputs),
            request_id or f"{spec.name}-{next(_request_ids)}",
            on_event,
        )
        request.versions = {
            name: m.choose(request.context["inputs"]) for name, m in self.models.items()
        }
        request.clients = {
            name: self.models[name].clients[v] for name, v in request.versions.items()
        }
        needed = [n for n in self.graph.order if n in self.graph.needed_for(outputs)]
        request.done = {name: anyio.Event() for name in needed}
        request.records = {name: NodeRecord() for name in needed}
        limit = timeout if timeout is not None else spec.timeout
        start = time.perf_counter()
        try:
            with anyio.fail_after(limit):
                async with anyio.create_task_group() as group:
                    for name in needed:
                        group.start_soon(self._run_node, request, name)
        except TimeoutError:
            raise GraphTimeout(None, limit) from None
        except BaseExceptionGroup as group_error:
            raise _first_graph_error(group_error) from None
        finally:
            self._abort_leftovers(request)
        result = RunResult(
            request.request_id,
            self.graph.outputs(request.context, outputs),
            request.records,
            round((time.perf_counter() - start) * 1000, 3),
            versions={m: v for m, v in request.versions.items() if len(self.models[m].clients) > 1},
        )
        request.emit(Event("result", {"outputs": result.outputs}))
        return result

    async def _run_node(self, request: _Request, name: str) -> None:
        record = request.records[name]
        node = self.graph.spec.nodes[name]
        try:
            for parent in self.graph.parents(name):
                await request.done[parent].wait()
            if self._skip(request, name):
                return
            record.started = time.perf_counter()
            record.status = "running"
            request.emit(Event("node_started", {"node": name}))
            try:
                with anyio.fail_after(node.timeout):
                    value = await self._call(request, name)
            except TimeoutError:
                raise GraphTimeout(name, node.timeout) from None
            request.context[name] = value
            record.status = "ok"
            if isinstance(node, GenerateNode):
                record.usage = {k: value[k] for k in ("tokens", "prompt_tokens", "finish_reason")}
        except Exception as exc:
            self._handle_failure(request, name, exc)
        finally:
            if record.status in ("pending", "running"):
                record.status = "cancelled"
            record.finished = time.perf_counter() if record.started else None
            if record.status != "skipped" and record.started is not None:
                data = {"node": name, "status": record.status, "ms": record.ms, **record.usage}
                request.emit(Event("node_finished", data))
            request.done[name].set()

    def _skip(self, request: _Request, name: str) -> bool:
        """The skip rule (docs/graphs.md): a skipped non-optional parent, or a false `when:`."""
        because = self.graph.skipped_because(name, request.skipped)
        reason = f"parent '{because}' was skipped" if because else None
        condition = self.graph.spec.nodes[name].when
        # a condition that raises is a node failure: on_error applies
        if (
            reason is None
            and condition is not None
            and not evaluate_condition(condition, request.context)
        ):
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

    # -- calling a node --------------------------------------------------------
    async def _call(self, request: _Request, name: str) -> Any:
        node = self.graph.spec.nodes[name]
        context = request.context
        if isinstance(node, PythonNode):
            args = {key: _render_value(value, context) for key, value in node.args.items()}
            function = self.functions[name]
            if inspect.iscoroutinefunction(function):
                return await function(**args)
            return await anyio.to_thread.run_sync(lambda: function(**args))
        client = request.clients[node.model]
        priority = request.priority(name)
        if isinstance(node, GenerateNode):
            return await self._generate(request, name, node, client, priority)
        text = render_template(node.input, context)
        if not isinstance(text, str):
            raise TypeError(f"input must render to a string, got {type(text).__name__}")
        return await client.encode(text, request_id=request.request_id, priority=priority)

    async def _generate(self, request, name, node: GenerateNode, client, priority) -> dict:
        if node.prompt is not None:
            prompt = render_template(node.prompt, request.context)
            if not isinstance(prompt, str):
                prompt = str(prompt)
        else:
            prompt = client.chat_prompt(_render_messages(node.messages, request.context))
        p = node.params
        params = SamplingParams(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            seed=p.seed,
            stop=tuple(p.stop),
        )
        last = None
        stream = client.generate(prompt, params, request_id=request.request_id, priority=priority)
        async for out in stream:
            if out.delta_text or out.delta_token_ids:
                request.emit(Event("token", {"node": name, "text": out.delta_text}))
            last = out
        if last is None or last.error:
            raise RuntimeError(last.error if last else "no output")
        if last.finish_reason == "abort":
            raise RuntimeError("generation was aborted")
        return {
            "text": last.text,
            "tokens": len(last.token_ids),
            "finish_reason": last.finish_reason,
            "prompt_tokens": len(last.prompt_token_ids),
        }

    def _abort_leftovers(self, request: _Request) -> None:
        """Free engine work of nodes that did not finish (cancelled, failed)."""
        if all(r.status in ("ok", "skipped", "default") for r in request.records.values()):
            return
        for client in request.clients.values():
            client.abort(request.request_id)

    # -- streaming ------------------------------------------------------------
    async def stream(self, inputs: dict, **kwargs) -> AsyncIterator[Event]:
        """Events as they happen; ends with `result` or `error`. Closing it cancels the run."""
        send, receive = anyio.create_memory_object_stream[Event](max_buffer_size=1 << 16)

        async def produce() -> None:
            async with send:
                try:
                    await self.run(inputs, on_event=send.send_nowait, **kwargs)
                except GraphError as exc:
                    send.send_nowait(Event("error", error_body(exc)))

        async with anyio.create_task_group() as group, receive:
            group.start_soon(produce)
            try:
                async for event in receive:
                    yield event
            finally:
                group.cancel_scope.cancel()


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


def _render_value(value: Any, context: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        return render_template(value, context)
    if isinstance(value, dict):
        return {k: _render_value(v, context) for k, v in value.items()}
    if isinstance(value, list):
        return [_render_value(v, context) for v in value]
    return value


def _render_messages(messages, context: Mapping[str, Any]) -> list[dict]:
    if isinstance(messages, str):
        rendered = render_template(messages, context)
        if not isinstance(rendered, list):
            raise TypeError("messages must render to a list of {role, content}")
        return [dict(m) for m in rendered]
    return [{"role": m.role, "content": str(render_template(m.content, context))} for m in messages]
