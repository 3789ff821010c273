"""The paged attention reference against dense per-sequence attention."""

import pytest
import torch

from trae_groups.kernels import PagedBatch, naive_attention, paged_attention, store_kv


def make_case(q_lens, ctx_lens, heads, kv_heads, page=4, dim=8, seed=0, num_pages=64):
    """Sequences with `ctx - q` cached tokens already in pages and `q` new ones."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_pages, page, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_pages, generator=g).tolist()  # scattered pages
    keys, values, tables, slots, queries, new_k, new_v = [], [], [], [], [], [], []
    for q_len, ctx in zip(q_lens, ctx_lens, strict=True):
        k = torch.randn(ctx, kv_heads, dim, generator=g)
        v = torch.randn(ctx, kv_heads, dim, generator=g)
        pages = [free.pop() for _ in range(-(-ctx // page))]
        for pos in range(ctx - q_len):  # the cached part
            k_cache[pages[pos // page], pos % page] = k[pos]
            v_cache[pages[pos // page], pos % page] = v[pos]
        slots += [pages[p // page] * page + p % page for p in range(ctx - q_len, ctx)]
        keys.append(k)
        values.append(v)
        tables.append(pages)
        queries.append(torch.randn(q_len, heads, dim, generator=g))
        new_k.append(k[ctx - q_len :])
        new_v.append(v[ctx - q_len :])
    width = max(len(t) for t in tables)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    batch = PagedBatch(
        slot_mapping=torch.tensor(slots),
        query_starts=starts,
        context_lens=list(ctx_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=sum(1 for q in q_lens if q == 1),
        tokens_per_page=page,
        context_lens_t=torch.tensor(ctx_lens),
    )
    return (
        torch.cat(queries),
        torch.cat(new_k),
        torch.cat(new_v),
        k_cache,
        v_cache,
        batch,
        keys,
        values,
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_decode_and_prefill_matches_dense(heads, kv_heads, window):
    # decodes first (q=1) at page boundaries and inside pages; then a fresh prefill,
    # a chunk continuing over cached context, and a one-page prompt
    q_lens = [1, 1, 1, 7, 5, 4]
    ctx_lens = [1, 4, 13, 7, 11, 4]
    q, k, v, kc, vc, batch, keys, values = make_case(q_lens, ctx_lens, heads, kv_heads)
    store_kv(k, v, kc, vc, batch.slot_mapping)
    scale = 8**-0.5
    got = paged_attention(q, k, v, kc, vc, batch, scale, window)
    want = naive_attention(q, keys, values, batch.query_starts, scale, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_random_shapes_long_contexts(seed):
    g = torch.Generator().manual_seed(seed)
    n_dec, n_pre = (
        int(torch.randint(0, 6, (1,), generator=g)),
        int(torch.randint(1, 4, (1,), generator=g)),
    )
    ctx = torch.randint(1, 600, (n_dec + n_pre,), generator=g).tolist()
    q_lens = [1] * n_dec + [int(torch.randint(1, c + 1, (1,), generator=g)) for c in ctx[n_dec:]]
    q_lens = [
        max(q, 2) if i >= n_dec and c >= 2 else q
        for i, (q, c) in enumerate(zip(q_lens, ctx, strict=True))
    ]
    q, k, v, kc, vc, batch, keys, values = make_case(
        q_lens, ctx, 8, 2, page=16, dim=16, seed=seed, num_pages=400
    )
    batch.num_decodes = n_dec
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, 0.25)
    want = naive_attention(q, keys, values, batch.query_starts, 0.25)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_store_kv_writes_only_the_mapped_slots():
    kc = torch.zeros(3, 4, 1, 2)
    vc = torch.zeros_like(kc)
    k = torch.arange(1, 7, dtype=torch.float32).view(3, 1, 2)
    store_kv(k, -k, kc, vc, torch.tensor([5, 6, 0]))
    assert kc[1, 1].tolist() == [[1.0, 2.0]] and kc[1, 2].tolist() == [[3.0, 4.0]]
    assert kc[0, 0].tolist() == [[5.0, 6.0]] and vc[0, 0].tolist() == [[-5.0, -6.0]]
    assert kc.count_nonzero() == 6


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(
    "q_lens,ctx_lens,padded",
    [
        ([1, 1, 6, 5, 6, 6], [9, 3, 8, 12, 10, 6], True),  # fresh and cached chunks, alike
        ([1, 2, 3, 3], [7, 4, 7, 5], True),  # chunks from 2 rows; padding rows see key 0
        ([1, 3, 3, 40], [5, 3, 3, 40], False),  # one long chunk: padding would triple the work
    ],
)
def test_prefill_chunks_run_padded_together_or_one_by_one(q_lens, ctx_lens, padded, window):
    q, k, v, kc, vc, batch, keys, values = make_case(q_lens, ctx_lens, 4, 2, num_pages=96)
    kc.fill_(1e4)  # slots no sequence owns must never reach an output (finite: this
    vc.fill_(1e4)  # backend masks whole pages, where NaN would poison the sum)
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        cached = torch.arange(ctx - q_len)
        pages = batch.block_tables[s, cached // 4]
        kc[pages, cached % 4] = keys[s][: ctx - q_len]
        vc[pages, cached % 4] = values[s][: ctx - q_len]
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, 8**-0.5, window)
    assert (batch.prefill_plan(window) is not None) == padded
    want = naive_attention(q, keys, values, batch.query_starts, 8**-0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_long_contexts_are_not_padded_together(monkeypatch):
    from trae_groups.kernels import attention

    q_lens, ctx_lens = [1, 6, 5, 6], [9, 8, 12, 10]  # padded together under the default bound
    monkeypatch.setattr(attention, "MAX_PADDED_KEYS", 3 * 12 - 1)  # 3 chunks x 12 keys
    q, k, v, kc, vc, batch, keys, values = make_case(q_lens, ctx_lens, 4, 2, num_pages=96)
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, 8**-0.5)
    assert batch.prefill_plan(None) is None
    monkeypatch.setattr(attention, "MAX_PADDED_KEYS", 3 * 12)
    batch._masks.clear()
    assert batch.prefill_plan(None) is not None
    want = naive_attention(q, keys, values, batch.query_starts, 8**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rows_at_picks_all_rows_entries():
    """The rows a last layer keeps (rows_at) attend as all_rows says those rows do."""
    *_, batch, _, _ = make_case([1, 5, 3, 1], [7, 5, 40, 9], 4, 2)
    seqs, positions = batch.all_rows()
    pick = torch.tensor([0, 2, 5, 6, 8, 9])
    got_seqs, got_positions = batch.rows_at(pick)
    assert torch.equal(got_seqs, seqs[pick]) and torch.equal(got_positions, positions[pick])
    assert batch.rows_at(pick[:0])[0].numel() == 0
