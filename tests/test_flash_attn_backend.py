"""The flash-attn adapter: its layout rules and fallback here, its numbers on a GPU.

The layout rules and the fallback run anywhere (they are plain tensor metadata and the
reference path); comparisons against the reference need CUDA and flash_attn and skip
cleanly otherwise.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import make_case

from trae_groups.kernels import flash_attn_backend as fa
from trae_groups.kernels import naive_attention, paged_attention, store_kv

needs_flash = pytest.mark.skipif(
    not fa.available("cuda"), reason="needs CUDA and the flash_attn package"
)


def test_layout_rules():
    ok = torch.zeros(4, 256, 2, 64, dtype=torch.bfloat16)
    assert fa.layout_problem(ok) is None
    assert "multiple of 256" in fa.layout_problem(torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16))
    assert "float16/bfloat16" in fa.layout_problem(torch.zeros(4, 256, 2, 64))
    assert "head_dim" in fa.layout_problem(torch.zeros(4, 256, 2, 36, dtype=torch.half))
    strided = torch.zeros(4, 256, 2, 128, dtype=torch.bfloat16)[..., ::2]
    assert "last dimension" in fa.layout_problem(strided)
    # a pool-style view: page stride padded beyond tokens*heads*dim is fine
    pool = torch.zeros(4, 3 * 256 * 2 * 64 + 64, dtype=torch.bfloat16)
    view = pool[:, 256 * 2 * 64 : 2 * 256 * 2 * 64].view(4, 256, 2, 64)
    assert view.stride(0) != 256 * 2 * 64 and fa.layout_problem(view) is None
    # ... but not an unaligned one
    assert "aligned" in fa.layout_problem(pool[:, 4 : 4 + 256 * 2 * 64].view(4, 256, 2, 64))


def test_availability_follows_package_and_device():
    assert not fa.available("cpu")
    reason = fa.unsupported_reason(torch.zeros(4, 256, 2, 64, dtype=torch.bfloat16))
    assert reason is not None  # not installed, or a CPU tensor


def test_unsupported_layout_falls_back_to_a_correct_path():
    q, k, v, kc, vc, batch, keys, values = make_case([1, 1, 6], [5, 9, 6], 4, 2)
    fa.store_kv(k, v, kc, vc, batch.slot_mapping)
    got = fa.paged_attention(q, k, v, kc, vc, batch, 8**-0.5, 3)
    want = naive_attention(q, keys, values, batch.query_starts, 8**-0.5, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_flash
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pool", [False, True])
def test_matches_reference_on_gpu(window, dtype, pool):
    q_lens, ctx = [1, 1, 1, 300, 40], [1, 256, 700, 300, 600]
    q, k, v, kc, vc, batch, *_ = make_case(
        q_lens, ctx, 8, 2, page=256, dim=64, num_pages=sum(-(-c // 256) for c in ctx) + 2
    )
    dev = torch.device("cuda")
    q, k, v, kc, vc = (t.to(dev, dtype) for t in (q, k, v, kc, vc))
    batch.slot_mapping = batch.slot_mapping.to(dev)
    batch.block_tables = batch.block_tables.to(dev)
    batch.context_lens_t = batch.context_lens_t.to(dev)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    store_kv(k, v, ref_kc, ref_vc, batch.slot_mapping)
    want = paged_attention(q, k, v, ref_kc, ref_vc, batch, 0.125, window)
    if pool:  # the engine's layout: K and V of several layers share each padded page
        per = kc[0].numel()
        buf = torch.zeros(kc.shape[0], 4 * per + 64, dtype=dtype, device=dev)
        kc = buf[:, per : 2 * per].view(kc.shape).copy_(kc)
        vc = buf[:, 3 * per : 4 * per].view(vc.shape).copy_(vc)
    assert fa.supports(kc) and fa.supports(vc)
    fa.store_kv(k, v, kc, vc, batch.slot_mapping)
    got = fa.paged_attention(q, k, v, kc, vc, batch, 0.125, window)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
