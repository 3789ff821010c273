"""The OpenAPI 3.1 document at ``/openapi.json``, built per request from what is served
now: each graph's path carries its own input schema, output names and typed outputs
(each node kind's result schema, graphs/nodes.py), and ``model``
lists the ids the OpenAI routes take, so clients and property-based tests
(tests/test_http_schema.py) see the exact shapes.
"""

from __future__ import annotations

from trae_groups import __version__
from trae_groups.serving.app_state import AppState, ServedGraph
from trae_groups.serving.graph_api import RunRequest, input_schema, output_schema
from trae_groups.serving.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    targets,
)
from trae_groups.serving.openai_responses import ResponsesRequest
from trae_groups.serving.openai_tokenize import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string"},
                "node": {"type": "string"},
                "field": {"type": "string"},
            },
        }
    },
}
_RUN_RESULT = {
    "type": "object",
    "required": ["request_id", "outputs", "nodes", "ms"],
    "properties": {
        "request_id": {"type": "string"},
        "outputs": {"type": "object"},
        "nodes": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {"status": {"type": "string"}, "ms": {"type": ["number", "null"]}},
            },
        },
        "ms": {"type": "number"},
    },
}

_SPLIT = {
    "type": "object",
    "required": ["split"],
    "properties": {
        "split": {
            "anyOf": [
                {"type": "string", "examples": ["v1:90%,v2:10%"]},
                {"type": "object", "additionalProperties": {"type": "number"}},
            ]
        }
    },
}


