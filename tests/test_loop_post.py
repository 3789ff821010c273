"""Calls from the engine thread onto an event loop (engine/loop_post.py): a step's worth of
them wakes the loop once, in order, and none is lost on any path."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from conftest import build_llm
from trae_groups.engine import loop_post
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.loop_post import LoopPost, batched, wrap_future
from trae_groups.engine.protocol import GenerateRequest
from trae_groups.engine.sampling import SamplingParams


class CountingLoop:
    """What LoopPost needs of a loop, counting the wake-ups it is asked for."""

    def __init__(self, closed: bool = False):
        self.wakes: list = []
        self.closed = closed
        self.errors: list[dict] = []

    def call_soon_threadsafe(self, fn):
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.wakes.append(fn)

    def call_exception_handler(self, context):
        self.errors.append(context)

    def run(self):
        wakes, self.wakes = self.wakes, []
        for fn in wakes:
            fn()


def test_calls_posted_in_a_batched_block_wake_the_loop_once_at_its_end_in_order():
    loop, seen = CountingLoop(), []
    post = LoopPost(loop)
    with batched():
        for i in range(64):
            post.post(seen.append, i)
        assert loop.wakes == []  # held until the step ends
    assert len(loop.wakes) == 1
    loop.run()
    assert seen == list(range(64))


def test_outside_a_block_the_first_call_wakes_the_loop_and_later_ones_ride_along():
    loop, seen = CountingLoop(), []
    post = LoopPost(loop)
    post.post(seen.append, 1)
    post.post(seen.append, 2)
    assert len(loop.wakes) == 1
    loop.run()
    post.post(seen.append, 3)  # drained: the next call wakes it again
    assert len(loop.wakes) == 1
    loop.run()
    assert seen == [1, 2, 3]


def test_a_failing_call_is_reported_and_the_others_still_run():
    loop, seen = CountingLoop(), []
    post = LoopPost(loop)
    with batched():
        post.post(seen.append, 1)
        post.post(lambda: 1 / 0)
        post.post(seen.append, 2)
    loop.run()
    assert seen == [1, 2]
    assert len(loop.errors) == 1 and isinstance(loop.errors[0]["exception"], ZeroDivisionError)


def test_a_closed_loop_drops_the_calls_without_raising_into_the_engine():
    loop = CountingLoop(closed=True)
    post = LoopPost(loop)
    with batched():
        post.post(print, "never")
    post.post(print, "never")
    assert loop.wakes == []


def test_a_block_that_raises_still_wakes_the_loop():
    loop, seen = CountingLoop(), []
    post = LoopPost(loop)
    with pytest.raises(ValueError), batched():
        post.post(seen.append, 1)
        raise ValueError
    loop.run()
    assert seen == [1]


def test_wrap_future_hands_over_results_errors_and_cancellation():
    async def main():
        done: Future = Future()
        waiter = wrap_future(done)
        threading.Thread(target=done.set_result, args=(7,)).start()
        assert await waiter == 7
        failed: Future = Future()
        waiter = wrap_future(failed)
        threading.Thread(target=failed.set_exception, args=(KeyError("x"),)).start()
        with pytest.raises(KeyError):
            await waiter
        pending: Future = Future()
        waiter = wrap_future(pending)
        waiter.cancel()
        await asyncio.sleep(0)
        assert pending.cancelled()  # the engine's item is cancelled with its awaitable

    asyncio.run(main())


def test_a_real_engine_step_wakes_the_loop_once_for_all_its_streams(tmp_path, monkeypatch):
    """32 streams of 16 tokens each: every output arrives, and the loop is woken about once
    per step, not once per output."""
    wakes = [0]
    real_wake = LoopPost._wake
    monkeypatch.setattr(LoopPost, "_wake", lambda self: (wakes.__setitem__(0, wakes[0] + 1),
                                                         real_wake(self))[1])  # fmt: skip
    folder = build_llm(tmp_path / "m", "llama")
    engine = LLMEngine({"m": str(folder)}, EngineConfig(pool_bytes=32 << 20)).start()
    try:
        client = engine.client("m")
        params = SamplingParams(max_tokens=16, ignore_eos=True)

        async def one(i: int) -> int:
            request = GenerateRequest(f"r{i}", params, prompt=(5, 6, 7 + i))
            return sum([len(chunk.token_ids) async for chunk in client.generate(request)])

        async def main():
            return await asyncio.gather(*(one(i) for i in range(32)))

        assert asyncio.run(main()) == [16] * 32
    finally:
        engine.shutdown()
    assert wakes[0] < 32 * 16 // 4  # 512 outputs; about one wake-up per step


def test_loop_post_is_one_per_loop():
    loop = CountingLoop()
    assert loop_post.loop_post(loop) is loop_post.loop_post(loop)


def test_a_loop_that_is_gone_leaves_no_loop_post_behind():
    """The registry must not keep loops alive: a script calling asyncio.run per request
    would hold every closed loop."""
    import gc

    gc.collect()  # loops earlier tests left to the collector go now, not in the count below
    loop = CountingLoop()
    loop_post.loop_post(loop)
    before = len(loop_post._posts)
    del loop
    gc.collect()
    assert len(loop_post._posts) == before - 1
