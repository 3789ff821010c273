"""The OpenAI-compatible endpoints through the official `openai` client, on a real
uvicorn with real tiny models."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from conftest import build_llm, wait_until
from trae_groups.engine import EngineConfig
from trae_groups.serving.openai_api import chat_parts
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

CHAT = """
name: chat
models:
  dialog: {{source: {root}/llama, task: generate}}
inputs:
  history: messages
  tone: {{type: str, default: plain}}
nodes:
  answer:
    model: dialog
    messages: "{{{{ inputs.history }}}}"
    params: {{max_tokens: 7, temperature: 0}}
outputs: {{reply: answer.text}}
"""
# `dialog` here is another model than chat's; `writer` is the same folder as chat's
ALT = """
name: alt
models:
  dialog: {{source: {root}/qwen, task: generate}}
  writer: {{source: {root}/llama, task: generate}}
inputs: {{text: str}}
nodes:
  say: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 3}}}}
  write: {{model: writer, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 3}}}}
outputs: {{said: say.text, wrote: write.text}}
"""
SAGA = """
name: saga
models:
  teller: {{source: {root}/llama, task: generate}}
inputs: {{history: messages}}
nodes:
  tell: {{model: teller, messages: "{{{{ inputs.history }}}}", params: {{max_tokens: 900, ignore_eos: true}}}}
