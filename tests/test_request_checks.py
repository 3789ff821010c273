"""Requests the server must refuse with a 422 naming the field, and keep serving:
a real uvicorn on 127.0.0.1 with a real tiny LLM (and LoRA adapters)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from conftest import build_llm
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
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("checks")
    build_llm(root / "llama")
    (root / "chat.yaml").write_text(CHAT.format(root=root))
    config = ServerConfig(admin_token=TOKEN, engine=EngineConfig(pool_bytes=8 << 20))
    with ServerThread(create_app([root / "chat.yaml"], config)) as running:
        running.root = root
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_empty_messages_on_the_graph_route_are_a_422_naming_the_field(client):
    response = client.post("/v1/graphs/chat", json={"inputs": {"messages": []}})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "inputs.messages"
    ok = client.post("/v1/graphs/chat", json={"inputs": {"messages": HELLO}})
    assert ok.status_code == 200, ok.text


def test_the_engine_refuses_empty_messages_by_name(server):
    tokenizer = AutoTokenizer.from_pretrained(server.root / "llama")
    with pytest.raises(RequestError) as caught:
        chat_token_ids(tokenizer, [])
    assert caught.value.field == "messages"
