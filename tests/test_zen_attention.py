"""Prompt attention on zentorch's SDPA kernel (trae_kernels/zen_attention.py) against the dense
oracle and torch's kernel: fresh prompts, chunks over a cached prefix, several chunks in one
padded call, sliding windows, GQA/MQA, bf16; and ``TRAE_ZEN_ATTENTION=0`` turning it off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_kernels import make_case

from trae_groups.kernels import (
    cpu_prompt,
    naive_attention,
    paged_attention,
    store_kv,
    zen_attention,
)

pytestmark = pytest.mark.skipif(
    torch.float32 not in zen_attention._dtypes(),
    reason="zentorch's SDPA is not usable here (the zen extra on an AMD CPU with AVX-512)",
)

CASES = {
    "one fresh prompt": ([37], [37]),
    # chunks longer than NATIVE_CHUNK_ROWS (shorter ones run as rows of the native kernel)
    "fresh prompts, one padded call": ([40, 40, 36], [40, 40, 36]),
    "a chunk over its cached prefix": ([40], [150]),
    "chunks over prefixes, one padded call": ([40, 40, 36], [90, 70, 80]),
    "decodes beside a long chunk": ([1, 1, 48], [30, 7, 90]),
    # longer than 2 * QUERY_BLOCK: the rows go in blocks over the keys they may see
    "one long fresh prompt": ([300], [300]),
    "long fresh prompts, one padded call": ([300, 260, 290], [300, 260, 290]),
    "a long chunk over its cached prefix": ([200], [330]),
    "long chunks over prefixes, one padded call": ([200, 150, 180], [260, 300, 180]),
}


def _run(q_lens, ctx_lens, heads, kv_heads, window, dtype=torch.float32):
    q, k, v, kc, vc, batch, keys, values = make_case(
        q_lens, ctx_lens, heads, kv_heads, page=16, dim=64, num_pages=64
    )
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    store_kv(k, v, kc, vc, batch.slot_mapping)
    with cpu_prompt.turned_off():  # float32 prompts take our own kernel first where it builds
        got = paged_attention(q, k, v, kc, vc, batch, 0.125, window)
    want = naive_attention(
        q.float(), [t.to(dtype).float() for t in keys], [t.to(dtype).float() for t in values],
        batch.query_starts, 0.125, window,
    )  # fmt: skip
    with zen_attention.turned_off(), cpu_prompt.turned_off():
        torch_kernel = paged_attention(q, k, v, kc, vc, batch, 0.125, window)
    return got, want, torch_kernel


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("window", [None, 24])
def test_matches_dense_float32(case, heads, kv_heads, window, monkeypatch):
    calls = []
    sdpa = zen_attention.sdpa
    monkeypatch.setattr(zen_attention, "sdpa", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    got, want, torch_kernel = _run(*CASES[case], heads, kv_heads, window)
    assert calls, "zentorch's kernel did not run"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, torch_kernel, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    torch.bfloat16 not in zen_attention._dtypes(), reason="no AVX512-BF16: bf16 stays on torch"
)
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_within_rounding(case):
    got, want, torch_kernel = _run(*CASES[case], 9, 3, None, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), torch_kernel.float(), atol=3e-2, rtol=3e-2)


def test_turned_off_by_the_environment():
    probe = (
        "from trae_groups.kernels import zen_attention as z; print(sorted(map(str, z._dtypes())))"
    )
    env = {**os.environ, zen_attention.ENV_SWITCH: "0"}
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    on = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert off.stdout.strip() == "[]", off.stderr
    assert "torch.float32" in on.stdout, on.stderr


def test_other_kv_dtypes_stay_on_torch():
    q = torch.zeros(4, 2, 64)
    assert zen_attention.supports(q, q)
    assert not zen_attention.supports(q, q.bfloat16())
    assert not zen_attention.supports(q.half(), q.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q,n_k", [(512, 512), (300, 300), (200, 330), (129, 700), (259, 391)])
def test_causal_blocks_give_the_whole_squares_bits(n_q, n_k, dtype):
    """``sdpa_causal`` leaves out only keys its rows' mask hides: the output is the bits of
    one call over the whole square."""
    gen = torch.Generator().manual_seed(n_q)
    if dtype not in zen_attention._dtypes():
        pytest.skip(f"zentorch's SDPA does not run {dtype} here")
    q, k, v = (torch.randn(2, h, n, 64, generator=gen).to(dtype)
               for h, n in ((9, n_q), (3, n_k), (3, n_k)))  # fmt: skip
    rows = torch.arange(n_k - n_q, n_k)[:, None]
    bias = torch.zeros(n_q, n_k, dtype=dtype)
    bias.masked_fill_(torch.arange(n_k)[None, :] > rows, float("-inf"))
    bias = bias[None, None]
    whole = zen_attention.sdpa(q, k, v, 0.125, mask=bias)
    assert torch.equal(zen_attention.sdpa_causal(q, k, v, 0.125, bias, n_k - n_q), whole)
