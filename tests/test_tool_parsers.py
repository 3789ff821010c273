"""trae_groups/serving/tool_parsers.py and the tool parts of openai_structured.py: each
family's call syntax read whole and streamed, the strict schemas, the ``auto`` grammar
(through llguidance with a real tokenizer), and which format a chat template means."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import build_tokenizer
from trae_groups.engine.chat import TOOL_CALL_FORMATS, tool_call_format
from trae_groups.engine.constraints import Grammars
from trae_groups.serving.openai_structured import Tool, auto_constraint, reading, strict
from trae_groups.serving.tool_parsers import SCANNERS, ToolStream, tool_calls

NAMES = {"track", "refund"}
CALL = '{"name": "track", "arguments": {"order_id": 12, "tags": {"a": [1, 2]}}}'
ARGS = '{"order_id": 12, "tags": {"a": [1, 2]}}'

# (format, reply, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f"<tool_call>\n{CALL}\n</tool_call>", None, [("track", ARGS)]),
    ("hermes", f"Let me look.<tool_call>{CALL}</tool_call>", "Let me look.", [("track", ARGS)]),
    (
        "hermes",
        f"<tool_call>{CALL}</tool_call>\n<tool_call>"
        '{"name": "refund", "arguments": {}}</tool_call>',
        None,
        [("track", ARGS), ("refund", "{}")],
    ),
    ("hermes", "no call, only a < sign and <tool", "no call, only a < sign and <tool", []),
    (
        "hermes",
        '<tool_call>{"name": "delete", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "delete", "arguments": {}}</tool_call>',
        [],
    ),  # not one of the tools
    (
        "llama3",
        '<|python_tag|>{"name": "track", "parameters": {"order_id": 12}}',
        None,
        [("track", '{"order_id": 12}')],
    ),
    (
        "llama3",
        f'{CALL}; {{"name": "refund", "parameters": {{"reason": "late"}}}}',
        None,
        [("track", ARGS), ("refund", '{"reason": "late"}')],
    ),
    ("llama3", 'I think {"name": "track"} is right', 'I think {"name": "track"} is right', []),
    (
        "mistral",
        f'[TOOL_CALLS][{CALL}, {{"name": "refund", "arguments": {{}}}}]',
        None,
        [("track", ARGS), ("refund", "{}")],
    ),
    ("mistral", f"[{CALL}]", None, [("track", ARGS)]),  # the marker was a dropped special token
    ("mistral", f"Sure. [TOOL_CALLS][{CALL}]", "Sure.", [("track", ARGS)]),
    ("mistral", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("json", CALL, None, [("track", ARGS)]),
    (
        "json",
        '{"name": "track", "arguments": {"order_id": 1',
        None,
        [("track", '{"order_id": 1')],
    ),  # cut by max_tokens: the arguments so far
    ("json", '{"answer": 42}', '{"answer": 42}', []),
    ("json", "plain words", "plain words", []),
]


def _streamed(fmt: str, reply: str, step: int) -> tuple[str, list[tuple[str, str]], list]:
    """The reply fed ``step`` characters at a time: content, calls, and the deltas."""
    stream = ToolStream(fmt, NAMES)
    deltas = []
    for at in range(0, len(reply), step):
        deltas += stream.feed(reply[at : at + step])
    deltas += stream.feed("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                calls[piece["index"]] = [piece["function"]["name"], ""]
            calls[piece["index"]][1] += piece["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()], deltas


@pytest.mark.parametrize("fmt, reply, content, calls", CASES)
def test_a_whole_reply(fmt, reply, content, calls):
    got_content, got_calls = tool_calls(fmt, reply, NAMES)
    assert got_content == (content if calls else reply)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("fmt, reply, content, calls", CASES)
def test_a_streamed_reply_gives_what_the_whole_one_does(fmt, reply, content, calls, step):
    got_content, got_calls, deltas = _streamed(fmt, reply, step)
    assert got_calls == calls
    assert got_content == (content or "" if calls else reply)
    ids = [p["id"] for d in deltas for p in d.get("tool_calls", []) if "id" in p]
    assert len(ids) == len(set(ids)) == len(calls)


def test_content_streams_before_the_call_is_known():
    stream = ToolStream("hermes", NAMES)
    assert stream.feed("Checking") == [{"content": "Checking"}]
    assert stream.feed(" now <tool") == [{"content": " now"}]  # "<tool" may open a call
    assert stream.feed("_call>{") == []
    first = stream.feed('"name": "track", "arguments": {"order')
    assert first[0]["tool_calls"][0]["function"] == {"name": "track", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"]["arguments"] == '{"order'


def test_every_format_has_a_scanner():
    assert tuple(SCANNERS) == TOOL_CALL_FORMATS


@pytest.mark.parametrize(
    "template, added, fmt",
    [
        ("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}", [], "hermes"),
        ("{{ '[TOOL_CALLS]' }}", [], "mistral"),
        ("<|python_tag|>", [], "llama3"),
        ('{"name": function name, "parameters": ...} ipython', [], "llama3"),
        ("{{ messages }}", ["<tool_call>"], "hermes"),  # known from the added tokens
        ("{{ messages }}", [], "json"),
        (None, [], "json"),
    ],
)
def test_the_format_a_tokenizer_shows(template, added, fmt):
    tokenizer = SimpleNamespace(chat_template=template, added_tokens_decoder=dict(enumerate(added)))
    assert tool_call_format(tokenizer) == fmt


def test_schemas_are_strict_unless_they_say_otherwise():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {"const": {"z": 1}}}}},
        },
    }
    closed = strict(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["properties"]["list"]["items"]["properties"]["y"] == {"const": {"z": 1}}


TOOLS = [
    Tool.model_validate(t)
    for t in (
        {"type": "function", "function": {"name": "track", "parameters": {
            "type": "object", "properties": {"order_id": {"type": "integer"}},
            "required": ["order_id"]}}},
        {"type": "function", "function": {"name": "refund"}},
    )
]  # fmt: skip


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> tuple:
    tokenizer = build_tokenizer(Path(tmp_path_factory.mktemp("tok")))
    return tokenizer, Grammars(tokenizer, 512, {tokenizer.eos_token_id})


def _accepts(grammars, constraint, text: str) -> bool:
    tokenizer, compiled = grammars
    ids = tokenizer.encode(text, add_special_tokens=False)
    return compiled.matcher(constraint).validate_tokens(ids) == len(ids)


# (format, text the grammar takes, text it refuses)
AUTO = [
    ("hermes", '<tool_call>\n{"name": "track", "arguments": {"order_id": 7}}\n</tool_call>',
     '<tool_call>\n{"name": "track", "arguments": {"order_id": 7, "more": 1}}'),
    ("hermes", "I would rather answer in words.", "<tool_call>\nnot json"),
    ("llama3", '{"name": "refund", "parameters": {}}', '{"name": "refund", "arguments": {}}'),
    ("json", '{"name": "track", "arguments": {"order_id": 7}}', '{"name": "nope"'),
    ("mistral", '[{"name": "refund", "arguments": {}}]', '[{"name": "track", "arguments": {}}]'),
]  # fmt: skip


@pytest.mark.parametrize("fmt, good, bad", AUTO)
def test_auto_is_text_or_a_call_with_valid_arguments(grammars, fmt, good, bad):
    constraint = auto_constraint(fmt, TOOLS)
    assert _accepts(grammars, constraint, good)
    assert not _accepts(grammars, constraint, bad)
    assert _accepts(grammars, constraint, "Plain text is fine too.")


def test_a_forced_call_cut_short_keeps_its_partial_arguments():
    forced = reading("json", TOOLS[:1], forced=True)
    message, finish = forced.message('{"name": "tra', "length")
    assert finish == "length" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "track", "arguments": ""}
    message, finish = forced.message('{"name": "track", "arguments": {"order_id": 4', "length")
    assert json.loads(message["tool_calls"][0]["function"]["arguments"] + "}") == {"order_id": 4}
    stream = forced.streaming()
    deltas = stream.feed('{"name": "tr')
    last, finish = stream.end("length")
    assert finish == "length" and not deltas
    assert last[-1]["tool_calls"][0]["function"]["name"] == "track"
