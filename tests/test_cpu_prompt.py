"""Prompt attention on AVX-512 or AVX2 (trae_kernels/cpu_prompt.c) against the dense oracle:
chunks over cached prefixes, GQA, sliding windows, head sizes 64 and 128, contexts ending
inside a page whose stale slots hold NaN, a page-major pool's strided layer view; float32 to
a few ulp, bf16 (AVX-512 builds) within the error torch's own kernel makes on the same
inputs; and a model's prompt scores with and without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_cpu_amx import prompt_scores
from test_cpu_native import _strided
from test_kernels import make_case
from test_native_layers import WIDE

from conftest import build_llm
from trae_groups.kernels import cpu_prompt, naive_attention, paged_attention
from trae_groups.kernels.attention import _prefill_mask

needs_kernel = pytest.mark.skipif(cpu_prompt.library() is None, reason="no AVX-512 or AVX2 build")
BF16_KERNEL = hasattr(cpu_prompt.library(), "prefill_attention_bf16")  # AVX-512 builds
DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16_KERNEL, reason="AVX2 build")),
]


def _case(q_lens, ctx_lens, heads, kv_heads, dim, seed=0, page=16):
    q, k, v, kc, vc, batch, keys, values = make_case(
        q_lens, ctx_lens, heads, kv_heads, page=page, dim=dim, seed=seed, num_pages=512
    )
    kc.fill_(float("nan"))  # slots no token owns: a kernel that reads them gives NaN
    vc.fill_(float("nan"))
    for s, (key, value) in enumerate(zip(keys, values, strict=True)):
        pages = batch.block_tables[s]
        for pos in range(key.shape[0]):
            kc[pages[pos // page], pos % page] = key[pos]
            vc[pages[pos // page], pos % page] = value[pos]
    return q, k, v, kc, vc, batch, keys, values


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("window", [None, 24, 100])
def test_chunks_over_cached_prefixes_match_dense(dtype, dim, heads, kv_heads, window):
    # fresh prompts, chunks over a cached prefix ending inside a page and on its edge, chunks
    # of 17 rows (one vector of queries and a row), 40 (an item and a partial vector), 48 (an
    # item and a whole vector), pages of 8 tokens, beside decodes
    q_lens, ctx_lens = [1, 1, 40, 100, 17, 64, 48], [9, 300, 40, 130, 200, 96, 70]
    for page, strided in ((16, False), (8, True)):
        q, k, v, kc, vc, batch, keys, values = _case(q_lens, ctx_lens, heads, kv_heads, dim,
                                                     page=page)  # fmt: skip
        q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))  # NaN stays NaN
        keys, values = ([t.to(dtype).float() for t in ts] for ts in (keys, values))
        if strided:
            kc, vc = _strided(kc), _strided(vc)
        assert cpu_prompt.supports(q, kc, vc)
        got = paged_attention(q, k, v, kc, vc, batch, dim**-0.5, window)
        want = naive_attention(q.float(), keys, values, batch.query_starts, dim**-0.5, window)
        if dtype == torch.float32:  # float32 sums throughout
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # bf16: within the error torch's own kernel makes on the same inputs
            torch_bf16 = _sdpa(q, keys, values, batch.query_starts, dim**-0.5, window)
            ours, theirs = (got.float() - want).abs(), (torch_bf16.float() - want).abs()
            assert ours.max() <= 1.5 * theirs.max() and ours.mean() <= 1.5 * theirs.mean()


def _sdpa(q, keys, values, starts, scale, window):
    """torch's scaled_dot_product_attention chunk by chunk over bf16 K/V: like ours, it rounds
    P to bf16 for its product with V and each output once."""
    out = torch.empty_like(q)
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        lo, hi = starts[s], starts[s + 1]
        group = q.shape[1] // k.shape[1]
        kk, vv = (t.to(q.dtype).repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        mask = _prefill_mask(hi - lo, k.shape[0], window, q.device, explicit=True)
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), kk, vv, mask, scale=scale)
        out[lo:hi] = o.transpose(0, 1)
    return out


def test_it_takes_only_its_shapes():
    q = torch.zeros(40, 4, 64)
    cache = torch.zeros(8, 16, 2, 64)
    takes = cpu_prompt.library() is not None
    assert cpu_prompt.supports(q, cache, cache) is takes
    bf16 = q.bfloat16(), cache.bfloat16(), cache.bfloat16()
    assert cpu_prompt.supports(*bf16) is (takes and BF16_KERNEL)  # AVX-512 builds
    assert not cpu_prompt.supports(q.half(), cache.half(), cache.half())
    assert not cpu_prompt.supports(q[..., :32], cache[..., :32], cache[..., :32])
    with cpu_prompt.turned_off():
        assert not cpu_prompt.supports(q, cache, cache)


def test_the_switch_turns_it_off():
    code = "from trae_groups.kernels import cpu_prompt; print(cpu_prompt.library() is None)"
    env = dict(os.environ, **{cpu_prompt.ENV_SWITCH: "0"})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_models_prompt_scores_match_torchs_kernel(tmp_path, monkeypatch, dtype):
    path = build_llm(tmp_path / "qwen3", "qwen3", **WIDE)
    name = str(dtype).removeprefix("torch.")
    for got, want in prompt_scores(path, name, cpu_prompt, monkeypatch):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        else:  # bf16 through two layers, attention rounded as ours and as SDPA round it
            torch.testing.assert_close(got, want, atol=0.06, rtol=0)  # 0.02-0.03 seen