outputs: {{story: tell.text}}
"""
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "where is my order?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("openai")
    build_llm(root / "llama", "llama", max_position_embeddings=1024)
    build_llm(root / "qwen", "qwen2", seed=3)
    (root / "chat.yaml").write_text(CHAT.format(root=root))
    (root / "alt.yaml").write_text(ALT.format(root=root))
    (root / "saga.yaml").write_text(SAGA.format(root=root))
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    app = create_app([root / f"{g}.yaml" for g in ("chat", "alt", "saga")], config)
    with ServerThread(app) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------- the model rule


def test_models_lists_chat_graphs_graph_models_and_unique_bare_names(client):
    ids = {m.id for m in client.models.list().data}
    assert ids == {"chat", "chat/dialog", "alt/dialog", "alt/writer", "writer", "saga",
                   "saga/teller", "teller"}  # fmt: skip
    # "dialog" names two different models (chat's and alt's): only graph/model reaches them


def test_the_chat_graph_rule(server):
    graphs = server.state.graphs
    assert chat_parts(graphs["chat"].spec) == ("history", "reply", "answer")
    assert chat_parts(graphs["alt"].spec) is None  # no messages input, two outputs


def test_an_ambiguous_bare_name_is_404_with_a_hint(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="dialog", messages=MESSAGES)
    assert "graph/dialog" in caught.value.message


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-9", prompt="hi")
    assert caught.value.body["param"] == "model"


# ---------------------------------------------------------------- an LLM


def test_chat_completion_on_an_llm(client):
    reply = client.chat.completions.create(
        model="writer", messages=MESSAGES, max_tokens=5, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens > 0
    assert reply.model == "writer"


def test_streamed_chat_matches_the_whole_answer(client):
    kwargs = dict(model="chat/dialog", messages=MESSAGES, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_whole_and_streamed(client):
    kwargs = dict(model="alt/writer", prompt="Once upon a time", max_tokens=5, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == whole.choices[0].text


def test_completion_from_token_ids(client):
    reply = client.completions.create(model="writer", prompt=[5, 17, 42], max_tokens=3)
    assert reply.usage.prompt_tokens == 3
    assert reply.usage.completion_tokens == 3


def test_stop_and_seed_are_honoured(client):
    kwargs = dict(model="writer", prompt="hello world", max_tokens=8, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    if len(first) > 2:
        stop = first[1:3]
        cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop"
        assert stop not in cut.text


# ---------------------------------------------------------------- a chat graph


def test_chat_completion_on_a_chat_graph_equals_running_the_graph(client, server):
    reply = client.chat.completions.create(model="chat", messages=MESSAGES)
    graph = httpx.post(
        f"{server.url}/v1/graphs/chat", json={"inputs": {"history": MESSAGES}}, timeout=60
    ).json()
    assert reply.choices[0].message.content == graph["outputs"]["reply"]
    assert reply.usage.completion_tokens == 7


def test_streamed_chat_graph(client):
    whole = client.chat.completions.create(model="chat", messages=MESSAGES)
    chunks = list(client.chat.completions.create(model="chat", messages=MESSAGES, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    # the graph's generate node decides: its max_tokens here ends the reply ("length")
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0


def test_content_parts_are_joined(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "where is "},
                                          {"type": "text", "text": "my order?"}]}]  # fmt: skip
    joined = [{"role": "user", "content": "where is my order?"}]
    a = client.chat.completions.create(model="chat", messages=parts)
    b = client.chat.completions.create(model="chat", messages=joined)
    assert a.choices[0].message.content == b.choices[0].message.content


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 33}, "n"),
        ({"temperature": 5}, "temperature"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
        ({"seed": -1}, "seed"),
    ],
)
def test_unsupported_or_invalid_parameters_are_422_naming_them(client, extra, param):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="writer", messages=MESSAGES, **extra)
    assert caught.value.body["param"] == param


def test_bad_messages_are_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="chat", messages=[{"content": "no role"}])
    assert caught.value.body["param"].startswith("messages")
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="writer", messages=[])


def test_completions_on_a_graph_and_empty_prompts_are_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model="chat", prompt="hi")
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model="writer", prompt="")
    assert caught.value.body["param"] == "prompt"


@pytest.mark.parametrize("target", ["writer", "saga"])
def test_leaving_a_stream_early_aborts_and_frees_pages(client, server, target):
    engine = server.state.runtime.engine
    worker = engine.llms[server.state.graphs["chat"].nodes["answer"].model]
    wait_until(lambda: engine.pool.stats().used_pages == 0, "an idle pool")
    generated = worker.counters.generated
    messages = [{"role": "user", "content": "Once upon a time"}]
    with client.chat.completions.create(
        model=target,
        messages=messages,
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        assert worker.stats()["running"] == 1
    wait_until(lambda: worker.stats()["running"] == 0, "the request to be aborted")
    wait_until(lambda: engine.pool.stats().used_pages == 0, "pages back in the pool")
    assert worker.counters.generated - generated < 900
    assert server.state.graphs[target if target == "saga" else "alt"].inflight == 0


# ---------------------------------------------------------------- one model, ids, usage


def test_one_model_by_its_id_and_an_unknown_one_is_404_naming_it(client, server):
    listed = {m.id: m for m in client.models.list().data}
    for name in ("chat/dialog", "writer", "chat"):
        one = client.models.retrieve(name)
        assert one.id == name and one.object == "model"
        assert one.model_extra["trae"] == listed[name].model_extra["trae"]
    missing = httpx.get(f"{server.url}/v1/models/gpt-9", timeout=30)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["param"] == "model" and "gpt-9" in error["message"]


def test_chat_ids_are_chatcmpl_and_completion_ids_cmpl(client):
    for model in ("writer", "chat"):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert reply.id.startswith("chatcmpl-"), reply.id
        chunks = list(client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, stream=True))  # fmt: skip
        assert all(c.id.startswith("chatcmpl-") for c in chunks)
    assert client.completions.create(model="writer", prompt="hi", max_tokens=2).id.startswith(
        "cmpl-"
    )


def test_a_chat_graph_takes_max_tokens_below_its_node_s_own(client):
    for asked, written in ((3, 3), (1, 1), (50, 7)):  # the node's max_tokens is 7
        reply = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=asked)
        assert reply.usage.completion_tokens == written
        assert reply.choices[0].finish_reason == "length"
    streamed = list(client.chat.completions.create(
        model="chat", messages=MESSAGES, max_completion_tokens=2, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert streamed[-1].usage.completion_tokens == 2


def test_a_chat_graph_reports_its_prompt_s_true_token_count(client, server):
    reply = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
    # the node's prompt is the messages through its model's template: what /tokenize counts
    counted = httpx.post(f"{server.url}/tokenize", json={"model": "chat/dialog",
                         "messages": MESSAGES}, timeout=30).json()  # fmt: skip
    assert reply.usage.prompt_tokens == counted["count"] > 0
    direct = client.chat.completions.create(model="chat/dialog", messages=MESSAGES, max_tokens=1)
    assert direct.usage.prompt_tokens == reply.usage.prompt_tokens
