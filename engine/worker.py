"""The small interface the engine loop (and, through it, the graph executor) sees.

A worker owns one model: it queues items from any thread, and runs one batch per
``step()`` on the engine thread. The loop asks every worker how urgent its work is
and steps the most urgent one; see ``engine/loop.py`` for the policy.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trae_groups.engine.protocol import ModelStats


@dataclass(frozen=True)
class Priority:
    """What the graph executor tells the engine about one item.

    depth: the node's depth in its request's DAG (0 = a root node). Deeper work is
    closer to a response, so it goes first.
    arrival: when the item's *request* arrived (monotonic seconds): older goes first.
    """

    depth: int = 0
    arrival: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, order=True)
class Urgency:
    """How urgent a worker's pending work is; the loop steps the largest.

    overdue: some item waited past its queue-delay budget.
    depth, neg_arrival: of the most urgent item (deeper, then older, first).
    """

    overdue: bool
    depth: int
    neg_arrival: float


class Worker(ABC):
    """One model's queue and batch runner, driven by the engine loop."""

    name: str

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
        from trae_groups.engine.protocol import ModelStats  # the protocol imports Priority

        return ModelStats(self.name, "encoder")

    @abstractmethod
    def close(self) -> None:
        """Engine stopping: fail every pending item with EngineStopped."""
