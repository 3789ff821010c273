"""Admission by capacity: refuse early what could only be answered late.

A fixed in-flight cap alone lets a burst queue until its requests time out (200
concurrent runs of a graph queued ~45 s and most ended in 504). So each graph also
measures how many requests it completes per second *while busy* (its service rate)
and a new request is refused at once, with Retry-After, when the ones already in
flight would take longer than its time limit to drain:

    expected wait = in flight / service rate  >  share x limit  →  429

``limit`` is the graph's ``timeout`` (else ``ServerConfig.max_queue_wait_s``). The
rate is measured over busy time only, so a quiet period does not make it look slow,
and it decays (``HALF_LIFE_S``) so it follows a change of load or of models. Until
``MIN_SAMPLES`` requests have finished, only the in-flight cap applies.
"""

from __future__ import annotations

import math
import time

HALF_LIFE_S = 10.0  # busy seconds after which old completions count half
MIN_SAMPLES = 8  # completions before the estimate is trusted
SHARE = 0.8  # of the time limit the queue may fill: the rest is the request's own run


class ServiceRate:
    """Requests completed per busy second, decayed; ``busy`` counts only time with at
    least one request in flight. Event-loop only (no locks)."""

    def __init__(self) -> None:
        self.completed = 0.0  # decayed count
        self.busy = 0.0  # decayed busy seconds
        self.samples = 0
        self._inflight = 0
        self._mark = time.monotonic()

    def _advance(self) -> None:
        now = time.monotonic()
        if self._inflight > 0:
            elapsed = now - self._mark
            decay = 0.5 ** (elapsed / HALF_LIFE_S)
            self.completed *= decay
            self.busy = self.busy * decay + elapsed
        self._mark = now

    def started(self) -> None:
        self._advance()
        self._inflight += 1

    def ended(self) -> None:
        """A request left (answered, failed, refused after admission, or its client left)."""
        self._advance()
        self._inflight = max(0, self._inflight - 1)

    def completed_one(self) -> None:
        """A request ran to its result: only these measure the rate (a 422 is no work)."""
        self._advance()
        self.completed += 1.0
        self.samples += 1

    @property
    def per_second(self) -> float | None:
        if self.samples < MIN_SAMPLES or self.busy <= 0:
            return None
        return self.completed / self.busy

    def expected_wait(self, inflight: int) -> float | None:
        """Seconds until ``inflight`` requests drain at the measured rate (None: unknown)."""
        rate = self.per_second
        return inflight / rate if rate else None


def overloaded(rate: ServiceRate, inflight: int, limit_s: float) -> int | None:
    """Retry-After seconds when a new request should be refused, else None."""
    wait = rate.expected_wait(inflight)
    budget = SHARE * limit_s
    if wait is None or wait <= budget:
        return None
    return max(1, math.ceil(wait - budget))
