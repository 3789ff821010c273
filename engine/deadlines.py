"""A request's deadline as the engine sees it, and the order workers serve work in.

A deadline is an absolute **wall-clock** time (``time.time()`` epoch seconds), not a
``time.monotonic()`` reading: requests cross process boundaries (the Ray client pickles
them to replicas), and two processes' monotonic clocks share no origin. Wall clocks do,
to within what NTP keeps them (milliseconds); the remaining budget at any point is
``Deadline.remaining()``, so nothing needs a second field that would drift from it.

The order of waiting work (``rank``, smallest first), under ``EngineConfig.scheduling``:

- ``deadline`` (the default): earliest deadline first; among equal deadlines (two nodes
  of one request share theirs) the deeper node in its DAG, then the older request.
  Work without a deadline goes after all work with one, in the ``graph`` order.
- ``graph``: deeper first, then older (deadlines only drop work, never reorder it).
- ``fifo``: older first.

Running decodes are never reordered or starved by this: a scheduler serves every
running sequence before it admits a waiting one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

POLICIES: tuple[str, ...] = ("deadline", "graph", "fifo")


@dataclass(frozen=True)
class Deadline:
    """When a request's answer stops being useful, and what to do with work past it.

    at: wall-clock epoch seconds. drop: past ``at`` the engine drops the work and frees
    its memory (a graph's ``on_deadline: drop``); False finishes it late (``finish``).
    """

    at: float
    drop: bool = True

    @classmethod
    def within(cls, seconds: float, drop: bool = True) -> Deadline:
        return cls(time.time() + seconds, drop)

    def remaining(self, now: float | None = None) -> float:
        """Seconds left (negative once passed)."""
        return self.at - (time.time() if now is None else now)

    def passed(self, now: float | None = None) -> bool:
        return self.remaining(now) <= 0


@dataclass(frozen=True)
class Priority:
    """What the graph executor tells the engine about one item.

    depth: the node's depth in its request's DAG (0 = a root node). Deeper work is
    closer to a response, so it goes first.
    arrival: when the item's *request* arrived (wall-clock seconds, like deadlines, so that
    requests that entered on different hosts of a cluster compare): older goes first.
    deadline: the request's deadline (wall clock) and whether to drop work past it;
    how it combines with depth and arrival is ``rank``.
    """

    depth: int = 0
    arrival: float = field(default_factory=time.time)
    deadline: Deadline | None = None


def tightest(
    within: float | None = None, at: float | None = None, drop: bool = True
) -> Deadline | None:
    """The earlier of a time limit (seconds from now) and an absolute deadline (epoch
    seconds); None when neither is given."""
    times = [t for t in (None if within is None else time.time() + within, at) if t is not None]
    return Deadline(min(times), drop) if times else None


def due(priority: Priority) -> float:
    """The deadline's epoch seconds; work without one is due never (+inf)."""
    return priority.deadline.at if priority.deadline is not None else math.inf


def expired(priority: Priority, now: float) -> bool:
    """The work's deadline has passed and its policy says drop (``now``: time.time())."""
    deadline = priority.deadline
    return deadline is not None and deadline.drop and now >= deadline.at


def rank(priority: Priority, policy: str = "deadline") -> tuple[float, int, float]:
    """The sort key of waiting work, smallest first (see the module docstring)."""
    return (
        due(priority) if policy == "deadline" else 0.0,
        -priority.depth if policy != "fifo" else 0,
        priority.arrival,
    )
