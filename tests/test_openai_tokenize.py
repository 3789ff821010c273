"""/tokenize and /detokenize with vLLM's fields, over real HTTP: the counts are the
tokenizer's own and the ones the chat route reports."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import build_llm
from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

GRAPH = """
name: {name}
models:
  llm: {{source: {root}/llama, task: generate}}
inputs: {{text: str}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
outputs: {{said: say.text}}
"""
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokenize")
    build_llm(root / "llama", "llama", max_position_embeddings=320)
    (root / "one.yaml").write_text(GRAPH.format(name="one", root=root))
    (root / "two.yaml").write_text(GRAPH.format(name="two", root=root))
    return root


@pytest.fixture(scope="module")
def server(root):
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20, max_model_len=300))
    with ServerThread(create_app([root / "one.yaml"], config)) as running:
        yield running


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_a_prompt_s_tokens_are_the_tokenizer_s(server, root):
    tokenizer = AutoTokenizer.from_pretrained(root / "llama")
    text = "the quick brown fox"
    for special in (True, False):
        answer = _post(server, "/tokenize", {"model": "one/llm", "prompt": text,
                                             "add_special_tokens": special}).json()  # fmt: skip
        expected = tokenizer.encode(text, add_special_tokens=special)
        assert answer["tokens"] == expected and answer["count"] == len(expected)
        assert answer["max_model_len"] == 300  # the engine's, below the model's 320
        assert answer["token_strs"] is None
    named = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert named["token_strs"] == tokenizer.convert_ids_to_tokens(named["tokens"])  # one LLM


def test_messages_count_what_the_chat_route_reports(server):
    counted = _post(server, "/tokenize", {"model": "llm", "messages": MESSAGES}).json()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == counted["count"]
    bare = _post(server, "/tokenize", {"model": "llm", "messages": MESSAGES,
                                       "add_generation_prompt": False}).json()  # fmt: skip
    assert bare["count"] < counted["count"]
    assert counted["tokens"][: bare["count"]] == bare["tokens"]


def test_detokenize_gives_the_text_back(server):
    text = "hello world, how are you today?"
    ids = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    answer = _post(server, "/detokenize", {"model": "one/llm", "tokens": ids["tokens"]})
    assert answer.status_code == 200 and answer.json() == {"prompt": text}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
         "continue_final_message"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)  # fmt: skip
def test_bad_requests_are_422_naming_the_field(server, path, body, param):
    answer = _post(server, path, body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == param


def test_an_unknown_model_is_404_and_an_unnamed_one_among_several_422(server, root):
    assert _post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    with ServerThread(create_app([root / "one.yaml", root / "two.yaml"], config)) as two:
        answer = _post(two, "/tokenize", {"prompt": "x"})
        assert answer.status_code == 422 and answer.json()["error"]["param"] == "model"
        assert _post(two, "/tokenize", {"model": "two/llm", "prompt": "x"}).status_code == 200
