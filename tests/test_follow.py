"""Streamed edges: nodes that follow a generate node's text while it is generated,
guards that cut it, and generate nodes whose prompt is prefilled as the text arrives.
All on tiny real models and real python functions."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from conftest import build_encoder, build_llm, node_module
from trae_groups.engine import EngineConfig, SamplingParams
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.nodes import Follows
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.graphs.streams import Subscription

FUNCTIONS = """
import asyncio

def check(piece: str, index: int) -> dict:
    return {"index": index, "chars": len(piece)}

async def slow(piece: str) -> dict:
    await asyncio.sleep(0.03)
    return {"piece": piece}

async def shout(pieces, suffix: str = "!"):
    async for piece in pieces:
        yield piece.upper() + suffix
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("follow")
    with node_module(root, "follow_nodes", FUNCTIONS):
        yield {
            "dialog": build_llm(root / "dialog", "llama", max_position_embeddings=512),
            "guard": build_encoder(root / "guard", "classify", ["safe", "unsafe"], seed=5),
        }


def graph(dirs, nodes: str, outputs: str = "{reply: reply.text}", max_tokens: int = 40) -> str:
    return f"""
name: followed
models:
  dialog: {{source: {dirs["dialog"]}, task: generate}}
  guard: {{source: {dirs["guard"]}, task: classify, max_queue_delay_ms: 5}}
inputs: {{text: str}}
nodes:
  reply:
    model: dialog
    prompt: "User: {{{{ inputs.text }}}} Assistant:"
    params: {{max_tokens: {max_tokens}}}
{nodes}
outputs: {outputs}
"""


def start(text: str, **cfg):
    spec = load_graph_text(text, "followed.yaml")
    cfg.setdefault("pool_bytes", 16 << 20)
    cfg.setdefault("fast_linear", False)
    rt = ModelRuntime.for_specs([spec], EngineConfig(**cfg))
    executor = rt.bind(spec)
    rt.start()
    return rt, executor


def pages_back(rt) -> None:
    """The pool's pages all come back (an abort lands at the engine's next step)."""
    for _ in range(500):
        if rt.engine.pool.stats().used_pages == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"pages still in use: {rt.engine.pool.stats()}")


async def events_of(executor, inputs):
    return [event async for event in executor.stream(inputs)]


def solo(rt, prompt: str, max_tokens: int):
    return rt.engine.generate([prompt], SamplingParams(max_tokens=max_tokens), model="dialog")[0]


# ---------------------------------------------------------------- pieces


def pieces_of(follows: dict, chunks: list[tuple[str, int]]) -> list[str]:
    sub = Subscription(Follows.model_validate(follows))
    text, tokens = "", 0
    for i, (chunk, n) in enumerate(chunks):
        text, tokens = text + chunk, tokens + n
        sub.offer(text, tokens, last=i == len(chunks) - 1)
    return [text[p.start : p.end] for p in sub.waiting]


