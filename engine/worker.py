"""The small interface the engine loop (and, through it, the graph executor) sees.

A worker owns one model: it queues items from any thread, and runs one batch per
``step()`` on the engine thread. The loop asks every worker how urgent its work is
and steps the most urgent one; see ``engine/loop.py`` for the policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from trae_groups.engine.deadlines import Priority, due
from trae_groups.engine.protocol import ModelStats


@dataclass(frozen=True, order=True)
class Urgency:
    """How urgent a worker's pending work is; the loop steps the largest.

    overdue: some item waited past its queue-delay budget.
    neg_due, depth, neg_arrival: of the most urgent item (earlier deadline, then deeper,
    then older, first; ``neg_due`` is -inf without a deadline). The loop zeroes what
    its policy ignores (``for_policy``).
    """

    overdue: bool
    neg_due: float
    depth: int
    neg_arrival: float

    @classmethod
    def of(cls, overdue: bool, priority: Priority) -> Urgency:
        return cls(overdue, -due(priority), priority.depth, -priority.arrival)

    def for_policy(self, policy: str) -> Urgency:
        """The key as ``policy`` sees it (engine/deadlines.py names the policies)."""
        if policy == "deadline":
            return self
        return Urgency(self.overdue, 0.0, self.depth if policy == "graph" else 0, self.neg_arrival)


class Worker(ABC):
    """One model's queue and batch runner, driven by the engine loop."""

    name: str
    policy: str = "deadline"  # the loop's scheduling policy; EngineLoop.add_worker sets it

    @abstractmethod
    def urgency(self, now: float) -> Urgency | None:
        """None when nothing should run now (idle, or still gathering a batch)."""

    @abstractmethod
    def next_wakeup(self, now: float) -> float | None:
        """The monotonic time when a gathering batch becomes runnable, if any."""

    @abstractmethod
    def step(self) -> None:
        """Run one batch. Engine thread only; must not raise for a bad item
        (fail that item's future instead)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Thread-safe: drop every item of the request and free its memory."""

    def stats(self) -> dict:
        return {}

    def model_stats(self) -> ModelStats:
        """Typed stats for the layers above; workers with counters override it."""
        return ModelStats(self.name, "encoder")

    @abstractmethod
    def close(self) -> None:
        """Engine stopping: fail every pending item with EngineStopped."""
