"""/v1/responses through the official `openai` client on a real uvicorn: text and
message input, instructions, streamed events, function calls, text.format, and the
stateless refusals."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from conftest import build_llm
from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

GRAPH = """
name: shop
models:
  llm: {{source: {root}/llama, task: generate}}
inputs: {{history: messages}}
nodes:
  answer: {{model: llm, messages: "{{{{ inputs.history }}}}", params: {{max_tokens: 4}}}}
outputs: {{reply: answer.text}}
"""
SCHEMA = {
    "type": "object",
    "properties": {"status": {"enum": ["late", "lost"]}, "days": {"type": "integer",
                                                                  "maximum": 9}},
    "required": ["status", "days"],
    "additionalProperties": False,
}  # fmt: skip
TRACK = {"type": "function", "name": "track", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "integer", "maximum": 99}},
    "required": ["order_id"]}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("responses")
    build_llm(root / "llama", "llama", max_position_embeddings=1024)
    (root / "shop.yaml").write_text(GRAPH.format(root=root))
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    with ServerThread(create_app([root / "shop.yaml"], config)) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_text_input_is_the_chat_route_s_answer(client):
    answer = client.responses.create(model="shop/llm", input="where is my order?",
                                     max_output_tokens=6)  # fmt: skip
    chat = client.chat.completions.create(
        model="shop/llm", messages=[{"role": "user", "content": "where is my order?"}],
        max_tokens=6,
    )  # fmt: skip
    assert answer.object == "response" and answer.id.startswith("resp")
    assert answer.output_text == chat.choices[0].message.content
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == 6
    assert answer.output[0].type == "message" and answer.output[0].role == "assistant"


def test_instructions_and_messages_are_the_chat_s_system_and_turns(client):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": [{"type": "input_text", "text": "refund me"}]}]  # fmt: skip
    answer = client.responses.create(model="shop/llm", input=turns, instructions="be brief",
                                     max_output_tokens=5)  # fmt: skip
    messages = [{"role": "system", "content": "be brief"}, *turns[:2],
                {"role": "user", "content": "refund me"}]  # fmt: skip
    chat = client.chat.completions.create(model="shop/llm", messages=messages, max_tokens=5)
    assert answer.output_text == chat.choices[0].message.content


def test_streamed_events_spell_the_whole_answer(client):
    request = dict(model="shop/llm", input="where is my order?", max_output_tokens=6)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # max_output_tokens ended it
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text


def test_a_chat_graph_answers_too(client):
    answer = client.responses.create(model="shop", input="hello")
    assert answer.usage.output_tokens == 4 and answer.output_text


def test_function_calls_are_output_items(client):
    request = dict(model="shop/llm", input="track order 12", tools=[TRACK],
                   tool_choice={"type": "function", "name": "track"}, max_output_tokens=80)  # fmt: skip
    answer = client.responses.create(**request)
    (call,) = answer.output
    assert call.type == "function_call" and call.name == "track"
    assert set(json.loads(call.arguments)) == {"order_id"} and call.call_id.startswith("call_")
    events = list(client.responses.create(**request, stream=True))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == call.arguments
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.type == "function_call" and done[-1].item.arguments == call.arguments
    assert events[-1].type == "response.completed"
    # the call's result goes back as input
    follow = client.responses.create(model="shop/llm", max_output_tokens=3, input=[
        {"role": "user", "content": "track order 12"},
        {"type": "function_call", "call_id": call.call_id, "name": "track",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "late"},
    ])  # fmt: skip
    assert follow.output[0].type == "message"


def test_text_format_json_schema(client):
    answer = client.responses.create(
        model="shop/llm", input="where is my order?", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "order", "schema": SCHEMA}},
    )  # fmt: skip
    data = json.loads(answer.output_text)
    assert data["status"] in ("late", "lost") and 0 <= data["days"] <= 9


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp-1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
         "text.format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": []}, "input"),
        ({"temperature": 9}, "temperature"),
    ],
)  # fmt: skip
def test_what_it_cannot_do_is_422_naming_the_field(server, extra, param):
    body = {"model": "shop/llm", "input": "hi", **extra}
    answer = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == param
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
