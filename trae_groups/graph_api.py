"""The graph routes: ``POST /v1/graphs/{name}`` (JSON, or SSE with ``stream: true``),
``GET /v1/graphs`` and ``GET /v1/graphs/{name}`` (input and output schemas, DAG).

A streamed run sends ``node_started``, ``node_finished``, ``node_skipped`` and
``token`` events as they happen, then ``result`` (the same body as a JSON answer) or
``error`` (the error body plus ``status``), then ``done``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trae_groups.app_state import CLIENT_GONE, AppState, ServedGraph
from trae_groups.graphs.executor import Event, RunResult
from trae_groups.graphs.spec import GenerateNode, GraphSpec
from trae_groups.http_errors import HTTPError, bad_request, error_body, status_of
from trae_groups.http_io import (
    Emit,
    EventStream,
    ResultResponse,
    new_request_id,
    read_json,
    sse,
    until_disconnect,
)


class RunRequest(BaseModel):
    """The body of ``POST /v1/graphs/{name}``."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    inputs: dict[str, Any] = Field(default_factory=dict, description="the graph's inputs")
    outputs: list[str] | None = Field(None, description="outputs to compute (default: all)")
    stream: bool = Field(False, description="answer with Server-Sent Events")
    timeout: float | None = Field(None, gt=0, description="seconds; capped by the graph's own")


def parse_run_request(body: Any) -> RunRequest:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object: {inputs, outputs?, stream?, timeout?}")
    try:
        return RunRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{where}: {first['msg']}" if where else first["msg"], where) from None


def result_body(result: RunResult) -> dict:
    nodes = {}
    for name, record in result.nodes.items():
        entry: dict[str, Any] = {"status": record.status, "ms": record.ms}
        if record.reason:
            entry["reason"] = record.reason
        if record.error:
            entry["error"] = record.error
        nodes[name] = entry
    body = {
        "request_id": result.request_id,
        "outputs": result.outputs,
        "nodes": nodes,
        "ms": result.ms,
    }
    if result.versions:  # models with several versions: the one this request used
        body["versions"] = result.versions
    return body


def _timeout(served: ServedGraph, asked: float | None) -> float | None:
    own = served.spec.timeout
    if asked is None or own is None:
        return asked if own is None else own
    return min(asked, own)


def _check_outputs(served: ServedGraph, outputs: list[str] | None) -> None:
    for name in outputs or []:
        if name not in served.spec.outputs:
            known = ", ".join(served.spec.outputs)
            raise HTTPError(
                422, f"unknown output '{name}'; known: {known}", field="outputs", type="InputError"
            )


async def run_graph(request: Request) -> Response:
    state: AppState = request.app.state.trae
    served = state.graph(request.path_params["name"])
    body = parse_run_request(await read_json(request, state.config.max_body_bytes))
    ticket = state.admit(served)
    try:
        executor = ticket.executor
        _check_outputs(served, body.outputs)
        executor.validate_inputs(body.inputs)
    except Exception as exc:
        ticket.release()
        state.record(served, time.perf_counter(), None, exc)
        raise
    request_id = new_request_id(served.name)
    kwargs = dict(
        outputs=body.outputs, timeout=_timeout(served, body.timeout), request_id=request_id
    )
    headers = {"X-Request-ID": request_id}
    if body.stream:
        produce = _graph_events(state, served, executor, body.inputs, kwargs)
        return EventStream(produce, ticket.release, headers)
    start = time.perf_counter()
    clock = state.metrics.token_clock(served.nodes)
    try:
        result, _gone = await until_disconnect(
            request.receive, lambda: executor.run(body.inputs, on_event=clock, **kwargs)
        )
    except Exception as exc:
        state.record(served, start, None, exc)
        raise
    finally:
        ticket.release()
    state.record(served, start, result)
    if result is None:
        return Response(status_code=CLIENT_GONE)
    return ResultResponse(result_body(result), headers=headers)


