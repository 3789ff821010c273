"""DynamicBatcher: when a batch runs and which items go in it, on explicit clocks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trae_groups.engine.batcher import BatcherConfig, DynamicBatcher


@dataclass(eq=False)
class Item:
    name: str
    queued_at: float
    length: int = 10


def batcher(**kwargs) -> DynamicBatcher[Item]:
    return DynamicBatcher(BatcherConfig(**kwargs))


def names(items: list[Item]) -> list[str]:
    return [it.name for it in items]


class TestWhen:
    def test_empty_is_never_ready(self):
        b = batcher()
        assert not b.ready(1e9)
        assert b.next_deadline() is None
        assert b.take(0.0) == []

    def test_gathers_until_preferred_size(self):
        b = batcher(preferred_batch_size=3, timeout_ms=10)
        b.add(Item("a", 0.0))
        b.add(Item("b", 0.001))
        assert not b.ready(0.002)
        b.add(Item("c", 0.002))
        assert b.ready(0.002)

    def test_oldest_overdue_at_its_deadline(self):
        b = batcher(preferred_batch_size=8, timeout_ms=10)
        b.add(Item("a", 1.0))
        b.add(Item("b", 1.005))
        assert b.next_deadline() == pytest.approx(1.010)
        assert not b.ready(1.0099)
        assert b.ready(1.010)
        assert b.overdue(1.010)

    def test_zero_timeout_runs_at_once(self):
        b = batcher(preferred_batch_size=8, timeout_ms=0)
        b.add(Item("a", 5.0))
        assert b.ready(5.0)


class TestWhich:
    def test_caps_at_max_batch_size_oldest_first(self):
        b = batcher(max_batch_size=4, preferred_batch_size=2)
        for i in range(10):
            b.add(Item(str(i), i * 0.001))
        assert names(b.take(1.0)) == ["0", "1", "2", "3"]
        assert names(b.take(1.0)) == ["4", "5", "6", "7"]
        assert names(b.take(1.0)) == ["8", "9"]
        assert len(b) == 0

    def test_max_items_limits_one_take(self):
        b = batcher(max_batch_size=8, preferred_batch_size=2)
        for i in range(5):
            b.add(Item(str(i), i))
        assert names(b.take(10, max_items=2)) == ["0", "1"]

    def test_length_bucketing_leaves_outliers_for_later(self):
        b = batcher(max_batch_size=8, preferred_batch_size=2)
        for name, length in [("short", 10), ("long1", 500), ("s2", 11), ("s3", 12), ("long2", 480)]:
            b.add(Item(name, len(b) * 0.001, length))
        assert names(b.take(1.0)) == ["short", "s2", "s3"]
        assert names(b.take(1.0)) == ["long1", "long2"]

    def test_oldest_always_included_even_if_an_outlier(self):
        b = batcher(max_batch_size=4, preferred_batch_size=2, max_padding_ratio=1.5)
        b.add(Item("old-long", 0.0, 400))
        for i in range(6):
            b.add(Item(f"s{i}", 0.001 * (i + 1), 8))
        assert names(b.take(1.0)) == ["old-long"]
        assert names(b.take(1.0)) == ["s0", "s1", "s2", "s3"]

    def test_ties_in_length_go_oldest_first(self):
        b = batcher(max_batch_size=2, preferred_batch_size=2)  # ratio 2: 400 + one 8 fits
        b.add(Item("old-long", 0.0, 400))
        for i in range(3):
            b.add(Item(f"s{i}", 0.001 * (i + 1), 8))
        assert names(b.take(1.0)) == ["old-long", "s0"]

    def test_similar_lengths_fill_the_batch(self):
        b = batcher(max_batch_size=3, preferred_batch_size=2)
        for i, length in enumerate([20, 90, 21, 95, 19, 22]):
            b.add(Item(f"i{i}", i * 0.001, length))
        assert sorted(it.length for it in b.take(1.0)) == [19, 20, 21]

    def test_put_back_restores_queue_order(self):
        b = batcher(max_batch_size=2, preferred_batch_size=1)
        for i in range(4):
            b.add(Item(str(i), float(i)))
        taken = b.take(10.0)
        b.put_back(taken)
        assert names(b.take(10.0)) == ["0", "1"]
        assert b.oldest().name == "2"

    def test_remove_by_predicate(self):
        b = batcher()
        for i in range(4):
            b.add(Item(f"r{i % 2}", float(i)))
        gone = b.remove(lambda it: it.name == "r1")
        assert names(gone) == ["r1", "r1"]
        assert names(list(b)) == ["r0", "r0"]


class TestConfig:
    @pytest.mark.parametrize(
        "kwargs",
        [
            {"max_batch_size": 0},
            {"max_batch_size": 4, "preferred_batch_size": 8},
            {"preferred_batch_size": 0},
            {"timeout_ms": -1},
            {"max_padding_ratio": 0.5},
        ],
    )
    def test_rejects_bad_values(self, kwargs):
        with pytest.raises(ValueError):
            BatcherConfig(**kwargs)

    def test_keyword_shortcut(self):
        b = DynamicBatcher(max_batch_size=4, preferred_batch_size=2, timeout_ms=1.0)
        assert b.config.max_batch_size == 4


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 512), min_size=1, max_size=60),
    max_batch=st.integers(1, 16),
    ratio=st.floats(1.0, 4.0),
)
def test_every_item_runs_once_and_batches_respect_limits(lengths, max_batch, ratio):
    b = batcher(max_batch_size=max_batch, preferred_batch_size=1, max_padding_ratio=ratio)
    items = [Item(str(i), i * 1e-3, n) for i, n in enumerate(lengths)]
    for it in items:
        b.add(it)
    seen: list[Item] = []
    while len(b):
        oldest = b.oldest()
        batch = b.take(100.0)
        assert 1 <= len(batch) <= max_batch
        assert batch[0] is oldest
        assert [it.queued_at for it in batch] == sorted(it.queued_at for it in batch)
        if len(batch) > 1:
            padded = len(batch) * max(it.length for it in batch)
            assert padded <= ratio * sum(it.length for it in batch) + 1e-9
        seen += batch
    assert sorted(seen, key=lambda it: it.queued_at) == items