@pytest.mark.parametrize(
    ("follows", "chunks", "expected"),
    [
        ({"node": "r"}, [("Hi there. How", 3), (" are you? Fine", 3), (".", 1)],
         ["Hi there. ", "How are you? ", "Fine."]),
        ({"node": "r", "every": "line"}, [("a\nb", 2), ("c\n\nd", 3)], ["a\n", "bc\n\n", "d"]),
        ({"node": "r", "chars": 4}, [("abcdefghij", 5)], ["abcd", "efgh", "ij"]),
        ({"node": "r", "tokens": 2}, [("ab", 1), ("cd", 1), ("ef", 1), ("g", 1), ("h", 1)],
         ["abcd", "efg", "h"]),
        ({"node": "r"}, [("3.14 is pi.", 4)], ["3.14 is pi."]),  # no space after: one piece
        # a full buffer merges new pieces into the last waiting one: nothing is dropped
        ({"node": "r", "chars": 2, "buffer": 2}, [("abcdefgh", 8)], ["ab", "cdefgh"]),
    ],
)  # fmt: skip
def test_pieces_end_at_the_granularity_and_the_rest_is_the_last(follows, chunks, expected):
    assert pieces_of(follows, chunks) == expected


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ("  g: {model: guard, input: '{{ reply.piece }}', follows: nope}", "unknown node 'nope'"),
        ("  a: {model: guard, input: '{{ inputs.text }}'}\n"
         "  g: {model: guard, input: '{{ a.label }}', follows: a}",
         "only a generate node streams; 'a' is a classify node"),
        ("  g: {model: guard, input: '{{ reply.piece }}', follows: {node: reply, tokens: 99}}",
         "never ends before 'reply' does (its max_tokens is 40)"),
        ("  g: {model: guard, input: '{{ reply.piece }}', follows: {node: reply, tokens: 2, "
         "chars: 3}}", "give one of every, tokens or chars, not tokens and chars"),
        ("  g: {model: guard, input: '{{ reply.piece }}', follows: {node: reply, every: word}}",
         "every"),
        ("  g: {model: guard, input: '{{ inputs.text }}', cut_when: 'g.label == 1'}",
         "'cut_when' is for a node that follows a stream"),
        ("  g: {model: guard, input: '{{ reply.finish_reason }}', follows: reply}",
         "reads text, piece, index, tokens of it, not 'finish_reason'"),
        ("  g: {model: guard, input: '{{ reply.piece }}', follows: reply, "
         "cut_when: \"g.labl == 'unsafe'\"}", "classify node 'g' has no field 'labl'"),
        ("  s: {model: dialog, prompt: '{{ reply.text }}', follows: reply, cut_when: 'true'}",
         "runs once, at its end"),
        ("  after: {model: guard, input: '{{ reply.text }}'}\n"
         "  g: {model: guard, input: '{{ after.label }} {{ reply.piece }}', follows: reply, "
         "cut_when: 'false'}", "cannot wait for 'after', which waits for 'reply'"),
    ],
)  # fmt: skip
def test_bad_streamed_edges_are_refused_at_load_naming_the_line(dirs, nodes, message):
    with pytest.raises(GraphValidationError) as caught:
        load_graph_text(graph(dirs, nodes), "followed.yaml")
    text = str(caught.value)
    assert message in text
    assert "followed.yaml:" in text


def test_a_node_following_its_own_follower_is_a_cycle(dirs):
    text = graph(dirs, "  g: {model: dialog, prompt: '{{ reply.text }} {{ h.text }}', follows: reply}\n"
                       "  h: {model: dialog, prompt: '{{ g.text }}', follows: g}")  # fmt: skip
    text = text.replace('prompt: "User: {{ inputs.text }} Assistant:"', "prompt: '{{ h.text }}'")
    with pytest.raises(GraphValidationError, match="dependency cycle"):
        load_graph_text(text, "followed.yaml")


# ---------------------------------------------------------------- guards


GUARD = """
  guard:
    function: "follow_nodes:check"
    follows: {node: reply, tokens: 4}
    args: {piece: "{{ reply.piece }}", index: "{{ reply.index }}"}
    cut_when: "guard.index >= 2"
"""


def test_a_guard_that_cuts_stops_generation_and_nothing_unsafe_reaches_the_client(dirs):
    rt, executor = start(graph(dirs, GUARD, max_tokens=60))
    try:
        full = solo(rt, "User: hello there Assistant:", 60)
        assert len(full.token_ids) == 60  # the tiny model never stops by itself
        events = asyncio.run(events_of(executor, {"text": "hello there"}))
        kinds = [e.type for e in events]
        assert kinds[-1] == "cut"
        result = events[-1].result
        assert result.cut == {"node": "guard", "follows": "reply", "piece": 2}
        pieces = [e.data for e in events if e.type == "piece"]
        assert [p["index"] for p in pieces] == [0, 1, 2]
        shown = "".join(e.data["text"] for e in events if e.type == "token")
        # what was shown is exactly the two pieces the guard passed, a prefix of the reply
        assert shown == result.outputs["reply"]
        assert full.text.startswith(shown)
        assert len(shown) == pieces[0]["result"]["chars"] + pieces[1]["result"]["chars"]
        # the third piece (the one that cut) never reached the client
        assert len(full.text) > len(shown) + pieces[2]["result"]["chars"] - 1
        assert result.nodes["reply"].status == "cut"
        assert result.nodes["reply"].usage["tokens"] < 60  # stopped early
        pages_back(rt)
    finally:
        rt.shutdown()


