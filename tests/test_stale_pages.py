"""Pages are handed out uncleared on CPU (the torch backend's ``needs_zeroed_pages`` is False):
every CPU attention path, over pages whose unwritten slots hold NaN (a page's tail, the block
table's padding on page 0), gives exactly what it gives over clean pages; and an engine whose
pool is full of NaN bytes generates a clean pool's tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_kernels import make_case

from conftest import build_llm
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.sampling import SamplingParams
from trae_groups.kernels import (
    QuantKV,
    cpu_amx,
    cpu_native,
    cpu_prompt,
    paged_attention,
    select_backend,
    store_kv,
)
from trae_groups.kernels.attention import graph_decode
from trae_groups.kernels.compiled_decode_attention import decode_mask
from trae_groups.kernels.kv_quant import quantize

# decodes in a page's first and last slots and mid-page, prompt chunks fresh and over cached
# tokens (run padded together), and one long chunk beside a short one (run one by one)
CASES = {
    "decodes": ([1, 1, 1, 1], [1, 16, 17, 70]),
    "mixed": ([1, 1, 20, 13], [9, 33, 20, 40]),
    "one by one": ([1, 3, 90], [40, 5, 90]),
}


@contextlib.contextmanager
def _reference_only():
    """The torch reference on this thread: no native decode, prompt or AMX kernel."""
    with cpu_native.turned_off(), cpu_prompt.turned_off(), cpu_amx.turned_off():
        yield


def _unowned(batch, page: int, pages: int) -> torch.Tensor:
    """[pages, page] True at every slot no sequence of the batch owns."""
    owned = torch.zeros(pages, page, dtype=torch.bool)
    for s, ctx in enumerate(batch.context_lens):
        pos = torch.arange(ctx)
        owned[batch.block_tables[s, pos // page], pos % page] = True
    return ~owned


def _attend(name, dtype, window, stale: float | None, quantized: bool = False):
    q_lens, ctx_lens = CASES[name]
    q, k, v, kc, vc, batch, _, _ = make_case(q_lens, ctx_lens, 6, 2, page=16, dim=64, num_pages=24)
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    unowned = _unowned(batch, 16, kc.shape[0])
    if quantized:
        kc, vc = (QuantKV(*quantize(c, torch.int8), dtype) for c in (kc, vc))
        if stale is not None:  # a float16 scale of NaN: any value times it is NaN
            for c in (kc, vc):
                c.scale[unowned] = stale
                c.values[unowned] = 127
    elif stale is not None:
        kc[unowned] = stale
        vc[unowned] = stale
    store_kv(k, v, kc, vc, batch.slot_mapping)
    return paged_attention(q, k, v, kc, vc, batch, 0.125, window)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_over_nan_in_unwritten_slots_is_unchanged(name, dtype, window, native):
    with contextlib.nullcontext() if native else _reference_only():
        clean = _attend(name, dtype, window, None)
        got = _attend(name, dtype, window, float("nan"))
    assert torch.isfinite(clean).all()
    assert torch.equal(got, clean)


@pytest.mark.parametrize("name", list(CASES))
def test_int8_pages_with_nan_scales_in_unwritten_slots(name):
    clean = _attend(name, torch.float32, None, None, quantized=True)
    got = _attend(name, torch.float32, None, float("nan"), quantized=True)
    assert torch.isfinite(clean).all()
    assert torch.equal(got, clean)


def _graph_case(stale: float | None):
    ctx_lens, pad = [1, 16, 17, 40], 2
    q, k, v, kc, vc, batch, _, _ = make_case([1] * 4, ctx_lens, 4, 2, page=16, num_pages=12)
    if stale is not None:
        unowned = _unowned(batch, 16, kc.shape[0])
        kc[unowned] = stale
        vc[unowned] = stale
    slots = torch.cat([batch.slot_mapping, torch.full((pad,), -1)])
    tables = torch.cat([batch.block_tables, torch.zeros(pad, batch.block_tables.shape[1])]).long()
    lens = torch.tensor(ctx_lens + [0] * pad)
    rows = [torch.cat([t, torch.zeros(pad, *t.shape[1:])]) for t in (q, k, v)]
    return rows, kc, vc, slots, tables, lens


def test_graph_decode_over_nan_in_unwritten_slots():
    outs = []
    for stale in (None, float("nan")):
        (q, k, v), kc, vc, slots, tables, lens = _graph_case(stale)
        outs.append(graph_decode(q, k, v, kc, vc, slots, tables, lens, 0.25))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("native", [True, False])
def test_compiled_decode_op_over_nan_in_unwritten_slots(native):
    outs = []
    for stale in (None, float("nan")):
        (q, k, v), kc, vc, slots, tables, lens = _graph_case(stale)
        page = kc.shape[1]
        mask = decode_mask(lens, tables.shape[1] * page, None)
        where = (slots // page, slots % page, tables, mask, lens, 0, torch.tensor([4]), 0.25)
        with contextlib.nullcontext() if native else cpu_native.turned_off():
            outs.append(torch.ops.trae.compiled_decode_attention(q, k, v, kc, vc, *where))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[1], outs[0])


def test_the_cpu_backend_hands_out_pages_uncleared():
    assert select_backend("cpu").needs_zeroed_pages is False


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny Llama with head size 64, the size the native prompt kernels take."""
    return build_llm(tmp_path_factory.mktemp("wide") / "llama", "llama", head_dim=64)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8")]
)
def test_an_engine_over_a_pool_of_nan_bytes_gives_a_clean_pools_tokens(
    wide_heads, dtype, kv, native
):
    # lengths across pages, several prompt chunks a step, padded block tables
    prompts = [[(11 * i + j) % 500 + 3 for j in range(4 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    config = EngineConfig(pool_bytes=8 << 20, dtype=dtype, kv_cache_dtype=kv)
    tokens = []
    eng = LLMEngine({"m": wide_heads}, config)  # not started: generate() steps on this thread
    try:
        assert eng.llm("m").scheduler.zero_pages is False
        for byte in (0, 0xFF):  # 0xFF bytes: NaN in float32, bf16 and float16 scales
            eng.pool.clear_cache()
            eng.pool.buffer.fill_(byte)
            with contextlib.nullcontext() if native else _reference_only():
                tokens.append([r.token_ids for r in eng.generate(prompts, params)])
        assert eng.pool.stats().used_pages == 0
    finally:
        eng.shutdown()
    assert tokens[1] == tokens[0]
