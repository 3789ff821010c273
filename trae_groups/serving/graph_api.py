"""The graph routes: ``POST /v1/graphs/{name}`` (JSON, or SSE with ``stream: true``),
``GET /v1/graphs`` and ``GET /v1/graphs/{name}`` (input and output schemas, DAG).

A streamed run sends ``node_started``, ``node_finished``, ``node_skipped`` and
``token`` events as they happen, then ``result`` (the same body as a JSON answer) or
``error`` (the error body plus ``status``), then ``done``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trae_groups.graphs.errors import first_error
from trae_groups.graphs.executor import Prepared, RunResult
from trae_groups.graphs.nodes import result_schema
from trae_groups.graphs.spec import GraphSpec
from trae_groups.serving.app_state import AppState, ServedGraph
from trae_groups.serving.http_errors import bad_request, error_body, status_of
from trae_groups.serving.http_io import (
    Emit,
    ResultResponse,
    header_deadline,
    read_json,
    sse,
    until_disconnect,
)
from trae_groups.serving.run_scope import CLIENT_GONE, RunScope


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
        where, message = first_error(exc)
        raise bad_request(f"{where}: {message}" if where else message, where) from None


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
    if result.cut:  # a guard stopped a stream: {node, follows, piece}
        body["cut"] = result.cut
    return body


async def run_graph(request: Request) -> Response:
    state: AppState = request.app.state.trae
    served = state.graph(request.path_params["name"])
    body = parse_run_request(await read_json(request, state.config.max_body_bytes))
    deadline = header_deadline(request)
    async with RunScope(state, served) as run:
        prepared = run.prepare(
            body.inputs,
            outputs=body.outputs,
            timeout=body.timeout,
            session=request.headers.get("x-session-id"),
            deadline=deadline,
            traceparent=request.headers.get("traceparent"),
            tracestate=request.headers.get("tracestate"),
        )
        headers = {"X-Request-ID": prepared.request_id}
        if body.stream:
            return run.stream(_graph_events(run, prepared), headers)
        result, _gone = await until_disconnect(request.receive, lambda: run.executor.run(prepared))
        if result is None:
            return Response(status_code=CLIENT_GONE)  # the scope records the 499
        run.succeeded(result)
        return ResultResponse(result_body(result), headers=headers)


def _graph_events(run: RunScope, prepared: Prepared) -> Callable[[Emit], Awaitable[None]]:
    """The SSE producer of one streamed run: node events and tokens, result, done."""

    async def produce(emit: Emit) -> None:
        try:
            async for event in run.executor.stream(prepared):
                if event.type in ("result", "cut"):  # cut: a guard ended the run early
                    run.succeeded(event.result)
                    await emit(sse(event.type, result_body(event.result)))
                elif event.type == "error":
                    await _error_event(emit, run, event.error)
                else:
                    await emit(sse(event.type, event.data))
        except Exception as exc:
            await _error_event(emit, run, exc)
        await emit(sse("done", {}))

    return produce


async def _error_event(emit: Emit, run: RunScope, error: BaseException) -> None:
    run.failed(error)
    await emit(sse("error", {**error_body(error), "status": status_of(error)}))


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
        elif rest[0] == "json" and getattr(spec.nodes[root], "output_schema", None):
            schema = typed(spec.nodes[root].output_schema, rest[1:])
        elif len(rest) == 1:
            schema = dict((result_schema(spec.nodes[root]) or {}).get(rest[0], {}))
        else:
            schema = {}
        properties[name] = {"anyOf": [schema, {"type": "null"}]} if schema else {}
    return {"type": "object", "properties": properties, "required": list(spec.outputs)}


def typed(schema: dict, keys: list[str]) -> dict:
    """The schema of ``keys`` inside a generate node's output_schema ({} if it does not
    say: a load-time check already refused keys the schema does not have)."""
    for key in keys:
        schema = (schema.get("properties") or {}).get(key, {}) if isinstance(schema, dict) else {}
    return dict(schema) if isinstance(schema, dict) else {}


def _live_model(served: ServedGraph, name: str) -> dict:
    """A model as served now: versions uploaded or unloaded and a split set through the
    admin routes show here, not only what the file says."""
    spec = served.spec.models[name]
    live = served.executor.models.get(name) if served.executor is not None else None
    if live is None:  # still loading
        return {"task": spec.task, "versions": spec.sources, "route": spec.weights}
    versions = {v: live.sources.get(v, spec.sources.get(v, "")) for v in live.clients}
    return {"task": spec.task, "versions": versions, "route": dict(live.router.weights)}


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
        "on_deadline": spec.on_deadline,
        "inputs": input_schema(spec),
        "outputs": output_schema(spec),
        "nodes": nodes,
        "edges": edges,
        "models": {name: _live_model(served, name) for name in spec.models},
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
        "streams_tokens": any(n.kind == "generate" for n in spec.nodes.values()),
        "ready": served.executor is not None,
    }


async def list_graphs(request: Request) -> Response:
    state: AppState = request.app.state.trae
    return JSONResponse({"graphs": [summary(g) for g in state.graphs.values()]})


async def get_graph(request: Request) -> Response:
    state: AppState = request.app.state.trae
    return JSONResponse(describe(state.graph(request.path_params["name"])))
