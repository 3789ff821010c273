"""PassingThreads: model work off the engine thread leaves no OpenMP team behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import wait_until
from trae_groups.engine.passing_threads import (
    PassingThreads,
    in_passing_thread,
    release_openmp_team,
)


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _parallel_work() -> int:
    """A torch op big enough to open an OpenMP parallel region on the calling thread."""
    a = torch.ones(512, 512)
    return int((a @ a).sum().item())


def _settled_new_tids(before: set[int], bound_s: float = 10.0) -> set[int]:
    """Thread ids that appeared since ``before`` and are still there once exits settle."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        new = _tids() - before
        if not new:
            return new
        time.sleep(0.05)
    return _tids() - before


def test_calls_run_in_order_one_at_a_time_each_on_a_thread_that_ends():
    executor = PassingThreads("test-work")
    order: list[int] = []
    running = [0]
    threads: list[threading.Thread] = []
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            running[0] += 1
            assert running[0] == 1, "two calls ran at once"
        threads.append(threading.current_thread())
        time.sleep(0.01)
        order.append(i)
        with lock:
            running[0] -= 1
        return i * i

    futures = [executor.submit(job, i) for i in range(6)]
    assert [f.result(timeout=30) for f in futures] == [i * i for i in range(6)]
    assert order == list(range(6))
    assert len({id(t) for t in threads}) == 6  # a new thread for every call
    executor.shutdown(wait=True)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(job, 0)


def test_errors_reach_the_caller_and_the_next_call_still_runs():
    executor = PassingThreads("test-work")

    def fail() -> None:
        raise ValueError("bad folder")

    failed = executor.submit(fail)
    after = executor.submit(lambda: "ran")
    with pytest.raises(ValueError, match="bad folder"):
        failed.result(timeout=30)
    assert after.result(timeout=30) == "ran"
    executor.shutdown()


def test_a_cancelled_pending_call_never_runs():
    executor = PassingThreads("test-work")
    gate = threading.Event()
    ran: list[str] = []
    first = executor.submit(gate.wait, 30)
    second = executor.submit(ran.append, "second")
    assert second.cancel()
    third = executor.submit(ran.append, "third")
    gate.set()
    assert first.result(timeout=30) is True
    third.result(timeout=30)
    assert ran == ["third"]
    executor.shutdown()


def test_awaitable_form_returns_the_result():
    executor = PassingThreads("test-work")

    async def main() -> int:
        return await in_passing_thread(executor, lambda a, b: a + b, 2, 3)

    assert asyncio.run(main()) == 5
    executor.shutdown()


openmp = "OpenMP" in torch.__config__.parallel_info()


@pytest.mark.skipif(not openmp, reason="torch is not built with OpenMP here")
def test_no_openmp_team_outlives_a_call():
    """A parallel op on a pooled thread leaves its thread and its OpenMP workers alive (what
    throttles the engine's team); on a passing thread, every thread it made is gone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _tids()
        pool = ThreadPoolExecutor(1)
        pool.submit(_parallel_work).result(timeout=60)
        kept = _settled_new_tids(before, bound_s=1.0)
        assert len(kept) >= 2, "the pool's thread and its OpenMP worker should stay"
        pool.shutdown(wait=True)
        _settled_new_tids(before)

        before = _tids()
        executor = PassingThreads("test-work")
        assert executor.submit(_parallel_work).result(timeout=60) > 0
        executor.shutdown(wait=True)
        assert _settled_new_tids(before) == set()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not openmp, reason="torch is not built with OpenMP here")
def test_a_thread_that_lives_on_gives_its_team_back():
    """A thread that ran parallel ops keeps its OpenMP workers until release_openmp_team();
    then only the thread itself is left (what LLMEngine does after loading, off its loop)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: dict[str, set[int]] = {}
    release, done = threading.Event(), threading.Event()
    before = _tids()

    def body() -> None:
        _parallel_work()
        seen["working"] = _tids() - before
        release.wait(60)
        seen["released"] = {1} if release_openmp_team() else set()
        done.set()
        threading.Event().wait(2)  # alive while the workers' exit is seen

    thread = threading.Thread(target=body)
    try:
        thread.start()
        wait_until(lambda: "working" in seen, "the parallel op")
        assert len(seen["working"]) >= 2  # the thread and its OpenMP worker
        release.set()
        assert done.wait(60) and seen["released"] == {1}
        wait_until(lambda: len(_tids() - before) == 1, "the OpenMP worker to exit", 10)
    finally:
        thread.join(30)
        torch.set_num_threads(threads)
