"""Structured outputs and embeddings on the OpenAI routes, through the official
`openai` client on a real uvicorn: response_format, guided_* extensions, forced tool
calls, /v1/embeddings."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest import build_encoder, build_llm, build_word_tokenizer
from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

GRAPH = """
name: shop
models:
  llm: {{source: {root}/llama, task: generate}}
  emb: {{source: {root}/emb, task: embed}}
inputs: {{text: str}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 3}}}}
  vec: {{model: emb, input: "{{{{ inputs.text }}}}"}}
outputs: {{said: say.text, vec: vec.embedding}}
"""
CHAT = """
name: chatty
models:
  talk: {{source: {root}/llama, task: generate}}
inputs: {{history: messages}}
nodes:
  answer: {{model: talk, messages: "{{{{ inputs.history }}}}", params: {{max_tokens: 5}}}}
outputs: {{reply: answer.text}}
"""
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "maximum": 99999},
        "status": {"enum": ["late", "lost"]},
    },
    "required": ["order_id", "status"],
    "additionalProperties": False,
}
# a model whose tokenizer llguidance cannot read itself, and one with no tokenizer at all
WORDS = """
name: words
models:
  llm: {{source: {root}/words, task: generate}}
  bare: {{source: {root}/bare, task: generate}}
inputs: {{text: str}}
nodes:
  a: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
  b: {{model: bare, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
outputs: {{a: a.text, b: b.text}}
"""
USER = [{"role": "user", "content": "where is order 1234?"}]
TOOLS = [
    {"type": "function", "function": {"name": "track", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "integer", "maximum": 999}},
        "required": ["order_id"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "refund", "parameters": {
        "type": "object", "properties": {"reason": {"type": "string", "maxLength": 12}},
        "required": ["reason"], "additionalProperties": False}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("structured")
    build_llm(root / "llama", "llama", max_position_embeddings=1024)
    build_encoder(root / "emb", "embed", [], seed=5)
    (root / "shop.yaml").write_text(GRAPH.format(root=root))
    (root / "chatty.yaml").write_text(CHAT.format(root=root))
    build_llm(root / "words", "llama", tokenizer=build_word_tokenizer)
    (root / "bare").mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (root / "bare" / name).write_bytes((root / "llama" / name).read_bytes())
    (root / "words.yaml").write_text(WORDS.format(root=root))
    return root


@pytest.fixture(scope="module")
def server(root):
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    graphs = [root / "shop.yaml", root / "chatty.yaml", root / "words.yaml"]
    with ServerThread(create_app(graphs, config)) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema_and_json_object(client):
    answer = client.chat.completions.create(
        model="shop/llm", messages=USER, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}},
    )  # fmt: skip
    data = json.loads(answer.choices[0].message.content)
    assert isinstance(data["order_id"], int) and data["status"] in ("late", "lost")
    anything = client.chat.completions.create(
        model="shop/llm", messages=USER, max_tokens=200, response_format={"type": "json_object"}
    )
    # an open object may run past max_tokens on a random model; what it wrote is an object
    text, finish = anything.choices[0].message.content, anything.choices[0].finish_reason
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict))


def test_guided_extensions_on_completions(client):
    regex = client.completions.create(
        model="shop/llm",
        prompt="code:",
        max_tokens=12,
        extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"},
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", regex.choices[0].text)
    choice = client.completions.create(
        model="shop/llm",
        prompt="mood:",
        max_tokens=8,
        extra_body={"guided_choice": ["calm", "angry"]},
    )
    assert choice.choices[0].text in ("calm", "angry")


def test_forced_tool_call_comes_back_as_tool_calls(client):
    named = client.chat.completions.create(
        model="shop/llm", messages=USER, max_tokens=200, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "track"}},
    )  # fmt: skip
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "track"
    assert isinstance(json.loads(call.function.arguments)["order_id"], int)
    stream = client.chat.completions.create(
        model="shop/llm", messages=USER, max_tokens=200, tools=TOOLS, tool_choice="required",
        stream=True,
    )  # fmt: skip
    chunks = list(stream)
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    # one delta names the call, the others carry pieces of its arguments
    assert pieces[0].id and pieces[0].function.name in ("track", "refund")
    assert all(p.index == 0 and not p.id for p in pieces[1:])
    json.loads("".join(p.function.arguments or "" for p in pieces))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"guided_regex": "(open", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "(open"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
         "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tools"),  # this template shows no tools
    ],
)  # fmt: skip
def test_bad_structured_requests_are_422_naming_the_field(server, extra, field):
    body = {"model": "shop/llm", "messages": USER, **extra}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] in (field, f"{field}.json_schema.schema"), answer.text


def test_structured_fields_do_not_apply_to_a_chat_graph(server):
    body = {"model": "chatty", "messages": USER, "response_format": {"type": "json_object"}}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "model"


def test_embeddings_match_transformers(client, root):
    from transformers import AutoModel, AutoTokenizer

    texts = ["hello world", "where is my order"]
    result = client.embeddings.create(model="shop/emb", input=texts)
    assert [d.index for d in result.data] == [0, 1]
    model, tok = (
        AutoModel.from_pretrained(root / "emb"),
        AutoTokenizer.from_pretrained(root / "emb"),
    )
    for text, item in zip(texts, result.data, strict=True):
        with torch.no_grad():
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        assert torch.allclose(torch.tensor(item.embedding), hidden.mean(0), atol=1e-5)
    one = client.embeddings.create(
        model="shop/emb", input="hello world", extra_body={"normalize": True}
    )
    assert abs(torch.tensor(one.data[0].embedding).norm().item() - 1.0) < 1e-5
    ids = {m.id: m.model_extra["trae"]["kind"] for m in client.models.list().data}
    assert ids["shop/emb"] == "embed"


def test_embeddings_refuse_an_llm_and_llm_routes_refuse_an_embedder(server):
    wrong = httpx.post(f"{server.url}/v1/embeddings", json={"model": "shop/llm", "input": "x"})
    assert wrong.status_code == 422 and wrong.json()["error"]["param"] == "model"
    body = {"model": "shop/emb", "prompt": "x"}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 422
    empty = httpx.post(f"{server.url}/v1/embeddings", json={"model": "shop/emb", "input": []})
    assert empty.status_code == 422 and empty.json()["error"]["param"] == "input"


def test_the_clients_parse_helper_and_streamed_json(client):
    from pydantic import BaseModel, Field

    class Order(BaseModel):
        order_id: int = Field(ge=0, le=9999)
        status: str = Field(pattern="^(late|lost)$")

    parsed = client.beta.chat.completions.parse(
        model="shop/llm", messages=USER, max_tokens=200, response_format=Order
    )
    order = parsed.choices[0].message.parsed
    assert isinstance(order, Order) and order.status in ("late", "lost")
    stream = client.chat.completions.create(
        model="shop/llm", messages=USER, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert set(json.loads(text)) == {"order_id", "status"}


def test_a_dropped_stream_is_counted_as_499(server):
    def dropped() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        key = 'trae_openai_requests_total{code="499",endpoint="completions",model="shop/llm"}'
        lines = [line for line in text.splitlines() if line.startswith(key)]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = dropped()
    body = {"model": "shop/llm", "prompt": "hello", "max_tokens": 500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the client leaves after the first chunk
    for _ in range(500):  # bounded: the server notices the disconnect
        if dropped() == before + 1:
            break
        time.sleep(0.02)
    assert dropped() == before + 1


def test_structured_output_on_a_tokenizer_llguidance_cannot_read(client):
    answer = client.chat.completions.create(
        model="words/llm", messages=USER, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}},
    )  # fmt: skip
    data = json.loads(answer.choices[0].message.content)
    assert isinstance(data["order_id"], int) and data["status"] in ("late", "lost")


def test_a_model_that_cannot_be_constrained_is_422_naming_response_format(server):
    body = {"model": "words/bare", "prompt": [5, 17, 42], "max_tokens": 4,
            "response_format": {"type": "json_object"}}  # fmt: skip
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == "response_format"
    del body["response_format"]
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
