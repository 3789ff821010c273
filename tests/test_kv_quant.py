"""int8 (and fp8) KV pages: quantization, the torch reference attention over them, the pool's
capacity, and the engine's greedy tokens against float KV."""

from __future__ import annotations

import pytest
import torch
from test_kernels import make_case

from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.memory_pool import KVLayout, MemoryPool
from trae_groups.engine.sampling import SamplingParams
from trae_groups.kernels import QuantKV, naive_attention, paged_attention, select_backend, store_kv
from trae_groups.kernels.kv_quant import dequantize, quantize


@pytest.mark.parametrize("storage,err", [(torch.int8, 0.005), (torch.float8_e4m3fn, 0.07)])
def test_quantize_round_trip_is_within_one_step(storage, err):
    x = torch.randn(50, 4, 32) * torch.logspace(-3, 2, 50)[:, None, None]  # scales 1e-3..1e2
    values, scale = quantize(x, storage)
    assert values.dtype == storage and scale.dtype == torch.float16 and scale.shape == (50, 4)
    back = dequantize(values, scale, torch.float32)
    rel = (back - x).abs().amax(-1) / x.abs().amax(-1)
    assert float(rel.max()) < err  # int8: half a step of 1/127; e4m3: 3 mantissa bits
    zeros = quantize(torch.zeros(2, 1, 8), storage)
    assert torch.equal(dequantize(*zeros, torch.float32), torch.zeros(2, 1, 8))


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (4, 2, 5)])
def test_attention_over_quantized_pages_matches_float(storage, heads, kv_heads, window):
    # decodes at page boundaries and inside pages, a fresh prefill, a chunk over cached context
    q_lens, ctx_lens = [1, 1, 1, 7, 5], [1, 4, 13, 7, 11]
    q, k, v, kc, vc, batch, keys, values = make_case(q_lens, ctx_lens, heads, kv_heads)
    want = naive_attention(q, keys, values, batch.query_starts, 8**-0.5, window)
    caches = [QuantKV(*quantize(c, storage), torch.float32) for c in (kc, vc)]
    store_kv(k, v, *caches, batch.slot_mapping)
    got = paged_attention(q, k, v, *caches, batch, 8**-0.5, window)
    tol = 3e-2 if storage == torch.int8 else 1.5e-1
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_pool_holds_about_twice_the_tokens_of_bf16_and_four_times_float32():
    def tokens(dtype, storage=None) -> int:
        layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype, storage=storage)
        pool = MemoryPool.from_size(256 << 20, page_bytes=layout.bytes_per_token * 16 // 64 * 64)
        return pool.num_pages * pool.tokens_per_page(layout)

    f32, bf16 = tokens(torch.float32), tokens(torch.bfloat16)
    int8 = tokens(torch.float32, torch.int8)
    assert int8 == tokens(torch.bfloat16, torch.int8)  # the compute dtype costs nothing
    # one byte per value plus a 2-byte scale per 64 values: 128/66 and 256/66
    assert 1.9 < int8 / bf16 < 2.0 and 3.8 < int8 / f32 < 4.0


def test_kv_view_pages_are_views_of_the_pool():
    layout = KVLayout(2, 2, 8, torch.float32, torch.int8)
    pool = MemoryPool(4, page_bytes=layout.bytes_per_token * 4)
    view = pool.kv_view(layout)
    assert isinstance(view.k[1], QuantKV) and view.k[1].shape == (4, 4, 2, 8)
    view.v[1].values.fill_(7)
    view.v[1].scale.fill_(0.5)
    assert pool.buffer.view(-1).count_nonzero() > 0
    assert torch.equal(view.v[1].index_select(0, torch.tensor([2])), torch.full((1, 4, 2, 8), 3.5))
    assert view.wasted_bytes_per_page == 0


def test_engine_greedy_with_int8_kv_agrees_with_float_kv(llm_dirs):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + i % 11)] for i in range(32)]
    outs = {}
    for kv in ("auto", "int8"):
        config = EngineConfig(pool_bytes=16 << 20, kv_cache_dtype=kv)
        with LLMEngine({"m": llm_dirs["qwen3"]}, config) as eng:
            res = eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
            outs[kv] = [r.token_ids for r in res]
            layout = eng.llm("m").kv.layout
            assert layout.storage == (torch.int8 if kv == "int8" else None)
            assert eng.pool.stats().used_pages == 0  # every page came back
    # agreement per step with the same history: a sequence is compared up to and including
    # its first differing token (after it the two runs continue different texts; on a random
    # model, whose top logits are ~0.1 apart, one flip changes everything after it)
    steps = agree = 0
    for want, got in zip(outs["auto"], outs["int8"], strict=True):
        assert len(want) == len(got) == 16
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        steps += 16 if first is None else first + 1
        agree += 16 if first is None else first
    assert agree >= 0.95 * steps  # measured 471 of 476 (qwen3)


def test_kv_cache_dtype_is_checked_where_it_is_set():
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="fp8.*compute capability 8.9"):
        select_backend("cpu").check_kv("fp8", "cpu")
    from trae_groups.kernels.backend import AttentionBackend

    no_quant = AttentionBackend("x", store_kv, paged_attention, kv_dtypes=())
    with pytest.raises(ValueError, match="the x attention backend supports"):
        no_quant.check_kv("int8", "cpu")


def test_kv_cache_dtype_flag_reaches_the_engine_config():
    from trae_groups.cli import _engine_config, build_parser

    args = build_parser().parse_args(["model", "info", "g.yaml", "--kv-cache-dtype", "int8"])
    assert _engine_config(args).kv_cache_dtype == "int8"
    args = build_parser().parse_args(["model", "info", "g.yaml"])
    assert _engine_config(args).kv_cache_dtype == "auto"  # EngineConfig's default
    with pytest.raises(SystemExit) as exit_:  # argparse: exit 2, the choices named
        build_parser().parse_args(["model", "info", "g.yaml", "--kv-cache-dtype", "int4"])
    assert exit_.value.code == 2
