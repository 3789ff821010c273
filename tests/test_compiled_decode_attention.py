"""The compiled path's decode attention op against the torch reference kernel: the same
outputs and the same pages written, with padding rows, GQA, sliding windows and a layer's
strided view of a page-major pool."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_kernels import make_case

from trae_groups.kernels import cpu_native, paged_attention, store_kv
from trae_groups.kernels.compiled_decode_attention import decode_mask


def _strided(cache: torch.Tensor) -> torch.Tensor:
    """The same values as one layer's K of a pool laid out [pages, 2 (k/v), page, heads, dim]."""
    pool = torch.zeros(cache.shape[0], 2, *cache.shape[1:], dtype=cache.dtype)
    pool[:, 0] = cache
    return pool[:, 0]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (4, 2, 5)])
def test_matches_the_reference_with_padding_rows(dtype, heads, kv_heads, window, native):
    """The op takes the path the eager step takes (native kernels where they are built,
    the torch reference otherwise), so the two agree exactly either way."""
    with contextlib.nullcontext() if native else cpu_native.turned_off():
        _check_against_reference(dtype, heads, kv_heads, window)


def _check_against_reference(dtype, heads, kv_heads, window):
    ctx_lens, pad = [1, 4, 13, 30], 3
    q, k, v, kc, vc, batch, _, _ = make_case([1] * 4, ctx_lens, heads, kv_heads)
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(k, v, ref_k, ref_v, batch.slot_mapping)
    want = paged_attention(q, k, v, ref_k, ref_v, batch, 8**-0.5, window)

    # padded as CompiledDecode pads: slot -1, context 0, table rows of page 0
    slots = torch.cat([batch.slot_mapping, torch.full((pad,), -1)])
    tables = torch.cat([batch.block_tables, torch.zeros(pad, batch.block_tables.shape[1])]).long()
    lens = torch.tensor(ctx_lens + [0] * pad)
    page = kc.shape[1]
    our_k, our_v = _strided(kc), _strided(vc)
    mask = decode_mask(lens, tables.shape[1] * page, window)
    got = torch.ops.trae.compiled_decode_attention(
        torch.cat([q, torch.randn(pad, *q.shape[1:]).to(dtype)]),
        torch.cat([k, torch.randn(pad, *k.shape[1:]).to(dtype)]),
        torch.cat([v, torch.randn(pad, *v.shape[1:]).to(dtype)]),
        our_k,
        our_v,
        slots // page,
        slots % page,
        tables,
        mask,
        lens,
        window or 0,
        torch.tensor([len(ctx_lens)]),
        8**-0.5,
    )
    torch.testing.assert_close(got[: len(ctx_lens)], want, atol=0, rtol=0)
    assert not got[len(ctx_lens) :].any()  # padding rows: zeros, and nothing stored
    assert torch.equal(our_k, ref_k) and torch.equal(our_v, ref_v)


def test_decode_mask_window_and_padding():
    mask = decode_mask(torch.tensor([3, 6, 0]), 8, 4)[:, 0, 0]
    assert mask.tolist() == [
        [True, True, True] + [False] * 5,
        [False, False, True, True, True, True, False, False],
        [False] * 8,
    ]
