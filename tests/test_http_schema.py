"""Property-based tests against the published OpenAPI schema: whatever a client sends,
the server answers with a 4xx and the error body, never a 5xx.

Schemathesis generates requests from /openapi.json (valid and invalid ones) for every
operation; hypothesis adds bodies the schema knows nothing of (any JSON, any bytes).
A 504 is the one 5xx a client may cause on purpose: it asked for a tiny ``timeout``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from conftest import build_encoder, build_llm
from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

SUPPORT = """
name: support
timeout: 30s
models:
  intent: {{source: {root}/intent, task: classify}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs:
  text: str
  tags: {{type: "list[str]", default: []}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "{{{{ intent.label }}}}: {{{{ inputs.text }}}} {{{{ inputs.tags | join(' ') }}}}"
    params: {{max_tokens: 4, temperature: 0.7, top_k: 20}}
outputs: {{intent: intent.label, reply: reply.text}}
"""
CHAT = """
name: chat
models:
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{history: messages}}
nodes:
  answer: {{model: dialog, messages: "{{{{ inputs.history }}}}", params: {{max_tokens: 4}}}}
outputs: {{reply: answer.text}}
"""
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("schema")
    build_llm(root / "dialog", "llama", max_position_embeddings=64)  # short generations
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    (root / "support.yaml").write_text(SUPPORT.format(root=root))
    (root / "chat.yaml").write_text(CHAT.format(root=root))
    config = ServerConfig(
        engine=EngineConfig(pool_bytes=8 << 20), max_body_bytes=1 << 16, admin_token="t"
    )
    app = create_app([root / "support.yaml", root / "chat.yaml"], config)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def check_answer(response, body: object) -> None:
    status = response.status_code
    asked_timeout = isinstance(body, dict) and "timeout" in body
    # a timeout in the body may run out (504), or be too short to start at all (503)
    late = status == 504 or (status == 503 and "DeadlineUnreachable" in response.text)
    assert status < 500 or (late and asked_timeout), (status, response.text[:500])
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["type"], str) and isinstance(error["message"], str)


# schemathesis' pytest plugin does not run under pytest 9 yet: its strategies do
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_makes_a_server_error(server, api_schema, mode):
    strategy = api_schema.as_strategy(mode)

    @settings(SETTINGS, max_examples=60)
    @given(case=strategy)
    def check(case) -> None:
        response = case.call(base_url=server.url, timeout=120)
        check_answer(response, case.body if isinstance(case.body, dict) else None)

    check()


def test_the_document_describes_every_route_and_graph(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    for path in ("/v1/graphs/{name}", "/v1/graphs/support", "/v1/chat/completions",
                 "/v1/completions", "/v1/models", "/health", "/ready", "/metrics",
                 "/admin/graphs/{name}/reload"):  # fmt: skip
        assert path in paths
    body = paths["/v1/graphs/support"]["post"]["requestBody"]["content"]["application/json"]
    inputs = body["schema"]["properties"]["inputs"]
    assert inputs["required"] == ["text"]
    assert inputs["additionalProperties"] is False


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
ENVELOPES = st.fixed_dictionaries(
    {},
    optional={
        "inputs": JSON | st.fixed_dictionaries({}, optional={"text": JSON, "tags": JSON}),
        "outputs": JSON,
        "stream": JSON,
        "timeout": JSON,
    },
)
CHAT_BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(["chat", "support/dialog", "dialog", "nope"]) | st.text()},
    optional={
        "messages": JSON
        | st.lists(st.fixed_dictionaries({"role": JSON, "content": JSON}), max_size=3),
        "prompt": JSON,
        "max_tokens": JSON,
        "temperature": JSON,
        "top_p": JSON,
        "top_k": JSON,
        "seed": JSON,
        "stop": JSON,
        "stream": st.booleans(),
        "n": JSON,
    },
)
ROUTES = ["/v1/graphs/support", "/v1/graphs/chat", "/v1/chat/completions", "/v1/completions"]


@SETTINGS
@given(route=st.sampled_from(ROUTES), body=JSON | ENVELOPES | CHAT_BODIES)
def test_any_json_body_is_answered_without_a_server_error(server, route, body):
    response = httpx.post(f"{server.url}{route}", content=json.dumps(body), timeout=120)
    check_answer(response, body)


@SETTINGS
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=256))
def test_any_bytes_are_answered_without_a_server_error(server, route, raw):
    response = httpx.post(f"{server.url}{route}", content=raw, timeout=120)
    check_answer(response, None)


def test_lone_surrogates_are_a_bad_request(server):
    body = b'{"inputs": {"text": "\\ud800"}}'
    response = httpx.post(f"{server.url}/v1/graphs/support", content=body)
    assert response.status_code == 400


@pytest.mark.parametrize(
    "body",
    [b'{"inputs": {"text": "\xed\xa0\x80"}}', b'{"inputs": {"text": "caf\xe9"}}'],
    ids=["encoded-surrogate", "latin-1"],
)
def test_a_body_that_is_not_utf8_is_a_bad_request(server, body):
    response = httpx.post(f"{server.url}/v1/graphs/support", content=body)
    assert response.status_code == 400
    assert "UTF-8" in response.json()["error"]["message"]


def test_a_utf8_body_with_escapes_and_a_bom_is_read(server):
    body = '\ufeff{"inputs": {"text": "caf\\u00e9 \\ud83d\\ude00 ok"}}'.encode()
    response = httpx.post(f"{server.url}/v1/graphs/support", content=body)
    assert response.status_code == 200, response.text
