"""Requests the server must refuse with a 422 naming the field, and keep serving:
a real uvicorn on 127.0.0.1 with a real tiny LLM (and LoRA adapters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from conftest import build_llm, build_lora
from trae_groups.engine import EngineConfig
from trae_groups.engine.chat import chat_token_ids
from trae_groups.engine.errors import RequestError
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

TOKEN = "request-checks-token"
CHAT = """
name: chat
models:
  dialog: {{source: {root}/llama, task: generate, max_lora_rank: 8}}
inputs:
  messages: messages
nodes:
  reply:
    model: dialog
    messages: "{{{{ inputs.messages }}}}"
    params: {{max_tokens: 3, temperature: 0}}
outputs: {{reply: reply.text}}
"""
TYPED = """
name: typed
models:
  writer: {{source: {root}/llama, task: generate}}  # the same folder: the same engine model
inputs: {{text: str}}
nodes:
  out:
    model: writer
    prompt: "{{{{ inputs.text }}}}"
    output_schema: {{type: string, pattern: "^((a{{100}}){{100}}){{4}}$"}}
    params: {{max_tokens: 3}}
outputs: {{out: out.text}}
"""
HELLO = [{"role": "user", "content": "hello"}]
LIMIT = 2 << 20  # max_constraint_bytes: a compiled constraint over it is refused
BIG = "^((a{100}){100}){4}$"  # 20 characters that compile to ~20 MiB of lexer states


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("checks")
    build_llm(root / "llama")
    build_lora(root / "lora", root / "llama", r=4, lora_alpha=8, target_modules=["q_proj"])
    (root / "chat.yaml").write_text(CHAT.format(root=root))
    (root / "typed.yaml").write_text(TYPED.format(root=root))
    engine = EngineConfig(pool_bytes=8 << 20, max_constraint_bytes=LIMIT)
    config = ServerConfig(admin_token=TOKEN, engine=engine)
    with ServerThread(create_app([root / "chat.yaml", root / "typed.yaml"], config)) as running:
        running.root = root
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_empty_messages_on_the_graph_route_are_a_422_naming_the_field(client):
    response = client.post("/v1/graphs/chat", json={"inputs": {"messages": []}})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["node"], error["field"]) == ("reply", "messages")
    assert "no messages" in error["message"]
    ok = client.post("/v1/graphs/chat", json={"inputs": {"messages": HELLO}})
    assert ok.status_code == 200, ok.text


def test_the_engine_refuses_empty_messages_by_name(server):
    tokenizer = AutoTokenizer.from_pretrained(server.root / "llama")
    with pytest.raises(RequestError) as caught:
        chat_token_ids(tokenizer, [])
    assert caught.value.field == "messages"


def _metric(text: str, name: str) -> float:
    """``name`` for the chat graph's model (the engine's name for it: ``dialog``)."""
    (line,) = [x for x in text.splitlines() if x.startswith(name + '{model="dialog",')]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize(
    ("field", "body"),
    [
        ("guided_regex", {"guided_regex": BIG}),
        (
            "response_format",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "string", "pattern": BIG}},
                }
            },
        ),
    ],
)
def test_a_constraint_over_the_byte_limit_is_a_422_naming_its_field(client, field, body):
    before = client.get("/metrics").text
    refused = 0.0 if 'trae_llm_constraint_refusals_total{model="dialog",' not in before else (
        _metric(before, "trae_llm_constraint_refusals_total")
    )  # fmt: skip
    request = {"model": "chat/dialog", "messages": HELLO, "max_tokens": 2, **body}
    response = client.post("/v1/chat/completions", json=request)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    assert "MiB" in error["message"] and "max_constraint_bytes" in error["message"]
    metrics = client.get("/metrics").text
    assert _metric(metrics, "trae_llm_constraint_refusals_total") == refused + 1
    assert _metric(metrics, "trae_llm_constraint_cache_bytes") <= 256 << 20
    # the server keeps serving constraints that fit
    fits = {"model": "chat/dialog", "messages": HELLO, "max_tokens": 4, "guided_regex": "[ab]{2}"}
    ok = client.post("/v1/chat/completions", json=fits)
    assert ok.status_code == 200, ok.text
    assert _metric(client.get("/metrics").text, "trae_llm_constraint_cache_entries") >= 1


VERSIONS = "/admin/graphs/chat/models/dialog/versions"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_an_uploaded_adapter_version_is_listed_and_addressable_by_its_id(server, client):
    upload = client.post(
        VERSIONS, headers=AUTH, json={"version": "v2", "adapter": str(server.root / "lora")}
    )
    assert upload.status_code == 200, upload.text
    try:
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert {"chat/dialog:v2", "dialog:v2"} <= set(listed)
        assert listed["chat/dialog:v2"]["parent"] == "chat/dialog"
        assert listed["chat/dialog:v2"]["trae"]["kind"] == "adapter"
        for model in ("chat/dialog:v2", "dialog:v2"):
            body = {"model": model, "messages": HELLO, "max_tokens": 2}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
    finally:
        gone = client.delete(f"{VERSIONS}/v2", headers=AUTH)
    assert gone.status_code == 200, gone.text
    assert "chat/dialog:v2" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
    body = {"model": "chat/dialog:v2", "messages": HELLO, "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 404


def _broken(root: Path, name: str, **changes) -> Path:
    folder = root / name
    if not folder.exists():
        shutil.copytree(root / "lora", folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("nan", {"lora_alpha": float("nan")}, "lora_alpha"),
        ("huge", {"r": 1_000_000_000}, "r"),
        ("nope", {"target_modules": ["q_proj", "nope_proj"]}, "target_modules"),
    ],
)
def test_an_adapter_whose_config_disagrees_is_a_422_naming_the_field(
    server, client, name, changes, field
):
    folder = _broken(server.root, name, **changes)
    upload = client.post(VERSIONS, headers=AUTH, json={"version": "v9", "adapter": str(folder)})
    assert upload.status_code == 422, upload.text
    error = upload.json()["error"]
    assert error["field"] == field and "adapter_config.json" in error["message"]
    served = client.get("/v1/graphs/chat").json()["models"]["dialog"]["versions"]
    assert "v9" not in served
    ok = client.post("/v1/graphs/chat", json={"inputs": {"messages": HELLO}})
    assert ok.status_code == 200, ok.text


def test_an_output_schema_over_the_byte_limit_is_a_422_naming_node_and_field(client):
    response = client.post("/v1/graphs/typed", json={"inputs": {"text": "hello"}})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["node"], error["field"]) == ("out", "constraint")
    assert "max_constraint_bytes" in error["message"]
