"""bfloat16 on the fast path: the matmul decode attention and oneDNN-packed linears against
bf16 eager (SDPA, plain ``nn.Linear``), within stated tolerances."""

from __future__ import annotations

import pytest
import torch
from test_kernels import make_case

from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.fast_linear import packable_dtypes, widened_dtypes
from trae_groups.engine.protocol import GenerateRequest
from trae_groups.engine.sampling import SamplingParams
from trae_groups.kernels import naive_attention, paged_attention, store_kv

# packed as bf16 (AVX512-BF16/AMX) or widened to float32 (fast_linear.widened_dtypes)
needs_bf16_packing = pytest.mark.skipif(
    torch.bfloat16 not in packable_dtypes() | widened_dtypes(), reason="oneDNN packs no linears"
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (4, 2, 5)])
def test_low_precision_decode_attention_matches_the_float32_oracle(dtype, heads, kv_heads, window):
    # decodes at page boundaries and inside pages, then a prefill chunk over cached context
    q_lens, ctx_lens = [1, 1, 1, 1, 5], [1, 4, 13, 30, 11]
    q, k, v, kc, vc, batch, keys, values = make_case(q_lens, ctx_lens, heads, kv_heads)
    want = naive_attention(q, keys, values, batch.query_starts, 8**-0.5, window)
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    store_kv(k, v, kc, vc, batch.slot_mapping)
    got = paged_attention(q, k, v, kc, vc, batch, 8**-0.5, window)
    # inputs rounded to bf16 (8 bits of mantissa): ~1e-2 relative, outputs are O(1)
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _step_logits(path, fast_linear: bool, prompts, steps: int) -> list[torch.Tensor]:
    """Logits of the first ``steps`` engine steps (a prefill, then decodes) in bfloat16."""
    config = EngineConfig(dtype="bfloat16", pool_bytes=8 << 20, fast_linear=fast_linear)
    eng = LLMEngine({"m": path}, config)
    worker, seen = eng.llm("m"), []
    run = worker.runner.run
    worker.runner.run = lambda inputs: seen.append(run(inputs)) or seen[-1]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=steps, ignore_eos=True)
        worker.submit(GenerateRequest(str(i), params, prompt=prompt), lambda out: None)
    for _ in range(steps):
        worker.step()
    eng.shutdown()
    return seen


@needs_bf16_packing
def test_bf16_packed_linears_match_bf16_eager(llama_dir):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(100, 130))]
    eager = _step_logits(llama_dir, False, prompts, 4)
    packed = _step_logits(llama_dir, True, prompts, 4)
    assert len(eager) == len(packed) == 4
    # a row is compared while both runs fed it the same tokens: a tiny random model's logits
    # are flat, and another library's accumulation order may move a near tie's winner, after
    # which that sequence's inputs differ
    same = torch.ones(len(prompts), dtype=torch.bool)
    for e, p in zip(eager, packed, strict=True):
        scale = e.abs().max()
        bound = 0.02 * scale + 0.05
        assert (e - p)[same].abs().max() <= bound, (e - p)[same].abs().max()
        top2 = e.float().topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
        agree = e.argmax(-1) == p.argmax(-1)
        assert bool(agree[same & clear].all())  # the same greedy token wherever it is clear
        same &= agree
    assert bool(same.any())  # at least one sequence was compared to the end


@pytest.mark.skipif(
    torch.bfloat16 not in widened_dtypes(), reason="this CPU packs bf16 weights as they are"
)
def test_a_bf16_model_without_bf16_matmuls_holds_and_reports_its_widened_linears(llama_dir):
    """Without AVX512-BF16 or AMX a bf16 model's linears multiply in float32: from bf16 panels
    where our AVX2 ones take the weight, else from float32 copies. The memory report counts
    what is held and ``trae model info`` says which."""
    from trae_groups.engine.fast_linear import PackedLinear

    config = EngineConfig(dtype="bfloat16", pool_bytes=8 << 20)
    with LLMEngine({"m": llama_dir}, config) as eng:
        held = eng.store.report()[0]
        linears = [m for m in eng.llms["m"].model.modules() if isinstance(m, PackedLinear)]
        outs = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert linears and all(m.widened and m.dtype == torch.bfloat16 for m in linears)
    for m in linears:
        size = 2 if m.bf16_panels else 4
        assert m.packed_weight.nbytes == size * m.in_features * m.out_features
    assert held.bytes >= sum(m.packed_weight.nbytes for m in linears)
    ways = {m.widening() for m in linears}
    assert held.forward.endswith(f"({'; '.join(sorted(ways))})")
    assert len(outs[0].token_ids) == 4
