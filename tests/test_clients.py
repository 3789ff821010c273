"""engine/clients.py: the local ModelClients. A huge prompt is tokenized on a worker
thread, not on the event loop that serves every other request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from trae_groups.engine import EngineConfig, LLMEngine, RequestError, SamplingParams, chat
from trae_groups.engine.clients import OFFLOAD_CHARS, LocalLLM
from trae_groups.engine.protocol import GenerateRequest


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = LLMEngine({"m": llama_dir}, EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    eng.start()
    yield eng
    eng.shutdown()


def collect(engine, request: GenerateRequest, seen: list) -> list[int]:
    """Run one request through a fresh client; tokenizing a text records its thread."""
    client = LocalLLM(engine.llms["m"], lambda: engine.loop.running)
    real = chat.encode

    def spy(tokenizer, text):
        seen.append(threading.current_thread())
        return real(tokenizer, text)

    async def run() -> list[int]:
        ids: list[int] = []
        async for chunk in client.generate(request):
            ids += chunk.token_ids
        return ids

    chat.encode = spy
    try:
        return asyncio.run(run())
    finally:
        chat.encode = real


def test_a_huge_prompt_is_tokenized_off_the_event_loop(engine, monkeypatch):
    import trae_groups.engine.clients as clients

    # The tiny model reads 256 positions, so a text past OFFLOAD_CHARS is refused before
    # it is tokenized (llm_worker's bounds): a lower threshold lets one be tokenized.
    monkeypatch.setattr(clients, "OFFLOAD_CHARS", 100)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    small, big = "hello world", "hello world " * 30
    seen: list = []
    collect(engine, GenerateRequest("small", params, prompt=small), seen)
    assert len(collect(engine, GenerateRequest("big", params, prompt=big), seen)) == 4
    loop_thread, worker_thread = seen
    assert loop_thread is threading.main_thread()  # asyncio.run's loop: this thread
    assert worker_thread is not threading.main_thread()


def test_a_text_past_the_limit_is_refused_off_the_event_loop_without_tokenizing(engine):
    big = "hello world " * (OFFLOAD_CHARS // 12 + 1)
    seen: list = []
    with pytest.raises(RequestError) as err:
        collect(engine, GenerateRequest("big", SamplingParams(max_tokens=4), prompt=big), seen)
    assert err.value.field == "prompt" and "characters" in str(err.value)
    assert seen == []


def test_both_paths_give_the_same_tokens(engine, monkeypatch):
    import trae_groups.engine.clients as clients

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = "the quick brown fox " * 4
    on_loop = collect(engine, GenerateRequest("a", params, prompt=prompt), [])
    monkeypatch.setattr(clients, "OFFLOAD_CHARS", 8)  # the same prompt, off the loop
    off_loop = collect(engine, GenerateRequest("b", params, prompt=prompt), [])
    assert on_loop == off_loop and len(on_loop) == 6
