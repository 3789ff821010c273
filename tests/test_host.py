"""engine/host.py without graphs: ModelLoads in, clients out; sharing by key, reference
counts, encoder heads grouped by backbone; and the task registry (engine/tasks.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import build_encoder, build_llm
from trae_groups.engine import EngineConfig, SamplingParams
from trae_groups.engine.host import ModelHost, ModelLoad
from trae_groups.engine.protocol import EncodeRequest, GenerateRequest, ModelClient
from trae_groups.engine.tasks import ENCODER_TASKS, PAIR_TASKS, TASKS, generates
from trae_groups.graphs.nodes import TASKS as NODE_TASKS
from trae_groups.graphs.runtime import ModelRuntime, Runtime


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("host_models")
    return {
        "intent": build_encoder(root / "intent", "classify", ["a", "b"], seed=3),
        "embed": build_encoder(root / "embed", "embed", [], seed=5),
        "dialog": build_llm(root / "dialog", "llama"),
    }


def host() -> ModelHost:
    return ModelHost(EngineConfig(pool_bytes=8 << 20, fast_linear=False))


def test_loads_with_one_key_share_a_client_until_the_last_user_releases(dirs):
    h = host()
    load = ModelLoad(dirs["dialog"], "generate")
    try:
        first = h.acquire("dialog", load)
        again = h.acquire("other-name", load)  # same key: the same model, one more user
        assert again is first and list(h.engine.llms) == ["dialog"]
        limited = h.acquire("dialog", ModelLoad(dirs["dialog"], "generate", max_tokens_limit=4))
        assert limited is not first and sorted(h.engine.llms) == ["dialog", "dialog-2"]
        h.start()

        async def reply(client: ModelClient) -> str:
            request = GenerateRequest("r", SamplingParams(max_tokens=3), prompt="hello")
            return "".join([chunk.text async for chunk in client.generate(request)])

        assert asyncio.run(reply(first)) == asyncio.run(reply(limited))
        h.release(first)
        assert "dialog" in h.engine.llms  # one user left
        h.release(again)
        assert "dialog" not in h.engine.llms and h.engine.pool.stats().used_pages == 0
    finally:
        h.shutdown()


def test_encoders_of_one_load_call_share_a_worker_only_with_their_backbone(dirs):
    h = host()
    wanted = [
        ("i", "intent", ModelLoad(dirs["intent"], "classify")),
        ("i2", "intent", ModelLoad(dirs["intent"], "classify")),  # listed twice: shared
        ("e", "embed", ModelLoad(dirs["embed"], "embed")),  # another backbone
    ]
    try:
        clients = h.load(wanted)
        assert clients["i"] is clients["i2"]
        assert clients["i"].worker is not clients["e"].worker
        h.start()
        got = asyncio.run(clients["i"].encode(EncodeRequest("hello there", "x")))
        assert set(got["scores"]) == {"a", "b"}
        for key in ("i", "i2", "e"):
            h.release(clients[key])
        assert h.engine.loop.workers == {}
    finally:
        h.shutdown()


def test_every_graph_task_is_an_engine_task_and_the_registry_says_how_it_runs():
    assert set(NODE_TASKS) <= set(TASKS)
    assert [t for t in TASKS if generates(t)] == ["generate"]
    assert set(ENCODER_TASKS) == set(TASKS) - {"generate"}
    assert set(PAIR_TASKS) == {"rerank"}
    assert not generates("no-such-task")


def test_the_local_runtime_is_a_runtime():
    runtime = ModelRuntime(EngineConfig(pool_bytes=1 << 20))
    try:
        assert isinstance(runtime, Runtime)
    finally:
        runtime.shutdown()
