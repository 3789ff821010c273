"""Per-model limits of an LLM in a graph file: max_prompt_tokens and max_tokens_limit
(issue: one caller must not be able to take the engine with one huge request)."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import build_llm
from trae_groups.engine import EngineConfig
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

GRAPH = """
name: capped
models:
  llm: {{source: {root}/llm, task: generate, max_prompt_tokens: 12, max_tokens_limit: 8}}
inputs: {{text: str}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: {asked}}}}}
outputs: {{said: say.text, tokens: say.tokens}}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    build_llm(root / "llm", "llama")
    return root


def test_a_node_asking_more_than_the_limit_is_refused_at_load(root):
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(GRAPH.format(root=root, asked=16), "capped.yaml")
    (issue,) = err.value.issues
    assert issue.node == "say" and issue.line == 7
    assert "max_tokens 16 is over model 'llm''s max_tokens_limit (8)" in issue.message


def test_limits_are_for_generate_models_only(root):
    text = GRAPH.format(root=root, asked=4).replace("task: generate", "task: classify")
    with pytest.raises(GraphValidationError, match="max_prompt_tokens is for generate models"):
        load_graph_text(text, "capped.yaml")


@pytest.fixture(scope="module")
def server(root):
    path = root / "capped.yaml"
    path.write_text(GRAPH.format(root=root, asked=8))
    config = ServerConfig(engine=EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    with ServerThread(create_app([path], config)) as running:
        yield running


def test_limits_reach_the_engine_over_http(server):
    url = f"{server.url}/v1/completions"
    over = httpx.post(url, json={"model": "capped/llm", "prompt": "hello", "max_tokens": 20})
    assert over.status_code == 422 and over.json()["error"]["param"] == "max_tokens"
    assert "max_tokens_limit" in over.json()["error"]["message"]
    unasked = httpx.post(url, json={"model": "capped/llm", "prompt": "hello", "ignore_eos": True})
    assert unasked.status_code == 200
    assert unasked.json()["usage"]["completion_tokens"] == 8  # the default, lowered to the limit
    long = httpx.post(url, json={"model": "capped/llm", "prompt": list(range(3, 40))})
    assert long.status_code == 422 and long.json()["error"]["param"] == "prompt"
    assert "max_prompt_tokens" in long.json()["error"]["message"]
    graph = httpx.post(f"{server.url}/v1/graphs/capped", json={"inputs": {"text": "hello world"}})
    assert graph.status_code == 200 and graph.json()["outputs"]["tokens"] <= 8


def test_openai_requests_end_with_504_at_the_servers_limit(root):
    path = root / "slow.yaml"
    path.write_text(
        GRAPH.format(root=root, asked=8).replace("max_tokens_limit: 8", "max_tokens_limit: 900")
    )
    config = ServerConfig(
        engine=EngineConfig(pool_bytes=8 << 20, fast_linear=False), openai_timeout_s=0.05
    )
    body = {"model": "capped/llm", "prompt": "hello", "max_tokens": 240, "ignore_eos": True}
    with ServerThread(create_app([path], config)) as server:
        url = f"{server.url}/v1/completions"
        plain = httpx.post(url, json=body, timeout=60)
        assert plain.status_code == 504 and plain.json()["error"]["type"] == "Timeout"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            data = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and '"Timeout"' in data[-2]
        for _ in range(500):  # bounded: the generations were aborted, not run to the end
            if server.state.runtime.stats().models["llm"].running == 0:
                break
            time.sleep(0.01)
        assert server.state.runtime.stats().pool.used_pages == 0