def _graph_events(state: AppState, served: ServedGraph, executor, inputs, kwargs):
    """The SSE producer of one streamed run: node events and tokens, result, done."""

    async def produce(emit: Emit) -> None:
        start = time.perf_counter()
        clock = state.metrics.token_clock(served.nodes)
        send, receive = anyio.create_memory_object_stream[Event](math.inf)
        outcome: dict[str, Any] = {}

        def sink(event: Event) -> None:
            clock(event)
            if event.type != "result":  # ours, with nodes and timings, comes last
                send.send_nowait(event)

        async def run() -> None:
            with send:
                try:
                    outcome["result"] = await executor.run(inputs, on_event=sink, **kwargs)
                except Exception as exc:
                    outcome["error"] = exc

        try:
            async with anyio.create_task_group() as group, receive:
                group.start_soon(run)
                async for event in receive:
                    await emit(sse(event.type, event.data))
        except BaseException:
            state.record(served, start, None)  # the client left
            raise
        if "error" in outcome:
            error = outcome["error"]
            state.record(served, start, None, error)
            await emit(sse("error", {**error_body(error), "status": status_of(error)}))
        else:
            state.record(served, start, outcome["result"])
            await emit(sse("result", result_body(outcome["result"])))
        await emit(sse("done", {}))

    return produce


_RESULT_TYPES: dict[str, dict[str, dict]] = {
    "classify": {
        "label": {"type": "string"},
        "score": {"type": "number"},
        "scores": {"type": "object", "additionalProperties": {"type": "number"}},
    },
    "tag": {"spans": {"type": "array", "items": {"type": "object"}}},
    "embed": {"embedding": {"type": "array", "items": {"type": "number"}}},
    "generate": {
        "text": {"type": "string"},
        "tokens": {"type": "integer"},
        "finish_reason": {"type": "string"},
    },
    "python": {},
}


def input_schema(spec: GraphSpec, ref_template: str = "#/$defs/{model}") -> dict:
    return spec.input_model().model_json_schema(ref_template=ref_template)


def output_schema(spec: GraphSpec) -> dict:
    """JSON Schema of a result's outputs; every output may be null (a skipped node)."""
    inputs = input_schema(spec).get("properties", {})
    properties = {}
    for name, reference in spec.outputs.items():
        root, *rest = reference.split(".")
        if root == "inputs":
            schema = dict(inputs.get(rest[0], {})) if rest else {}
        elif not rest:
            schema = {"type": "object"} if spec.nodes[root].kind != "python" else {}
        elif len(rest) == 1:
            schema = dict(_RESULT_TYPES[spec.nodes[root].kind].get(rest[0], {}))
        else:
            schema = {}
        properties[name] = {"anyOf": [schema, {"type": "null"}]} if schema else {}
    return {"type": "object", "properties": properties, "required": list(spec.outputs)}


def describe(served: ServedGraph) -> dict:
    graph, spec = served.graph, served.spec
    nodes = []
    for name in graph.order:
        node = spec.nodes[name]
        entry = {
            "name": name,
            "kind": node.kind,
            "model": getattr(node, "model", None),
            "depth": graph.depth[name],
            "parents": list(graph.parents(name)),
        }
        if node.when:
            entry["when"] = node.when
        nodes.append(entry)
    edges = [
        {"from": a, "to": b, "via": data.get("via", "reference")}
        for a, b, data in graph.dag.edges(data=True)
    ]
    return {
        "name": spec.name,
        "description": spec.description,
        "timeout": spec.timeout,
        "inputs": input_schema(spec),
        "outputs": output_schema(spec),
        "nodes": nodes,
        "edges": edges,
        "models": {
            name: {"task": m.task, "versions": m.sources, "route": m.weights}
            for name, m in spec.models.items()
        },
        "max_inflight": served.limit,
        "inflight": served.inflight,
    }


def summary(served: ServedGraph) -> dict:
    spec = served.spec
    return {
        "name": spec.name,
        "description": spec.description,
        "inputs": {name: i.type for name, i in spec.inputs.items()},
        "outputs": list(spec.outputs),
        "nodes": len(spec.nodes),
        "models": sorted(spec.models),
        "streams_tokens": any(isinstance(n, GenerateNode) for n in spec.nodes.values()),
        "ready": served.executor is not None,
    }


async def list_graphs(request: Request) -> Response:
    state: AppState = request.app.state.trae
    return JSONResponse({"graphs": [summary(g) for g in state.graphs.values()]})


async def get_graph(request: Request) -> Response:
    state: AppState = request.app.state.trae
    return JSONResponse(describe(state.graph(request.path_params["name"])))
