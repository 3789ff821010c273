import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trae_groups.engine.errors import EngineError
from trae_groups.engine.memory_pool import KVLayout, MemoryPool


def test_allocate_and_release_return_every_page():
    pool = MemoryPool(8, 1024)
    pages = pool.allocate("a", 5)
    assert len(set(pages)) == 5 and pool.num_free == 3
    assert pool.allocate("b", 4) is None  # no room is an answer, not an error
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    pool.release(pages)
    assert pool.num_free == 8 and pool.stats().used_pages == 0


def test_double_release_is_refused():
    pool = MemoryPool(4, 1024)
    pages = pool.allocate("a", 1)
    pool.release(pages)
    with pytest.raises(EngineError):
        pool.release(pages)


def test_two_layouts_view_the_same_bytes_without_copy():
    pool = MemoryPool(4, 4096)
    small = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 256 B/token
    big = KVLayout(num_layers=4, num_kv_heads=4, head_dim=16, dtype=torch.float16)  # 1024 B/token
    a, b = pool.kv_view(small), pool.kv_view(big)
    assert a.tokens_per_page == 16 and b.tokens_per_page == 4
    assert a.k[0].shape == (4, 16, 2, 8) and b.v[3].shape == (4, 4, 4, 16)
    base = pool.buffer.data_ptr()
    assert a.k[0].data_ptr() == base and b.k[0].data_ptr() == base
    # writing through one model's view changes the shared buffer (page 2, first bytes)
    a.k[0][2, 0, 0, 0] = 1.5
    assert pool.buffer[2, :4].view(torch.float32).item() == 1.5


def test_page_too_small_for_one_token_is_a_clear_error():
    pool = MemoryPool(2, 64)
    with pytest.raises(ValueError, match="bytes"):
        pool.kv_view(KVLayout(4, 4, 16, torch.float32))


def test_prefix_cache_shares_and_evicts_lru():
    pool = MemoryPool(3, 1024)
    p1, p2 = pool.allocate("m", 2)
    pool.publish(p1, "k1")
    pool.publish(p2, "k2")
    pool.release([p1, p2])
    stats = pool.stats()
    assert stats.cached_pages == 2 and stats.used_pages == 0 and pool.num_free == 3
    assert pool.lookup("k1") == p1 and pool.refcount(p1) == 1  # hit: shared again
    assert pool.lookup("nope") is None
    assert pool.stats().prefix_hit_rate == 0.5
    # two new pages: the free one, then the least recently used cached one (k2)
    new = pool.allocate("m", 2)
    assert p2 in new and pool.lookup("k2") is None and pool.evictions == 1
    pool.release(new + [p1])
    pool.clear_cache()
    assert pool.stats().free_pages == 3


def test_usage_is_accounted_per_owner():
    pool = MemoryPool(10, 1024)
    a = pool.allocate("llm-a", 3)
    b = pool.allocate("llm-b", 2)
    pool.share(a[0])
    stats = pool.stats()
    assert stats.pages_by_owner == {"llm-a": 3, "llm-b": 2}
    assert stats.usage == 0.5
    pool.release(a + b + [a[0]])
    assert pool.stats().pages_by_owner == {}


def test_from_size_and_bad_sizes():
    assert MemoryPool.from_size(1 << 20, 4096).num_pages == 256
    with pytest.raises(ValueError):
        MemoryPool(0, 4096)
    with pytest.raises(ValueError):
        MemoryPool(4, 100)


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "release", "share", "publish", "lookup"]), st.integers(0, 7)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_never_leak_or_double_free(sequence):
    pool = MemoryPool(6, 1024)
    held: list[int] = []  # one entry per reference we own
    for op, n in sequence:
        if op == "alloc":
            pages = pool.allocate("m", n % 4 + 1)
            if pages is not None:
                held.extend(pages)
        elif op == "release" and held:
            pool.release([held.pop(n % len(held))])
        elif op == "share" and held:
            page = held[n % len(held)]
            pool.share(page)
            held.append(page)
        elif op == "publish" and held:
            pool.publish(held[n % len(held)], f"key{n}")
        elif op == "lookup":
            page = pool.lookup(f"key{n}")
            if page is not None:
                held.append(page)
        assert pool.stats().used_pages == len(set(held))
        for page in set(held):
            assert pool.refcount(page) == held.count(page)
    pool.release(held)
    pool.clear_cache()
    assert pool.stats().free_pages == 6


def test_allocate_zero_clears_exactly_the_pages_it_hands_out():
    # runs of consecutive ids and lone pages alike (the free list after frees out of order)
    pool = MemoryPool(num_pages=12, page_bytes=64)
    taken = pool.allocate("a", 12)
    pool.buffer.fill_(7)
    for page in (9, 2, 3, 4, 7, 0):
        pool.release([page])
    got = pool.allocate("b", 6, zero=True)
    assert sorted(got) == [0, 2, 3, 4, 7, 9]
    assert not pool.buffer[got].any()
    others = [p for p in taken if p not in got]
    assert bool((pool.buffer[others] == 7).all())
