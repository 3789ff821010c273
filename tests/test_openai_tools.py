"""Tool calls on /v1/chat/completions over real HTTP, with the official `openai` client:
each family's syntax read back as `tool_calls` (the format from the chat template, the
graph's `tool_call_parser`, or the server's), streamed as tool-call deltas; `auto`
constrained to text or a valid call; a forced call cut by max_tokens; strict schemas."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from conftest import build_llm
from trae_groups.engine import EngineConfig
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

# a chat template in Hermes' manner: it shows the tools and how to call them
HERMES = (
    "{% if tools %}<|system|>You may call {{ tools | tojson }}, as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# shows the tools, and no syntax of a known family
PLAIN = HERMES.replace('as <tool_call>{"name": ..., "arguments": ...}</tool_call>', "in JSON")
GRAPH = """
name: tools
models:
  hermes: {{source: {root}/hermes, task: generate}}
  llama3: {{source: {root}/plain, task: generate, tool_call_parser: llama3}}
  plain: {{source: {root}/plain, task: generate, tool_call_parser: mistral}}
  json: {{source: {root}/plain, task: generate}}
inputs: {{text: str}}
nodes:
  a: {{model: hermes, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
  b: {{model: llama3, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
  c: {{model: plain, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
  d: {{model: json, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
outputs: {{a: a.text, b: b.text, c: c.text, d: d.text}}
"""
USER = [{"role": "user", "content": "where is order 1234?"}]
TOOLS = [
    {"type": "function", "function": {"name": "track", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "integer", "maximum": 99}},
        "required": ["order_id"]}}},  # no additionalProperties: strict all the same
    {"type": "function", "function": {"name": "refund", "parameters": {
        "type": "object", "properties": {"reason": {"enum": ["late", "lost"]}},
        "required": ["reason"]}}},
]  # fmt: skip


def _with_template(folder: Path, template: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("tools")
    for name, template in (("hermes", HERMES), ("plain", PLAIN)):
        build_llm(root / name, "llama", max_position_embeddings=1024)
        _with_template(root / name, template)
    (root / "tools.yaml").write_text(GRAPH.format(root=root))
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    with ServerThread(create_app([root / "tools.yaml"], config)) as running:
        running.root = root
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _regex(text: str) -> str:
    """A regex for exactly this text with `#` standing for one digit."""
    special = set("\\.^$*+?{}[]()|")
    return "".join("[1-9]" if c == "#" else ("\\" + c if c in special else c) for c in text)


def _streamed(client, **request) -> tuple[str, list[tuple[str, str, str]], str]:
    """Content, calls (id, name, arguments joined from their pieces) and finish reason
    of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id:
                calls[piece.index] = [piece.id, piece.function.name, ""]
            calls[piece.index][2] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


# (model, the reply its syntax writes, content before the call, name)
FAMILIES = [
    ("tools/hermes",
     'Checking.<tool_call>\n{"name": "track", "arguments": {"order_id": #}}\n</tool_call>',
     "Checking.", "track"),
    ("tools/llama3", '{"name": "refund", "parameters": {"reason": "late"}}', None, "refund"),
    ("tools/plain", '[TOOL_CALLS][{"name": "track", "arguments": {"order_id": #}}]', None,
     "track"),
    ("tools/json", '{"name": "refund", "arguments": {"reason": "lost"}}', None, "refund"),
]  # fmt: skip


@pytest.mark.parametrize("model, reply, content, name", FAMILIES)
def test_each_family_s_calls_come_back_as_tool_calls(client, model, reply, content, name):
    # the reply is made to be the family's syntax, so that a random model writes a call
    request = dict(model=model, messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=120,
                   extra_body={"guided_regex": _regex(reply)})  # fmt: skip
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    assert whole.message.content == content
    (call,) = whole.message.tool_calls
    assert call.function.name == name and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == set(TOOLS[0 if name == "track" else 1]["function"]["parameters"]
                                 ["properties"])  # fmt: skip
    text, calls, finish = _streamed(client, **request)
    assert finish == "tool_calls" and text == (content or "")
    assert [(n, a) for _, n, a in calls] == [(name, call.function.arguments)]  # greedy: the same


def test_the_server_s_format_applies_where_the_graph_names_none(server):
    # --tool-call-parser: the "json" model's template shows no family's syntax
    graph = server.root / "tools.yaml"
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20), tool_call_parser="llama3")
    with ServerThread(create_app([graph], config)) as other:
        client = openai.OpenAI(base_url=f"{other.url}/v1", api_key="unused", max_retries=0)
        reply = '{"name": "refund", "parameters": {"reason": "late"}}'
        for model, parsed in (("tools/json", True), ("tools/plain", False)):  # plain: mistral
            choice = client.chat.completions.create(
                model=model, messages=USER, tools=TOOLS, max_tokens=80,
                extra_body={"guided_regex": _regex(reply)},
            ).choices[0]  # fmt: skip
            assert bool(choice.message.tool_calls) == parsed, (model, choice.message)


def test_auto_is_text_or_a_valid_call(client):
    for seed in range(3):
        choice = client.chat.completions.create(
            model="tools/hermes", messages=USER, tools=TOOLS, max_tokens=60, temperature=1.0,
            seed=seed,
        ).choices[0]  # fmt: skip
        if choice.message.tool_calls:
            call = choice.message.tool_calls[0]
            assert call.function.name in ("track", "refund")
            if choice.finish_reason == "tool_calls":
                json.loads(call.function.arguments)
        else:  # text never opens a call it does not finish
            assert not (choice.message.content or "").lstrip().startswith("<tool_call>")


def test_a_forced_call_cut_by_max_tokens_is_still_a_call(client):
    request = dict(model="tools/hermes", messages=USER, tools=TOOLS, max_tokens=6,
                   tool_choice={"type": "function", "function": {"name": "track"}})  # fmt: skip
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "track"
    assert call.function.arguments == "" or call.function.arguments.startswith("{")
    text, calls, finish = _streamed(client, **request)
    assert finish == "length" and text == ""
    assert [(n, a) for _, n, a in calls] == [("track", call.function.arguments)]


def test_forced_calls_take_no_keys_the_schema_does_not_have(client):
    for name in ("track", "refund"):
        choice = client.chat.completions.create(
            model="tools/plain", messages=USER, tools=TOOLS, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": name}},
        ).choices[0]  # fmt: skip
        assert choice.finish_reason == "tool_calls"
        arguments = json.loads(choice.message.tool_calls[0].function.arguments)
        schema = next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]
        assert set(arguments) == set(schema["properties"])


def test_the_graph_field_is_checked_at_load_with_its_line(tmp_path):
    text = GRAPH.format(root=tmp_path).replace("tool_call_parser: llama3", "tool_call_parser: xml")
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(text, "tools.yaml")
    (issue,) = err.value.issues
    assert issue.line == 5 and "tool_call_parser" in issue.message and "llama3" in issue.message
    encoder = GRAPH.format(root=tmp_path).replace(
        "plain, task: generate, tool_call_parser: llama3",
        "plain, task: embed, tool_call_parser: json",
    )
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(encoder, "tools.yaml")
    assert any("tool_call_parser is for generate models" in i.message for i in err.value.issues)
