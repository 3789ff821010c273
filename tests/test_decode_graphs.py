"""Decode steps replayed from captured graphs (engine/decode_graphs.py).

Without a GPU the capture itself cannot run; these tests drive everything around it on CPU
through ``replay_eagerly`` (each replay reruns the step over the same static buffers): the
padded static inputs, the fixed-width block tables, padding rows that must store nothing,
the graph-safe attention, and greedy parity with transformers through chunked prefill,
preemption and the prefix cache. A forward that would break a capture on a GPU (a host read
of tensor data, a shape that depends on data) is caught here with a dispatch mode. The GPU
case (a real capture, marked ``gpu``) runs in bench/device_check.sh."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import MAX_NEW, assert_parity, check_decode_path_under_pressure, prompts
from torch.utils._python_dispatch import TorchDispatchMode

from trae_groups.engine.config import EngineConfig
from trae_groups.engine.decode_graphs import DecodeGraphs, replay_eagerly
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.sampling import SamplingParams
from trae_groups.kernels.attention import PagedBatch, graph_decode, paged_attention, store_kv

SIZES = (1, 4, 8)


def graph_engine(path, sizes=SIZES, **cfg) -> LLMEngine:
    cfg.setdefault("pool_bytes", 8 << 20)
    cfg.setdefault("fast_linear", False)  # the reference path: parity is token-exact
    # graphs capture transformers' forward (what GPUs run); on CPU these tests replay it
    cfg.setdefault("model_forward", "transformers")
    cfg.setdefault("max_num_seqs", max(sizes))
    eng = LLMEngine({"m": path}, EngineConfig(**cfg)).start()
    worker = eng.llms["m"]
    assert worker.runner.enable_graphs(sizes, worker.max_model_len, capture=replay_eagerly) >= 0
    assert isinstance(worker.runner.compiled, DecodeGraphs)
    return eng


def test_graph_decode_matches_paged_attention_and_padding_stores_nothing():
    torch.manual_seed(0)
    pages, page, kv_heads, heads, dim = 24, 4, 2, 4, 8
    lens = [5, 9, 1]  # three real rows, then two rows of padding
    rows = len(lens) + 2
    tables = torch.randperm(pages)[: rows * 4].view(rows, 4)  # wider than any row needs
    slots = torch.full((rows,), -1)
    for r, n in enumerate(lens):
        slots[r] = tables[r, (n - 1) // page] * page + (n - 1) % page
    q, k, v = (
        torch.randn(rows, heads, dim),
        torch.randn(rows, kv_heads, dim),
        torch.randn(rows, kv_heads, dim),
    )
    caches = [torch.randn(pages, page, kv_heads, dim) for _ in range(4)]
    lens_t = torch.tensor(lens + [0, 0])
    for window in (None, 3):
        kc, vc = caches[0].clone(), caches[1].clone()
        got = graph_decode(q, k, v, kc, vc, slots, tables, lens_t, 0.3, window)
        rk, rv = caches[0].clone(), caches[1].clone()
        n = len(lens)
        store_kv(k[:n], v[:n], rk, rv, slots[:n])
        batch = PagedBatch(slots[:n], list(range(n + 1)), lens, tables[:n], n, page, lens_t[:n])
        want = paged_attention(q[:n], k[:n], v[:n], rk, rv, batch, 0.3, window)
        torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[n:], torch.zeros_like(got[n:]))
        assert torch.equal(kc, rk) and torch.equal(vc, rv)  # padding wrote nothing
    # every row padding (how steps are captured): the caches are left exactly as they were
    kc, vc = caches[2].clone(), caches[3].clone()
    none = torch.full((rows,), -1)
    out = graph_decode(q, k, v, kc, vc, none, tables, torch.zeros(rows, dtype=torch.long), 0.3)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(kc, caches[2]) and torch.equal(vc, caches[3])


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_graph_decode_greedy_parity(llm_dirs, family):
    path = llm_dirs[family]
    ps = prompts(n=11, seed=5, lo=2, hi=40)  # mistral's window is 24: outputs cross it
    with graph_engine(path) as eng:
        graphs = eng.llms["m"].runner.compiled
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        # 11 rows run eagerly (above the largest size); as they finish, 8 and 4 replay
        assert graphs.steps > 0
        assert eng.llms["m"].runner.compiled is graphs  # never fell back
        assert eng.pool.stats().used_pages == 0
    assert_parity(path, outs, ps)


def test_graphs_with_chunked_prefill_preemption_and_prefix_cache(llama_dir):
    check_decode_path_under_pressure(llama_dir, lambda **cfg: graph_engine(llama_dir, **cfg))


def test_constrained_rows_on_graphs_equal_eager(llama_dir):
    """Constraints mask the logits after the forward: replayed steps keep them, token for
    token with the eager engine, beside unconstrained rows."""
    from test_constraints import PROMPTS, SCHEMA

    from trae_groups.engine.constraints import Constraint

    params = [SamplingParams(max_tokens=40, constraint=Constraint.json_schema(SCHEMA)),
              SamplingParams(max_tokens=12, constraint=Constraint("regex", "[0-9]{3}-[a-z]{2}")),
              SamplingParams(max_tokens=12, constraint=Constraint.choice(["refund", "track"])),
              SamplingParams(max_tokens=12, ignore_eos=True)]  # fmt: skip
    with LLMEngine(
        {"m": llama_dir},
        EngineConfig(pool_bytes=8 << 20, fast_linear=False, model_forward="transformers"),
    ) as eng:
        eager = eng.generate(PROMPTS, params)
    with graph_engine(llama_dir) as eng:
        replayed = eng.generate(PROMPTS, params)
        assert eng.llms["m"].runner.compiled.steps > 0
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
    assert set(json.loads(replayed[0].text)) == {"order_id", "urgent"}


# What would break a CUDA graph capture: reading a tensor's value on the host (a sync, and a
# value frozen into the graph), or an output whose shape depends on data.
HOST_READS = {
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select",
    "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
}  # fmt: skip


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_a_captured_step_reads_nothing_on_the_host(llm_dirs, family):
    with graph_engine(llm_dirs[family], sizes=(4,)) as eng:
        graphs = eng.llms["m"].runner.compiled
        eng.generate(prompts(n=3, seed=2), SamplingParams(max_tokens=4))  # real pages, lengths
        with torch.inference_mode(), HostReads() as mode:
            graphs._forward(4)
        assert mode.seen == []

        # the check can fail: attention that sizes its launch from the lengths, as the
        # eager kernels do, is caught
        def sized_by_lengths(q, k, v, kc, vc, slots, tables, lens, scale, window):
            assert int(lens.max()) >= 0
            return graph_decode(q, k, v, kc, vc, slots, tables, lens, scale, window)

        graphs.attend = sized_by_lengths
        with torch.inference_mode(), HostReads() as mode:
            graphs._forward(4)
        assert "aten.item.default" in mode.seen


def test_a_failing_replay_falls_back_to_eager(llama_dir):
    ps = prompts(n=3, seed=8)
    with graph_engine(llama_dir, sizes=(4,)) as eng:
        runner = eng.llms["m"].runner

        def broken():
            raise RuntimeError("simulated replay failure")

        runner.compiled._graphs[4] = (broken, runner.compiled._graphs[4][1])
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert runner.compiled is None
    assert_parity(llama_dir, outs, ps)


def test_a_failing_capture_leaves_the_model_eager(llama_dir, caplog):
    def broken(step, pool):
        raise RuntimeError("simulated capture failure")

    ps = prompts(n=2, seed=4)
    config = EngineConfig(pool_bytes=8 << 20, model_forward="transformers")
    with LLMEngine({"m": llama_dir}, config).start() as eng:
        worker = eng.llms["m"]
        assert worker.runner.enable_graphs((2,), worker.max_model_len, capture=broken) == 0.0
        assert worker.runner.compiled is None
        assert "capture failed" in caplog.text
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
    assert_parity(llama_dir, outs, ps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_eager_decode_on_a_gpu(llm_dirs):
    """EngineConfig(compile=True) on a GPU captures decode graphs (triton backend); greedy
    tokens equal the same engine's eager ones on the same GPU."""
    path = llm_dirs["mistral"]  # a sliding window of 24: outputs cross it
    ps = prompts(n=11, seed=5, lo=2, hi=40)
    outs = {}
    for compile_ in (False, True):
        cfg = EngineConfig(device="cuda", pool_bytes=64 << 20, compile=compile_,
                           compile_batch_sizes=SIZES, max_num_seqs=16)  # fmt: skip
        with LLMEngine({"m": path}, cfg).start() as eng:
            runner = eng.llms["m"].runner
            assert eng.backend.name == "triton"
            outs[compile_] = [
                o.token_ids for o in eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
            ]
            if compile_:
                assert isinstance(runner.compiled, DecodeGraphs) and runner.compiled.steps > 0
                assert runner.compiled.memory_bytes > 0
            assert eng.pool.stats().used_pages == 0
    assert outs[True] == outs[False]