def openapi_document(state: AppState) -> dict:
    """OpenAPI 3.1 for this server as it is now (graphs reload, models load)."""
    components: dict[str, dict] = {"Error": _ERROR, "RunResult": _RUN_RESULT}
    paths = _operations(sorted(state.graphs))
    run_body = RunRequest.model_json_schema(ref_template=REF)
    components["RunRequest"] = run_body
    paths["/v1/graphs/{name}"]["post"] = _run(run_body, "Run a graph")
    for name, served in state.graphs.items():
        schema, defs = _graph_body(served, run_body)
        components.update(defs)
        paths[f"/v1/graphs/{name}"] = {
            "get": _op(f"Describe graph {name}", {"200": _ok("graph")}),
            "post": _run(schema, f"Run graph {name}", output_schema(served.spec)),
        }
    paths.update(_openai_paths())
    components.update(_openai_components(state))
    return {
        "openapi": "3.1.0",
        "info": {"title": "trae-groups", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _operations(graph_names: list[str]) -> dict[str, dict]:
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    if graph_names:
        name["schema"]["enum"] = graph_names
    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/health": {"get": _op("Liveness", {"200": _ok("alive")})},
        "/ready": {"get": _op("Readiness: models loaded", {"200": _ok("ready"), **errors(503)})},
        "/metrics": {"get": _op("Prometheus metrics", {"200": _ok("metrics")})},
        "/v1/stats": {"get": _op("What the live graph page draws", {"200": _ok("stats")})},
        "/dashboard": {"get": _op("The live graph page (HTML)", {"200": _ok("the page")})},
        "/v1/graphs": {"get": _op("List graphs", {"200": _ok("graphs")})},
        "/v1/graphs/{name}": {
            "parameters": [name],
            "get": _op("Describe a graph", {"200": _ok("graph"), **errors(404)}),
        },
        "/admin/graphs/{name}/reload": {
            "post": {
                **_op(
                    "Reload a graph from its file (bearer token)",
                    {"200": _ok("reloaded"), **errors(401, 404, 409, 422, 503)},
                ),
                "parameters": [name],
                "security": [{"bearer": []}],
            }
        },
        "/admin/graphs/{name}/models/{model}/route": {
            "parameters": [name, model],
            "get": _admin("A model's split between its versions", errors(401, 404, 503)),
            "post": {
                **_admin("Set a model's split between its versions", errors(400, 401, 404, 422)),
                "requestBody": _required(json_content(_SPLIT)),
            },
        },
    }


def _admin(summary: str, failures: dict) -> dict:
    return {**_op(summary, {"200": _ok("the split"), **failures}), "security": [{"bearer": []}]}


def _graph_body(served: ServedGraph, run_body: dict) -> tuple[dict, dict]:
    """The run body with this graph's inputs and output names; and the $defs it needs."""
    inputs = input_schema(served.spec, REF)
    defs = inputs.pop("$defs", {})
    properties = dict(run_body["properties"])
    properties["inputs"] = inputs
    properties["outputs"] = {
        "anyOf": [
            {"type": "array", "items": {"enum": list(served.spec.outputs)}},
            {"type": "null"},
        ]
    }
    body = {**run_body, "properties": properties}
    if inputs.get("required"):
        body["required"] = ["inputs"]
    return body, defs


def _openai_components(state: AppState) -> dict[str, dict]:
    """The request bodies, ``model`` restricted to the ids that route somewhere now."""
    ids = targets(state.graphs)
    llms = sorted(i for i, t in ids.items() if t.kind == "llm")
    embedders = sorted(i for i, t in ids.items() if t.kind == "embed")
    chat = sorted(i for i, t in ids.items() if t.kind != "embed")
    components = {}
    pairs = (
        (ChatCompletionRequest, chat), (CompletionRequest, llms), (EmbeddingRequest, embedders),
        (ResponsesRequest, chat), (TokenizeRequest, llms), (DetokenizeRequest, llms),
    )  # fmt: skip
    for model, allowed in pairs:
        schema = model.model_json_schema(ref_template=REF)
        components.update(schema.pop("$defs", {}))
        if allowed:
            schema["properties"]["model"] = {**schema["properties"]["model"], "enum": allowed}
        components[model.__name__] = schema
    return components


def _openai_paths() -> dict[str, dict]:
    def post(summary: str, schema: str) -> dict:
        body = json_content({"$ref": f"#/components/schemas/{schema}"})
        responses = {
            "200": _ok("the completion, or Server-Sent Events when stream is true"),
            **errors(400, 404, 413, 422, 429, 500, 503),
        }
        return {"post": {**_op(summary, responses), "requestBody": _required(body)}}

    return {
        "/v1/models": {"get": _op("Models and chat graphs", {"200": _ok("the list")})},
        "/v1/models/{model}": {
            "get": {
                **_op("One model", {"200": _ok("the model"), **errors(404)}),
                "parameters": [_MODEL_PARAMETER],
            }
        },
        "/v1/responses": post("OpenAI responses", "ResponsesRequest"),
        "/tokenize": post("Token ids of a prompt or messages", "TokenizeRequest"),
        "/detokenize": post("The text of token ids", "DetokenizeRequest"),
        "/v1/chat/completions": post("OpenAI chat completions", "ChatCompletionRequest"),
        "/v1/completions": post("OpenAI completions", "CompletionRequest"),
        "/v1/embeddings": post("OpenAI embeddings", "EmbeddingRequest"),
    }


_MODEL_PARAMETER = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}


def _run(body_schema: dict, summary: str, outputs: dict | None = None) -> dict:
    """A run operation; ``outputs``: one graph's typed outputs (else any graph's)."""
    result: dict = {"$ref": "#/components/schemas/RunResult"}
    if outputs is not None:
        result = {**_RUN_RESULT, "properties": {**_RUN_RESULT["properties"], "outputs": outputs}}
    ok = {
        "description": "the result, or Server-Sent Events when stream is true",
        "content": {
            **json_content(result),
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    responses = {"200": ok, **errors(400, 404, 413, 422, 429, 500, 503, 504)}
    return {**_op(summary, responses), "requestBody": _required(json_content(body_schema))}


def errors(*codes: int) -> dict:
    content = json_content({"$ref": "#/components/schemas/Error"})
    return {str(code): {"description": "error", "content": content} for code in codes}


def json_content(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _required(content: dict) -> dict:
    return {"required": True, "content": content}


def _op(summary: str, responses: dict) -> dict:
    return {"summary": summary, "responses": responses}


def _ok(description: str) -> dict:
    return {"description": description}
