"""The native CPU kernels (trae_kernels/cpu_paged.c) against the dense oracle and the torch
reference: decode attention over pages where they lie (GQA, sliding windows, contexts across
the kernel's key blocks, a layer's strided view of a page-major pool) and the K/V store."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_kernels import make_case

from trae_groups.kernels import cpu_amx, cpu_native, naive_attention, paged_attention, store_kv

pytestmark = pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler")


def _strided(cache: torch.Tensor) -> torch.Tensor:
    """The same values as one layer's K of a pool laid out [pages, 2 (k/v), page, heads, dim]."""
    pool = torch.zeros(cache.shape[0], 2, *cache.shape[1:], dtype=cache.dtype)
    pool[:, 0] = cache
    return pool[:, 0]


def test_built_where_a_compiler_is():
    assert cpu_native.library() is not None
    with cpu_native.turned_off():
        assert cpu_native.library() is None


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("strided", [False, True])
def test_decode_matches_dense_float32(heads, kv_heads, window, strided):
    # contexts inside one page, across pages and across the kernel's 64-key blocks
    ctx_lens = [1, 4, 13, 64, 65, 200]
    q, k, v, kc, vc, batch, keys, values = make_case(
        [1] * len(ctx_lens), ctx_lens, heads, kv_heads, page=16, dim=32, num_pages=64
    )
    if strided:
        kc, vc = _strided(kc), _strided(vc)
    assert cpu_native.supports(q, kc, vc)
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, 32**-0.5, window)
    want = naive_attention(q, keys, values, batch.query_starts, 32**-0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strided", [False, True])
# groups of 3 (a V row weighs 3 heads at once), 2 (128-wide) and 8 (3, 3, 2 heads a pass)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (16, 8, 128), (8, 1, 128)])
def test_many_decode_rows_one_item_each_match_dense(strided, heads, kv_heads, dim):
    # four rows per thread or more: the kernel gives each thread whole rows (every KV head),
    # contexts past one 64-key block fetch the next block while weighing this one
    rows = 4 * torch.get_num_threads() + 3
    ctx_lens = [(1, 13, 64, 65, 200)[i % 5] + i for i in range(rows)]
    q, k, v, kc, vc, batch, keys, values = make_case(
        [1] * rows, ctx_lens, heads, kv_heads, page=16, dim=dim, num_pages=512
    )
    if strided:
        kc, vc = _strided(kc), _strided(vc)
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, dim**-0.5, None)
    want = naive_attention(q, keys, values, batch.query_starts, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,window", [(64, None), (48, 70), (128, None)])
def test_a_row_gets_the_same_bits_in_a_batch_as_alone(dtype, dim, window):
    # a batch of four rows a thread or more is split by rows (AVX2 builds take a row's every KV
    # head in one pass), a smaller one by heads: a row's output must not depend on which, or
    # greedy tokens would change with what else is in the batch
    g = torch.Generator().manual_seed(dim)
    rows, heads, kv_heads, page, pages_per = 4 * torch.get_num_threads() + 3, 9, 3, 16, 14
    kc, vc = (
        torch.randn(rows * pages_per, page, kv_heads, dim, generator=g).to(dtype) for _ in range(2)
    )
    tables = torch.randperm(rows * pages_per, generator=g).view(rows, pages_per)
    row_seq = torch.arange(rows)
    row_pos = torch.tensor([(0, 13, 64, 65, 200)[i % 5] + i for i in range(rows)])
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    with cpu_amx.turned_off():
        together = cpu_native.decode_attention(q, kc, vc, tables, row_seq, row_pos, 0.1, window)
        for r in range(rows):
            alone = cpu_native.decode_attention(
                q[r : r + 1], kc, vc, tables, row_seq[r : r + 1], row_pos[r : r + 1], 0.1, window
            )
            assert torch.equal(alone[0], together[r]), r


@pytest.mark.parametrize("dim", [64, 48])  # 48: an odd number of 16-lane vectors a row
def test_decode_bf16_within_rounding_of_float32(dim):
    ctx_lens = [3, 40, 130]
    q, k, v, kc, vc, batch, keys, values = make_case([1] * 3, ctx_lens, 9, 3, page=16, dim=dim)
    q, k, v, kc, vc = (t.bfloat16() for t in (q, k, v, kc, vc))
    keys, values = [t.bfloat16() for t in keys], [t.bfloat16() for t in values]
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, 0.125, None)
    assert got.dtype == torch.bfloat16
    # the oracle on the same bf16 values in float32: one bf16 rounding of the output apart
    want = naive_attention(q.float(), [t.float() for t in keys], [t.float() for t in values],
                           batch.query_starts, 0.125)  # fmt: skip
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    with cpu_amx.turned_off():  # where AMX took the rows above: the AVX-512 kernel too
        avx512 = paged_attention(q, k, v, kc, vc, batch, 0.125, None)
    torch.testing.assert_close(avx512.float(), want, atol=1e-2, rtol=1e-2)
    with cpu_native.turned_off():  # the torch reference agrees as closely
        ref = paged_attention(q, k, v, kc, vc, batch, 0.125, None)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_equals_the_reference_and_skips_padding(dtype):
    _, k, v, kc, vc, batch, _, _ = make_case([1, 3, 5], [2, 9, 5], 4, 2, page=4, dim=8)
    k, v = k.to(dtype), v.to(dtype)
    ours_k, ours_v = _strided(kc.to(dtype)), _strided(vc.to(dtype))
    ref_k, ref_v = kc.to(dtype), vc.to(dtype)
    slots = torch.cat([batch.slot_mapping, torch.tensor([-1])])  # a padding row at the end
    pad = torch.full((1, *k.shape[1:]), 7.0, dtype=dtype)
    store_kv(torch.cat([k, pad]), torch.cat([v, pad]), ours_k, ours_v, slots)
    with cpu_native.turned_off():
        store_kv(k, v, ref_k, ref_v, batch.slot_mapping)
    assert torch.equal(ours_k, ref_k) and torch.equal(ours_v, ref_v)


