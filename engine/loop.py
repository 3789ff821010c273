"""One engine thread steps every worker (LLMs and encoders) in turn.

Policy: among workers with runnable work, step the one whose most urgent item is
(1) overdue — waited past its worker's queue-delay budget, then (2) due first (its
request's deadline; ``policy="deadline"``, the default), then (3) deepest in its
request's DAG, then (4) oldest. Encoders gather a batch until it is full or their
delay budget runs out, so a busy LLM delays an encoder batch by at most one step
past that budget. ``policy="graph"`` ignores deadlines; ``policy="fifo"`` ignores
deadlines and depth: overdue, then oldest (engine/deadlines.py).
torch releases the GIL inside kernels, so asyncio keeps serving
HTTP while this thread computes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from trae_groups.engine.loop_post import batched
from trae_groups.engine.memory import IDLE_TRIM_S, trim_heap
from trae_groups.engine.worker import Worker

log = logging.getLogger("trae_groups.engine")


class EngineLoop:
    def __init__(self, name: str = "trae-engine", policy: str = "deadline"):
        self.policy = policy
        self._workers: dict[str, Worker] = {}
        self._wake = threading.Condition()
        self._pending_wake = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._name = name
        self.steps = 0
        self.last_error: BaseException | None = None
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self.busy_seconds = 0.0  # time spent stepping workers: the device-utilisation metric
        self.trims = (
            0  # heap trims after work: once idle (memory.IDLE_TRIM_S), after inline batches
        )

    # -- workers -------------------------------------------------------------
    def add_worker(self, worker: Worker) -> None:
        with self._wake:
            if worker.name in self._workers:
                raise ValueError(f"a worker named {worker.name!r} is already on this engine")
            worker.policy = self.policy
            self._workers[worker.name] = worker
        self.wake()

    def remove_worker(self, name: str) -> Worker:
        """Unhook a worker and close it between two steps (never during one)."""

        def unhook() -> Worker:
            with self._wake:
                worker = self._workers.pop(name)
            worker.close()
            return worker

        return self.call(unhook)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and wait for its result;
        directly when the loop is not running."""
        if not self.running or threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        self._calls.append((fn, future))
        self.wake()
        return future.result()

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    @property
    def workers(self) -> dict[str, Worker]:
        return dict(self._workers)

    # -- life cycle ----------------------------------------------------------
    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._run_calls()
        for worker in list(self._workers.values()):
            worker.close()

    def wake(self) -> None:
        """Called by submitters (any thread) after queueing work."""
        with self._wake:
            self._pending_wake = True
            self._wake.notify_all()

    # -- the loop ------------------------------------------------------------
    def pick(self, now: float) -> Worker | None:
        best, best_key = None, None
        for worker in list(self._workers.values()):
            key = worker.urgency(now)
            if key is not None:
                key = key.for_policy(self.policy)
            if key is not None and (best_key is None or key > best_key):
                best, best_key = worker, key
        return best

    def _sleep_time(self, now: float) -> float | None:
        times = [t for w in list(self._workers.values()) if (t := w.next_wakeup(now)) is not None]
        return max(0.0, min(times) - now) if times else None

    def run_once(self) -> bool:
        """Step the most urgent worker; False when none had runnable work."""
        self._run_calls()
        worker = self.pick(time.monotonic())
        if worker is None:
            return False
        started = time.perf_counter()
        with batched():  # the step's outputs wake each event loop once
            worker.step()
        self.busy_seconds += time.perf_counter() - started
        self.steps += 1
        return True

    def run_until(self, finished: Callable[[], bool]) -> None:
        """Step in the calling thread until ``finished()`` (the loop thread is not running)."""
        while not finished():
            if not self.run_once():
                wait = self._sleep_time(time.monotonic())
                time.sleep(min(wait if wait is not None else 0.001, 0.01))

    def _run(self) -> None:
        trim_at: float | None = None  # when to trim the heap if still idle (after work)
        while not self._stop:
            try:
                if self.run_once():
                    trim_at = -1.0  # worked: trim once the loop has been idle a while
                    continue
            except BaseException as exc:  # a worker bug: log it, keep serving others
                self.last_error = exc
                log.exception("engine step failed")
                continue
            now = time.monotonic()
            if trim_at is not None and trim_at < 0:
                trim_at = now + IDLE_TRIM_S
            elif trim_at is not None and now >= trim_at:
                self.trim()
                trim_at = None
                continue
            with self._wake:
                if self._stop:
                    break
                if not self._pending_wake:
                    wait = self._sleep_time(now)
                    if trim_at is not None:
                        wait = trim_at - now if wait is None else min(wait, trim_at - now)
                    self._wake.wait(wait)
                self._pending_wake = False

    def trim(self) -> None:
        """After a burst, hand the heap's free memory back: glibc keeps what the steps
        freed (activations, logits, tokenizer and detokenizer work), so an idle server, or
        a process after an offline batch, would otherwise sit at its busiest size."""
        trim_heap()
        self.trims += 1
