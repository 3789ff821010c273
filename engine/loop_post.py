"""Calls from the engine thread onto an event loop, one wake-up for a step's worth of them.

``loop.call_soon_threadsafe`` writes a byte to the loop's self-pipe on every call: a step
that hands 64 streams their tokens (or 64 encoder items their results) made 64 system calls
and woke the loop up to 64 times, each wake-up a hand-over of the GIL between the engine
thread and the loop's (the write releases it, the woken loop takes it). In the engine
process of ``trae serve`` that was a tenth of its CPU at 64 clients (py-spy:
``_write_to_self``), and queueing alone did not coalesce them: 512 outputs of 32 streams
woke the loop 415 times. So the engine loop runs each step ``batched()``: what is posted
meanwhile on that thread waits for the step's end, and each loop is woken once for all of
it, in the order posted. Posted from anywhere else, a call wakes its loop at once.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

_posts: weakref.WeakKeyDictionary[Any, LoopPost] = weakref.WeakKeyDictionary()
_posts_lock = threading.Lock()
_held = threading.local()  # .posts: the LoopPosts with calls held until the step's end


class LoopPost:
    """Calls queued for one event loop, drained on it in order."""

    def __init__(self, loop: Any):
        self._loop_ref = weakref.ref(loop)  # not the loop itself: the registry's key
        self._lock = threading.Lock()
        self._queued: list[tuple[Callable[..., Any], tuple]] = []

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon (any thread; in a ``batched()`` block, once
        it ends). A closed loop drops it, as ``call_soon_threadsafe`` would raise: nobody
        is left to read the result."""
        held = getattr(_held, "posts", None)
        with self._lock:
            self._queued.append((fn, args))
            if held is not None:
                held.add(self)
                return
            if len(self._queued) > 1:
                return  # a wake-up is on its way
        self._wake()

    def _wake(self) -> None:
        loop = self._loop_ref()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._queued.clear()

    def _drain(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
        for fn, args in queued:
            try:
                fn(*args)
            except Exception as exc:  # one caller's failure is its own, as with call_soon
                self._loop_ref().call_exception_handler(
                    {"message": f"exception in {fn!r} posted from the engine", "exception": exc}
                )


@contextmanager
def batched() -> Iterator[None]:
    """Hold this thread's posts until the block ends, then wake each loop once."""
    if getattr(_held, "posts", None) is not None:  # nested: the outer block wakes them
        yield
        return
    _held.posts = posts = set()
    try:
        yield
    finally:
        _held.posts = None
        for post in posts:
            post._wake()


def loop_post(loop: Any) -> LoopPost:
    """The one ``LoopPost`` of ``loop``."""
    with _posts_lock:
        post = _posts.get(loop)
        if post is None:
            post = _posts[loop] = LoopPost(loop)
        return post


def wrap_future(future: Future) -> asyncio.Future:
    """``asyncio.wrap_future`` on the running loop, the result handed over through its
    ``LoopPost`` (one wake-up for a batch's items); cancelling the awaitable cancels
    ``future``."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    post = loop_post(loop).post

    def copy(done: Future) -> None:  # on the loop
        if waiter.done():
            return
        if done.cancelled():
            waiter.cancel()
        elif done.exception() is not None:
            waiter.set_exception(done.exception())
        else:
            waiter.set_result(done.result())

    waiter.add_done_callback(lambda w: w.cancelled() and future.cancel())
    future.add_done_callback(lambda done: post(copy, done))
    return waiter