def test_mixed_steps_use_it_for_decodes_and_the_reference_for_prefills():
    q_lens, ctx_lens = [1, 1, 7, 5], [1, 13, 7, 11]
    q, k, v, kc, vc, batch, keys, values = make_case(q_lens, ctx_lens, 8, 2)
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, 8**-0.5)
    with cpu_native.turned_off():
        ref = paged_attention(q, k, v, kc, vc, batch, 8**-0.5)
    want = naive_attention(q, keys, values, batch.query_starts, 8**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


def test_environment_switch_turns_them_off():
    code = "from trae_groups.kernels import cpu_native; print(cpu_native.library() is None)"
    env = dict(os.environ, TRAE_NATIVE_KERNELS="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr


needs_pointwise = pytest.mark.skipif(
    not cpu_native.pointwise(torch.zeros(1, dtype=torch.bfloat16)),
    reason="the native bf16 pointwise kernels are built for AVX-512 and AVX2 only",
)
needs_pointwise_f32 = pytest.mark.skipif(
    not cpu_native.pointwise(torch.zeros(1)),
    reason="the native float32 pointwise kernels are built for AVX-512 and AVX2 only",
)


def _wide_bf16(*shape: int) -> torch.Tensor:
    """Values across bf16's range: ordinary ones, large, tiny, zeros and infinities."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g))
    if x.numel() >= 4:
        x.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")])
    return x.bfloat16()


@needs_pointwise
@pytest.mark.parametrize("rows", [0, 1, 7, 33, 300])
def test_silu_mul_gives_torchs_bits(rows):
    import torch.nn.functional as F

    gate_up = _wide_bf16(rows, 2 * 96)
    want = F.silu(gate_up[:, :96]).mul_(gate_up[:, 96:])
    got = cpu_native.silu_mul(gate_up, 96)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # the same values


@needs_pointwise
def test_silu_mul_gives_torchs_bits_for_subnormal_results():
    """Gates whose SiLU, and products, fall below float32's smallest normal: AVX512-BF16's
    conversion would flush them to zero, so those vectors take the integer rounding."""
    import torch.nn.functional as F

    gate = torch.tensor([-95.0, -100.0, -90.0, 1e-20, -1e-30, 3e-38, 2.0, -3.0] * 4)
    up = torch.tensor([1.0, 0.5, 1e-3, 1e-20, 1e-10, 0.25, 1e-39, 5e-39] * 4)
    gate_up = torch.cat([gate, up])[None].bfloat16()
    want = F.silu(gate_up[:, :32]).mul_(gate_up[:, 32:])
    assert (want.float().abs() < torch.finfo(torch.float32).tiny).any()  # some subnormal
    got = cpu_native.silu_mul(gate_up, 32)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # the same bits


@needs_pointwise
@pytest.mark.parametrize("tokens", [0, 1, 5, 300])
def test_rotate_gives_the_torch_rotations_bits_on_a_strided_view(tokens):
    from trae_groups.engine.flat_forward import _signed_sin

    qkv = _wide_bf16(tokens, 7 * 64 + 64)  # q and k heads, then v: the fused output's rows
    qk = qkv[:, : 7 * 64].view(tokens, 7, 64)
    cos, sin = torch.randn(2, tokens, 1, 64).bfloat16()
    signed = _signed_sin(sin)
    half = 32
    want = torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), -1), signed)
    got = cpu_native.rotate(qk, cos, signed)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@needs_pointwise_f32
@pytest.mark.parametrize("rows", [0, 1, 7, 33, 300])
def test_float32_silu_mul_is_torchs_within_its_exp(rows):
    """float32 has no rounding to hide a last-bit difference: the kernel's exp is its own
    polynomial, so the values are torch's within a few ulp (inf and nan where torch's are)."""
    import torch.nn.functional as F

    gate_up = _wide_bf16(rows, 2 * 96).float() * 0.5
    want = F.silu(gate_up[:, :96]).mul_(gate_up[:, 96:])
    got = cpu_native.silu_mul(gate_up, 96)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)


@needs_pointwise_f32
@pytest.mark.parametrize("tokens", [0, 1, 5, 300])
def test_float32_rotate_is_two_products_and_a_sum(tokens):
    from trae_groups.engine.flat_forward import _signed_sin

    qkv = _wide_bf16(tokens, 7 * 64 + 64).float()
    qk = qkv[:, : 7 * 64].view(tokens, 7, 64)
    cos, sin = torch.randn(2, tokens, 1, 64)
    signed = _signed_sin(sin)
    want = qk * cos + torch.cat((qk[..., 32:], qk[..., :32]), -1) * signed
    got = cpu_native.rotate(qk, cos, signed)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_pointwise_kernels_leave_other_dtypes_to_torch():
    assert not cpu_native.pointwise(torch.zeros(1, dtype=torch.float16))
    assert not cpu_native.pointwise(torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 17), (3, 100), (5, 31), (32, 49152)])
def test_argmax_gives_torchs_indices(rows, n, dtype):
    """Ties (the first wins), infinities, a NaN (torch counts it above everything), a row of
    -inf, tails past a whole vector, rows strided in a wider matrix."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n + 7, generator=g).to(dtype)[:, :n]  # bf16: ties by rounding too
    x[0, n // 2] = float("inf")
    if rows > 1:
        x[1, n - 1] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    if rows > 3:
        top = x[3].max()
        x[3, 3], x[3, n - 2] = top + 1, top + 1
    assert torch.equal(cpu_native.argmax(x), x.argmax(-1))
    assert torch.equal(cpu_native.argmax(x.contiguous()), x.argmax(-1))


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float32, marks=needs_pointwise_f32),
              pytest.param(torch.bfloat16, marks=needs_pointwise)]
)  # fmt: skip
@pytest.mark.parametrize("tokens", [0, 1, 33])
def test_head_norms_are_qwen3s_rmsnorm_on_the_fused_output(tokens, dtype):
    """transformers' Qwen3RMSNorm per head (normalized, rounded to the dtype, weighted), read in
    place from a strided view of a fused q/k/v output: equal within one rounding of the dtype."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 4, 2, 64
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6).to(dtype), Qwen3RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
        k_norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
    weight = torch.cat((q_norm.weight.expand(heads, -1), k_norm.weight.expand(kv_heads, -1)))
    got = cpu_native.head_norms(qk, weight.detach().contiguous(), 1e-6)
    with torch.no_grad():
        want = torch.cat((q_norm(qk[:, :heads]), k_norm(qk[:, heads:])), dim=1)
    assert got.shape == want.shape and got.is_contiguous()
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=1e-6)


@pytest.mark.skipif(not cpu_native.norms(torch.float32), reason="our norms are AVX2 builds' only")
@pytest.mark.parametrize("rows,dim", [(0, 64), (1, 576), (7, 100), (300, 576)])
def test_float32_norms_are_llamas_rmsnorm_within_rounding(rows, dim):
    """The add-and-norm leaves the sum in the residual and the norm in hidden's storage (as
    zentorch's fused op does); both norms are transformers' LlamaRMSNorm within a few ulp (the
    sum of squares adds in another order)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(rows + dim)
    hidden, residual = (torch.randn(rows, dim, generator=g) * 3 for _ in range(2))
    norm = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
        want_sum = residual + hidden
        want = norm(want_sum)
    got_residual = residual.clone()
    got = cpu_native.add_rms_norm(hidden.clone(), got_residual, norm.weight.detach(), 1e-5)
    assert torch.equal(got_residual, want_sum)  # the same sum, exactly
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-6)
    alone = cpu_native.rms_norm(want_sum, norm.weight.detach(), 1e-5)
    assert torch.equal(alone, got)  # the same kernel's norm either way
    assert cpu_native.rms_norm(want_sum.double(), norm.weight.detach().double(), 1e-5) is None