def test_held_text_waits_for_the_guard_and_all_of_it_comes_when_it_passes(dirs):
    nodes = GUARD.replace("guard.index >= 2", "guard.index < 0")
    rt, executor = start(graph(dirs, nodes, max_tokens=20))
    try:
        events = asyncio.run(events_of(executor, {"text": "hi"}))
        assert events[-1].type == "result"
        passed = 0  # characters of the pieces the guard has passed
        shown = 0
        for event in events:
            if event.type == "piece":
                passed += event.data["result"]["chars"]
            elif event.type == "token":
                shown += len(event.data["text"])
                assert shown <= passed  # never ahead of the guard
        reply = events[-1].result.outputs["reply"]
        assert shown == passed == len(reply)
        assert reply == solo(rt, "User: hi Assistant:", 20).text
    finally:
        rt.shutdown()


def test_classify_guard_pieces_from_many_streams_share_encoder_batches(dirs):
    nodes = """
  guard:
    model: guard
    follows: {node: reply, tokens: 3}
    input: "{{ reply.piece }}"
    cut_when: "guard.label == 'never'"
"""
    rt, executor = start(graph(dirs, nodes, "{reply: reply.text, last: guard.last.label}", 12))
    try:

        async def many():
            return await asyncio.gather(*(executor.run({"text": f"q{i}"}) for i in range(12)))

        results = asyncio.run(many())
        assert max(rt.stats().models["guard"].batch_sizes) > 1
        for i, result in enumerate(results):
            assert result.cut is None
            assert result.outputs["reply"] == solo(rt, f"User: q{i} Assistant:", 12).text
            assert result.outputs["last"] in ("safe", "unsafe")
        assert rt.engine.pool.stats().used_pages == 0
    finally:
        rt.shutdown()


def test_a_slow_follower_gets_merged_pieces_and_never_holds_up_the_generation(dirs):
    nodes = """
  slow:
    function: "follow_nodes:slow"
    follows: {node: reply, tokens: 1, buffer: 2}
    hold: false
    args: {piece: "{{ reply.piece }}"}
"""
    text = graph(dirs, nodes, "{reply: reply.text, pieces: slow.pieces}", max_tokens=30)
    rt, executor = start(text)
    try:
        result = asyncio.run(executor.run({"text": "go"}))
        pieces = [p["piece"] for p in result.outputs["pieces"]]
        assert "".join(pieces) == result.outputs["reply"]  # every character, in order
        assert len(pieces) < 30  # the full buffer merged pieces instead of queueing 30
        assert result.nodes["reply"].finished < result.nodes["slow"].finished
    finally:
        rt.shutdown()


def test_an_async_generator_follows_the_stream_and_yields_events(dirs):
    nodes = """
  loud:
    function: "follow_nodes:shout"
    follows: {node: reply, chars: 5}
    args: {suffix: "|"}
"""
    rt, executor = start(graph(dirs, nodes, "{reply: reply.text, loud: loud.pieces}", 16))
    try:
        events = asyncio.run(events_of(executor, {"text": "yo"}))
        result = events[-1].result
        reply = result.outputs["reply"]
        expected = [reply[i : i + 5].upper() + "|" for i in range(0, len(reply), 5)]
        assert result.outputs["loud"] == expected
        assert [e.data["result"] for e in events if e.type == "piece"] == expected
    finally:
        rt.shutdown()


# ---------------------------------------------------------------- LLM -> LLM


def test_a_generate_follower_prefills_as_text_arrives_and_answers_the_same(dirs):
    summary = """
  summary:
    model: dialog
    follows: {node: reply, tokens: 8}
    prompt: "Summarize this reply in a few words. Reply: {{ reply.text }}"
    params: {max_tokens: 8}
"""
    streamed = graph(dirs, summary, "{reply: reply.text, summary: summary.text}", 64)
    plain = streamed.replace("    follows: {node: reply, tokens: 8}\n", "")
    rt, executor = start(streamed)
    try:
        result = asyncio.run(executor.run({"text": "tell me a story"}))
        hits = rt.stats().models["dialog"].counters
    finally:
        rt.shutdown()
    rt, executor = start(plain)
    try:
        alone = asyncio.run(executor.run({"text": "tell me a story"}))
        hits_alone = rt.stats().models["dialog"].counters
    finally:
        rt.shutdown()
    assert result.outputs == alone.outputs  # greedy: the same text either way
    key = "cached_tokens"
    assert hits[key] > hits_alone[key] + 32  # the final prompt found most of itself cached


