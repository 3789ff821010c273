"""Prompt attention on AMX tiles (trae_kernels/cpu_amx.c) against the dense float32 oracle:
chunks over cached prefixes, GQA, sliding windows, contexts that end inside a page whose
stale slots hold NaN, chunks of one token to thousands, a page-major pool's strided layer
view; and a model's prefill with and without it. Runs where the CPU has AMX (Intel Xeon from
Sapphire Rapids on); elsewhere only the skip rule is checked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_cpu_native import _strided
from test_engine import engine
from test_kernels import make_case
from test_native_layers import WIDE

from conftest import build_llm
from trae_groups.engine.sampling import SamplingParams
from trae_groups.kernels import cpu_amx, naive_attention, paged_attention

needs_amx = pytest.mark.skipif(cpu_amx.library() is None, reason="no AMX tiles here")
DIM = 64


def _case(q_lens, ctx_lens, heads, kv_heads, seed=0, page=16, dim=DIM):
    q, k, v, kc, vc, batch, keys, values = make_case(
        q_lens, ctx_lens, heads, kv_heads, page=page, dim=dim, seed=seed, num_pages=512
    )
    kc, vc = kc.bfloat16(), vc.bfloat16()
    kc.fill_(float("nan"))  # slots no token owns: a kernel that reads them gives NaN
    vc.fill_(float("nan"))
    for s, (key, value) in enumerate(zip(keys, values, strict=True)):
        pages = batch.block_tables[s]
        for pos in range(key.shape[0]):
            kc[pages[pos // page], pos % page] = key[pos].bfloat16()
            vc[pages[pos // page], pos % page] = value[pos].bfloat16()
    keys = [key.bfloat16().float() for key in keys]
    values = [value.bfloat16().float() for value in values]
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), kc, vc, batch, keys, values


def _check(q_lens, ctx_lens, heads, kv_heads, window=None, seed=0, strided=False, dim=DIM):
    q, k, v, kc, vc, batch, keys, values = _case(q_lens, ctx_lens, heads, kv_heads, seed, dim=dim)
    if strided:
        kc, vc = _strided(kc), _strided(vc)
    assert cpu_amx.supports_prefill(q, kc, vc) is (dim in cpu_amx.HEAD_SIZES)
    scale = dim**-0.5
    got = paged_attention(q, k, v, kc, vc, batch, scale, window)
    want = naive_attention(q.float(), keys, values, batch.query_starts, scale, window)
    # bf16 outputs of values within a few units: one bf16 step of the largest is ~0.016
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@needs_amx
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("window", [None, 24, 100])
def test_chunks_over_cached_prefixes_match_dense(dim, heads, kv_heads, window):
    # fresh prompts, chunks continuing over a cached prefix (ending inside a page and on its
    # edge), a chunk of 17 rows (one whole query block and one row), beside decodes
    q_lens = [1, 1, 40, 100, 17, 64]
    ctx_lens = [9, 300, 40, 130, 200, 96]
    _check(q_lens, ctx_lens, heads, kv_heads, window, dim=dim)


@needs_amx
@pytest.mark.parametrize("seed", range(4))
def test_random_chunks_and_a_strided_pool(seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(33, 700, (3,), generator=g).tolist()
    q_lens = [int(torch.randint(33, c + 1, (1,), generator=g)) for c in ctx]
    _check(q_lens, ctx, 9, 3, seed=seed, strided=seed % 2 == 1)


@needs_amx
@pytest.mark.parametrize("dim", [64, 128, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (10, 2), (16, 1)])
@pytest.mark.parametrize("window", [None, 20, 70])
def test_decode_rows_match_dense(dim, heads, kv_heads, window):
    # contexts inside a page, on its edge, ending in each page of a pass of three (head size
    # 64) or two, on and across the edges of cpu_amx.c's blocks of keys (BLOCK); windows
    # starting mid-page; 5 heads per KV head take the kernel's unspecialised path, head size
    # 32 the AVX-512 one
    ctx_lens = [1, 16, 17, 33, 48, 49, 192, 193, 420]
    assert cpu_amx.decodes(torch.bfloat16)
    _check([1] * len(ctx_lens), ctx_lens, heads, kv_heads, window, dim=dim, strided=dim == 64)


@needs_amx
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (128, 16, 2), (64, 4, 4)])
def test_many_decode_rows_one_item_each_match_dense(dim, heads, kv_heads):
    # four rows per thread or more: the kernel gives each thread whole rows (every KV head)
    rows = 4 * torch.get_num_threads() + 3
    ctx_lens = [(1, 16, 17, 64, 65, 300)[i % 6] + 40 * i for i in range(rows)]
    _check([1] * rows, ctx_lens, heads, kv_heads, dim=dim, strided=dim == 64)


@needs_amx
def test_a_long_prompt_alone():
    _check([2048], [2048], 9, 3)


def test_it_takes_only_its_shapes():
    q = torch.zeros(40, 4, DIM, dtype=torch.bfloat16)
    cache = torch.zeros(8, 16, 2, DIM, dtype=torch.bfloat16)
    takes = cpu_amx.library() is not None
    assert cpu_amx.supports_prefill(q, cache, cache) is takes
    assert not cpu_amx.supports_prefill(q.float(), cache.float(), cache.float())  # bf16 only
    assert not cpu_amx.supports_prefill(q[..., :32], cache[..., :32], cache[..., :32])  # 64, 128
    odd_pages = torch.zeros(8, 8, 2, DIM, dtype=torch.bfloat16)
    assert not cpu_amx.supports_prefill(q, odd_pages, odd_pages)  # 16-token page multiples
    with cpu_amx.turned_off():
        assert not cpu_amx.supports_prefill(q, cache, cache)


def test_the_switch_turns_it_off():
    code = "from trae_groups.kernels import cpu_amx; print(cpu_amx.library() is None)"
    env = dict(os.environ, **{cpu_amx.ENV_SWITCH: "0"})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr


def prompt_scores(path, dtype: str, kernel, monkeypatch) -> list[tuple]:
    """(with, without) a prompt kernel module (its ``prefill`` seen to run, then its
    ``library`` gone for the engine's thread too): each prompt's logprobs, for two prompts."""
    prompts = [list(range(5, 250)), list(range(40, 77))]  # the model's 256 positions
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    calls = []
    prefill = kernel.prefill
    monkeypatch.setattr(kernel, "prefill", lambda *a: calls.append(1) or prefill(*a))
    with engine({"m": path}, dtype=dtype, fast_linear=True) as eng:
        with_kernel = eng.generate(prompts, params)
        assert calls
        monkeypatch.setattr(kernel, "library", lambda: None)
        without = eng.generate(prompts, params)
    return [
        tuple(torch.tensor([e.logprob for e in out.prompt_logprobs[1:]]) for out in pair)
        for pair in zip(with_kernel, without, strict=True)
    ]


@needs_amx
def test_a_models_prefill_scores_within_bf16_of_torchs_kernel(tmp_path, monkeypatch):
    """Prompt logprobs of a bf16 model (head size 64) with the kernel and with torch's prompt
    attention: the same up to bf16 rounding."""
    path = build_llm(tmp_path / "llama", "llama", **WIDE)
    for got, want in prompt_scores(path, "bfloat16", cpu_amx, monkeypatch):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)
