"""Torch work off the engine thread runs on threads that end when the work does.

With GNU OpenMP (torch's CPU build), every thread that runs a parallel op becomes the master
of a team of worker threads that lives as long as that thread. Once a process holds more
OpenMP threads than it has CPUs, libgomp stops spinning at its barriers and sleeps at every
one (its "throttled" spin count), and a decode step of a few hundred parallel regions pays a
futex sleep and wake-up at each: SmolLM2 on 2 cores, 38 ms a token with one team, 92-100 ms
with a second team idle in the process. A model loaded on a long-lived pool thread (an
executor's) leaves exactly such a second team behind; loaded on a thread that then ends, it
leaves none, and the engine thread's team keeps spinning as it should.

``PassingThreads`` is the executor for that work: each call on a new thread, one call at a
time, in the order submitted (what ``ThreadPoolExecutor(1)`` gives, minus the thread that
stays). Where the loading thread is not ours to end (a script's main thread that builds an
``LLMEngine`` and starts its loop, the engine's on-demand loader), ``release_openmp_team``
frees that thread's team once its models are loaded: the same script, 72-90 ms a token
without, 33-35 with.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from functools import cache
from typing import Any


class PassingThreads(Executor):
    """Run each submitted call on a fresh daemon thread, serially, FIFO."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._pending: deque[tuple[Future, Callable[..., Any], tuple, dict]] = deque()
        self._current: threading.Thread | None = None
        self._shutdown = False
        self._idle = threading.Condition(self._lock)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"{self._name}: cannot submit after shutdown")
            self._pending.append((future, fn, args, kwargs))
            if self._current is None:
                self._start_next()
        return future

    def _start_next(self) -> None:
        """With the lock held: start the next call that was not cancelled, if any."""
        while self._pending:
            future, fn, args, kwargs = self._pending.popleft()
            if future.set_running_or_notify_cancel():
                self._current = threading.Thread(
                    target=self._run, args=(future, fn, args, kwargs), name=self._name, daemon=True
                )
                self._current.start()
                return
        self._current = None
        self._idle.notify_all()

    def _run(self, future: Future, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            del fn, args, kwargs  # nothing of the call outlives it on this thread
        with self._lock:
            self._start_next()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._pending:
                    self._pending.popleft()[0].cancel()
            if wait:
                self._idle.wait_for(lambda: self._current is None and not self._pending)


async def in_passing_thread(executor: PassingThreads, fn: Callable[..., Any], *args: Any) -> Any:
    """Await ``fn(*args)`` run on ``executor``: the asyncio form of ``anyio.to_thread``."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


@cache
def _libgomp() -> Any:
    """The GNU OpenMP runtime this process loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libgomp" in path.rsplit("/", 1)[-1]:
                    return ctypes.CDLL(path)
    except OSError:
        return None
    return None


def release_openmp_team() -> bool:
    """Free the calling thread's OpenMP team (``omp_pause_resource_all``): a thread that
    loaded models and lives on (a script's main thread, a loader thread) then holds no team
    to throttle the engine's. Its next parallel op makes a new one. False without libgomp."""
    gomp = _libgomp()
    if gomp is None or not hasattr(gomp, "omp_pause_resource_all"):
        return False
    return gomp.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft (OpenMP 5.0)