# ---------------------------------------------------------------- over HTTP


GUARDED_CHAT = """
name: guarded
models:
  dialog: {{source: {dialog}, task: generate}}
inputs: {{history: messages}}
nodes:
  reply: {{model: dialog, messages: "{{{{ inputs.history }}}}", params: {{max_tokens: 60}}}}
  guard:
    function: "follow_nodes:check"
    follows: {{node: reply, tokens: 5}}
    args: {{piece: "{{{{ reply.piece }}}}", index: "{{{{ reply.index }}}}"}}
    cut_when: "guard.index >= 1"
outputs: {{reply: reply.text}}
"""


def test_over_http_a_cut_ends_the_event_stream_and_the_openai_stream(dirs, tmp_path):
    import httpx
    import openai

    from trae_groups.serving.server import ServerConfig, ServerThread, create_app

    path = tmp_path / "guarded.yaml"
    path.write_text(GUARDED_CHAT.format(dialog=dirs["dialog"]))
    history = [{"role": "user", "content": "hello"}]
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20, fast_linear=False))
    with ServerThread(create_app([path], config)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            whole = http.post("/v1/graphs/guarded", json={"inputs": {"history": history}})
            assert whole.status_code == 200
            body = whole.json()
            assert body["cut"] == {"node": "guard", "follows": "reply", "piece": 1}
            assert body["nodes"]["reply"]["status"] == "cut"
            sse = http.post(
                "/v1/graphs/guarded", json={"inputs": {"history": history}, "stream": True}
            )
            events = [
                (block.split("\n")[0].removeprefix("event: "),
                 json.loads(block.split("data: ", 1)[1]))
                for block in sse.text.strip().split("\n\n")
            ]  # fmt: skip
            assert [name for name, _ in events[-2:]] == ["cut", "done"]
            shown = "".join(data["text"] for name, data in events if name == "token")
            assert shown == events[-2][1]["outputs"]["reply"] == body["outputs"]["reply"]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        chunks = list(
            client.chat.completions.create(model="guarded", messages=history, stream=True)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == body["outputs"]["reply"]
        assert chunks[-1].choices[0].finish_reason == "content_filter"


def test_the_dsl_declares_the_same_streamed_edges_as_yaml(dirs):
    from trae_groups.dsl import ModelGroup

    group = ModelGroup("followed")
    group.add_model("dialog", path=str(dirs["dialog"]), task="generate")
    group.add_model("guard", path=str(dirs["guard"]), task="classify")
    text = group.input("text", str)
    reply = group.generate(
        "reply", model="dialog", prompt=f"User: {text} Assistant:", max_tokens=40
    )
    guard = group.classify(
        "guard", model="guard", input=reply.piece, follows={"node": reply, "tokens": 4},
        cut_when="guard.label == 'unsafe'",
    )  # fmt: skip
    group.generate("summary", model="dialog", prompt=f"Sum: {reply.text}", follows=reply)
    group.output("reply", reply.text)
    group.output("verdict", guard.last.label)
    spec = group.spec()
    assert spec.nodes["guard"].follows == Follows(node="reply", tokens=4)
    assert spec.nodes["guard"].holds and spec.nodes["guard"].cut_when == "guard.label == 'unsafe'"
    assert spec.nodes["summary"].follows == Follows(node="reply", every="sentence")


def test_trae_show_draws_streamed_edges_apart(dirs):
    from trae_groups.drawing import as_dot, as_mermaid, as_text
    from trae_groups.graphs.compile import compile_graph

    nodes = GUARD.replace("tokens: 4", "chars: 9")
    compiled = compile_graph(load_graph_text(graph(dirs, nodes), "followed.yaml"))
    assert "reply ==>|streams| guard" in as_mermaid(compiled)
    assert '"reply" -> "guard" [style=bold, label="streams"];' in as_dot(compiled)
    assert "guard [python: follow_nodes:check]  (follows reply's stream, every 9 chars)" in (
        as_text(compiled)
    )
