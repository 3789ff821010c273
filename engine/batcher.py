"""Dynamic batching for encoders: when to run a batch, and which items go in it.

Pure logic with explicit clocks (no threads, no torch), in the spirit of Triton's
dynamic batcher: a batch runs as soon as ``preferred_batch_size`` items wait, or
when the oldest item has waited ``timeout_ms`` (its queue-delay budget). A batch
holds at most ``max_batch_size`` items, always includes the oldest (or, given a
``first`` key, the item with the smallest key: the encoder worker's earliest
deadline, the oldest among equals), and is filled
with items of similar length (length bucketing) so padding stays small: an item is
left for a later batch when taking it would make the padded token count exceed
``max_padding_ratio`` times the real one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Batchable(Protocol):
    queued_at: float  # monotonic seconds when the item entered the queue
    length: int  # its (estimated) token count


T = TypeVar("T", bound=Batchable)


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 32
    timeout_ms: float = 5.0
    preferred_batch_size: int = 16
    max_padding_ratio: float = 2.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if not 1 <= self.preferred_batch_size <= self.max_batch_size:
            raise ValueError("preferred_batch_size must be in [1, max_batch_size]")
        if self.timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")
        if self.max_padding_ratio < 1:
            raise ValueError("max_padding_ratio must be >= 1")

    @property
    def timeout(self) -> float:
        return self.timeout_ms / 1000.0


class DynamicBatcher(Generic[T]):
    def __init__(self, config: BatcherConfig | None = None, **kwargs: float):
        self.config = config or BatcherConfig(**kwargs)  # type: ignore[arg-type]
        self._items: dict[int, T] = {}  # insertion order = queue order
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items.values()))

    def add(self, item: T) -> None:
        self._items[next(self._seq)] = item

    def put_back(self, items: Iterable[T]) -> None:
        """Return items taken but not run; queue order follows ``queued_at``."""
        merged = sorted([*self._items.values(), *items], key=lambda it: it.queued_at)
        self._items = {next(self._seq): it for it in merged}

    def remove(self, predicate: Callable[[T], bool]) -> list[T]:
        gone = [k for k, it in self._items.items() if predicate(it)]
        return [self._items.pop(k) for k in gone]

    # -- when ------------------------------------------------------------------------
    def oldest(self) -> T | None:
        return next(iter(self._items.values()), None)

    def overdue(self, now: float) -> bool:
        deadline = self.next_deadline()
        return deadline is not None and now >= deadline

    def ready(self, now: float) -> bool:
        return len(self._items) >= self.config.preferred_batch_size or self.overdue(now)

    def next_deadline(self) -> float | None:
        first = self.oldest()
        return None if first is None else first.queued_at + self.config.timeout

    # -- which -----------------------------------------------------------------------
    def take(
        self,
        now: float,
        max_items: int | None = None,
        first: Callable[[T], float] | None = None,
    ) -> list[T]:
        """Remove and return the next batch (queue order); empty when idle. The batch
        is built around the oldest item, or the one with the smallest ``first(item)``."""
        limit = min(self.config.max_batch_size, max_items or self.config.max_batch_size)
        if not self._items or limit < 1:
            return []

        def urgency(k: int) -> tuple[float, int]:  # smaller first; keys grow with queue order
            return (first(self._items[k]) if first is not None else 0.0, k)

        keys = self._pick(limit, urgency)
        return [self._items.pop(k) for k in sorted(keys)]

    def _pick(self, limit: int, urgency: Callable[[int], tuple[float, int]]) -> list[int]:
        """Grow a window over items sorted by length, from the anchor item, one
        neighbour at a time (the one that adds fewer padded tokens), while padding
        stays within the ratio."""
        order = sorted(self._items, key=lambda k: (self._items[k].length, k))
        at = order.index(min(self._items, key=urgency))
        lo, hi = at, at + 1  # window [lo, hi)
        real = _len(self._items[order[at]])
        longest = real
        while hi - lo < limit:
            options = []
            if lo > 0:
                options.append((lo - 1, lo - 1, hi))
            if hi < len(order):
                options.append((hi, lo, hi + 1))
            best = None
            for index, new_lo, new_hi in options:
                n = _len(self._items[order[index]])
                padded = (new_hi - new_lo) * max(longest, n)
                fits = padded <= self.config.max_padding_ratio * (real + n)
                if fits and (best is None or padded < best[0]):
                    best = (padded, new_lo, new_hi, n)
            if best is None:
                break
            _, lo, hi, n = best
            real += n
            longest = max(longest, n)
        return self._most_urgent_at_edges(order, lo, hi, urgency)

    def _most_urgent_at_edges(
        self, order: list[int], lo: int, hi: int, urgency: Callable[[int], tuple[float, int]]
    ) -> list[int]:
        """Same window of lengths, but items tied at its edge lengths are taken most
        urgent first (without a ``first`` key: oldest first)."""
        short, long_ = _len(self._items[order[lo]]), _len(self._items[order[hi - 1]])
        picked = [k for k in order[lo:hi] if short < _len(self._items[k]) < long_]
        for edge in sorted({short, long_}):
            count = sum(1 for k in order[lo:hi] if _len(self._items[k]) == edge)
            same = sorted((k for k in self._items if _len(self._items[k]) == edge), key=urgency)
            picked += same[:count]
        return picked


def _len(item: Batchable) -> int:
    return max(1, int(item.length))