@pytest.mark.skipif(not cpu_native.norms(torch.bfloat16), reason="our norms are AVX2 builds' only")
@pytest.mark.parametrize("rows,dim", [(0, 64), (1, 576), (7, 100), (300, 576)])
def test_bf16_norms_are_llamas_rmsnorm_in_bf16(rows, dim):
    """In bf16 the sum is rounded to bf16 (the residual's dtype), and the norm is LlamaRMSNorm's
    in bf16: x times rsqrt(mean of squares + eps) rounded, then times the weight, rounded. The
    sum of squares adds in another order, which can move a rounding by one bf16 step."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(rows + dim)
    hidden, residual = ((torch.randn(rows, dim, generator=g) * 3).bfloat16() for _ in range(2))
    norm = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
        norm = norm.bfloat16()
        want_sum = residual + hidden
        want = norm(want_sum)
    weight = norm.weight.detach()
    got_residual = residual.clone()
    got = cpu_native.add_rms_norm(hidden.clone(), got_residual, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got_residual, want_sum)  # the same sum, exactly
    step = want.float().abs() * 2**-7 + 1e-30  # a bf16 step or less
    assert bool(((got.float() - want.float()).abs() <= step).all())
    if rows:
        assert (got == want).float().mean() >= 0.99  # the same bits nearly everywhere
    assert torch.equal(cpu_native.rms_norm(want_sum, weight, 1e-5), got)
