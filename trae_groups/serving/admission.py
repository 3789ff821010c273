"""Admission by capacity and by deadline: refuse early what could only be answered late.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

HALF_LIFE_S = 10.0  # busy seconds after which old completions count half
MIN_SAMPLES = 8  # completions before the estimate is trusted
#: Of the time limit the queue may fill; the rest is the request's own run and slack for a
#: rate that drops under the burst itself (150 connections at once measured ~20% slower
#: than the bursts of 16 the rate was learned from: 3 of 150 timed out at 0.8).
SHARE = 0.7


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


# ---------------------------------------------------------------- by deadline
#
# A request whose deadline drops late work (``on_deadline: drop``) is refused at once,
# 503 with Retry-After and the estimate, when the estimate says it cannot make it:
#
#     estimate = max(critical path, requests in flight (this one too) / service rate)
#
# The critical path is the longest chain of the graph's nodes, each at its measured
# run time (a decayed mean of recent runs): no request answers faster. The second
# term is Little's law over every request in flight, not only those due earlier:
# deadline order decides who waits for a free slot, but the requests already running
# share every batch with this one (continuous batching is close to processor
# sharing), so all of them slow it. Until a graph has measured both, only what it
# has measured counts.

NODE_TIME_WEIGHT = 0.2  # weight of each new run in a node's decayed mean run time


class NodeTimes:
    """Each node's recent run time, seconds (decayed mean of ``NODE_TIME_WEIGHT``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def observe(self, node: str, seconds: float) -> None:
        old = self.seconds.get(node)
        self.seconds[node] = seconds if old is None else old + NODE_TIME_WEIGHT * (seconds - old)

    def critical_path(self, order: Sequence[str], parents: Callable[[str], Iterable[str]]) -> float:
        """The longest chain's run time through nodes in topological ``order``."""
        finish: dict[str, float] = {}
        for node in order:
            start = max((finish.get(p, 0.0) for p in parents(node)), default=0.0)
            finish[node] = start + self.seconds.get(node, 0.0)
        return max(finish.values(), default=0.0)


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot make its deadline, and when to retry."""

    estimate: float  # seconds the request would take
    left: float  # seconds to its deadline
    inflight: int  # requests in flight, this one included
    path: float  # the graph's critical path, seconds
    retry_after: int

    @property
    def reason(self) -> str:
        return (
            f"estimated {self.estimate:.2f} s (critical path {self.path:.2f} s, "
            f"{self.inflight} request(s) in flight) against {max(self.left, 0.0):.2f} s "
            "left to its deadline"
        )


def unreachable(rate: ServiceRate, inflight: int, path: float, left: float) -> Refusal | None:
    """A Refusal when the estimate (see above) passes the ``left`` seconds, else None."""
    queue = rate.expected_wait(inflight) or 0.0
    estimate = max(path, queue)
    if estimate <= left:
        return None
    return Refusal(estimate, left, inflight, path, max(1, math.ceil(estimate - max(left, 0.0))))
