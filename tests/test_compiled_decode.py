"""EngineConfig(compile=True): decode-only steps through torch.compile (padded batch sizes,
attention as a custom op) keep greedy parity with transformers' generate; prefill, mixed
steps and larger batches run eagerly alongside. Compiling takes seconds per size, so these
tests compile few sizes and share one engine per model where they can."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_engine import MAX_NEW, assert_parity, check_decode_path_under_pressure, prompts
from torch._dynamo.utils import counters

from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler"),
]


def compiled_engine(path, **cfg) -> LLMEngine:
    cfg.setdefault("pool_bytes", 8 << 20)
    cfg.setdefault("fast_linear", False)  # the reference path: parity is token-exact
    cfg.setdefault("compile_batch_sizes", (1, 8))
    cfg.setdefault("max_num_seqs", 8)
    return LLMEngine({"m": path}, EngineConfig(compile=True, **cfg)).start()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_compiled_decode_greedy_parity(llm_dirs, family):
    path = llm_dirs[family]
    ps = prompts(n=12, seed=5, lo=2, hi=40)  # mistral's window is 24: outputs cross it
    with compiled_engine(path) as eng:
        runner = eng.llms["m"].runner
        assert runner.compiled.compile_s > 0
        graphs = counters["stats"]["unique_graphs"]
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert runner.compiled.steps > 0  # 8, then 4 padded to 8, then 1
        # every graph a real step used was made at start-up (a warm-up that differed from
        # real steps, e.g. in aliasing, once made each size compile again here)
        assert counters["stats"]["unique_graphs"] == graphs
        assert eng.pool.stats().used_pages == 0
    assert_parity(path, outs, ps)


def test_compiled_with_chunked_prefill_preemption_and_prefix_cache(llama_dir):
    check_decode_path_under_pressure(llama_dir, lambda **cfg: compiled_engine(llama_dir, **cfg))


def test_compiled_packed_linears_match_eager_packed(llama_dir):
    """The compiled graph calls the packed matmul through a custom op: same numbers."""
    ps = prompts(n=6, seed=7)
    params = SamplingParams(max_tokens=MAX_NEW, logprobs=1)
    outs = {}
    for compile_ in (False, True):
        cfg = EngineConfig(pool_bytes=8 << 20, compile=compile_, compile_batch_sizes=(8,))
        with LLMEngine({"m": llama_dir}, cfg).start() as eng:
            outs[compile_] = eng.generate(ps, params)
    for eager, compiled in zip(outs[False], outs[True], strict=True):
        assert eager.token_ids == compiled.token_ids
        torch.testing.assert_close(
            torch.tensor(eager.logprobs), torch.tensor(compiled.logprobs), atol=1e-4, rtol=0
        )


def test_a_failing_compiled_step_falls_back_to_eager(llama_dir):
    ps = prompts(n=3, seed=8)
    with compiled_engine(llama_dir, compile_batch_sizes=(4,)) as eng:
        runner = eng.llms["m"].runner

        def broken(*args):
            raise RuntimeError("simulated compile failure")

        runner.compiled._fn = broken
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert runner.compiled is None
    assert_parity(llama_dir, outs, ps)


def test_packed_linears_compile_to_direct_mkldnn_calls():
    """In a compiled graph a packed linear is the mkldnn op called from the generated code,
    not our Python custom op (whose call costs ~11 us more, 211 times a SmolLM2 step)."""
    from torch._inductor.utils import run_and_get_code

    from trae_groups.engine.fast_linear import PackedLinear, lower_packed_linear

    g = torch.Generator().manual_seed(0)
    first = PackedLinear(torch.randn(24, 16, generator=g) / 4, torch.randn(24, generator=g))
    second = PackedLinear(torch.randn(8, 24, generator=g) / 4)

    def f(x):
        return second(torch.nn.functional.silu(first(x)))

    x = torch.randn(3, 16, generator=g)
    lower_packed_linear()
    with torch.inference_mode():
        got, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), x)
        torch.testing.assert_close(got, f(x))
    assert code.count("torch.ops.mkldnn._linear_pointwise.default(") == 2
    assert "torch.ops.trae.packed_linear.default(" not in code


#: bfloat16 logprobs move in steps of ~0.008 here (exact ties occur), and inductor's fused
#: reductions sum in another order than eager's kernels (its vector width follows the CPU:
#: seen on an AVX2-only EPYC): a greedy pick may flip only where the two best tokens are this
#: close.
BF16_NEAR_TIE = 0.02


def test_compiled_bf16_matches_eager_bf16(llama_dir):
    """bfloat16 through the compiled graph (intermediates rounded as eager rounds them) gives
    eager bf16's tokens up to the first near tie, and logprobs within bf16 rounding."""
    ps = prompts(n=4, seed=11)
    params = SamplingParams(max_tokens=MAX_NEW, logprobs=2)
    outs = {}
    for compile_ in (False, True):
        cfg = EngineConfig(
            dtype="bfloat16", pool_bytes=8 << 20, compile=compile_, compile_batch_sizes=(4,)
        )
        with LLMEngine({"m": llama_dir}, cfg).start() as eng:
            outs[compile_] = eng.generate(ps, params)
            if compile_:
                assert eng.llms["m"].runner.compiled.steps > 0
    compared = 0
    for eager, compiled in zip(outs[False], outs[True], strict=True):
        clear = next(
            (i for i, top in enumerate(eager.top_logprobs) if _margin(top) < BF16_NEAR_TIE),
            len(eager.token_ids),
        )
        # the tie's own pick may go either way; everything before it must agree
        assert eager.token_ids[:clear] == compiled.token_ids[:clear]
        torch.testing.assert_close(
            torch.tensor(eager.logprobs[: clear + 1]),
            torch.tensor(compiled.logprobs[: clear + 1]),
            atol=3e-2, rtol=0,
        )  # fmt: skip
        compared += clear
    assert compared >= MAX_NEW // 2  # not vacuous: tokens before the first tie were compared


def _margin(top: dict[int, float]) -> float:
    best, second = sorted(top.values(), reverse=True)[:2]
    return best - second


def test_compiling_waits_for_the_pool_to_be_sized_at_start(llm_dirs):
    """Without pool_bytes the pool is sized when serving starts, from the memory the weights
    of every model leave; compiled sizes (CUDA graphs hold the pool's addresses) are built
    after that, not while the first model loads."""
    cfg = EngineConfig(pool_fraction=0.002, fast_linear=False, compile=True,
                       compile_batch_sizes=(2,), max_num_seqs=2)  # fmt: skip
    eng = LLMEngine({"a": llm_dirs["llama"], "b": llm_dirs["qwen3"]}, cfg)
    try:
        assert eng.pool.num_pages == 1  # not sized yet
        assert all(w.runner.compiled is None for w in eng.llms.values())
        eng.start()
        assert eng.pool.num_pages > 1
        assert all(w.runner.compiled is not None for w in eng.llms.values())
        ps = prompts(n=2, seed=3)
        assert_parity(
            llm_dirs["llama"], eng.generate(ps, SamplingParams(max_tokens=MAX_NEW), model="a"), ps
        )
    finally:
        eng.shutdown()
