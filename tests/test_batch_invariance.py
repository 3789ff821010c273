"""A sequence's greedy tokens and logprobs do not depend on what shares its steps: decoded alone,
beside other sequences or verifying its own proposals, its rows get the same bits. On the packed
bf16 path this rests on one-row steps running as two rows (engine/flat_forward.py): zentorch's
one-row kernels round apart from its matrix kernels. float32 and the reference path keep it
as they are."""

from __future__ import annotations

import pytest
import torch
from test_engine import engine

from conftest import build_llm
from trae_groups.engine.fast_linear import packable_dtypes
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.spec_config import SpeculativeConfig

# whole pages and one token: a cached prompt leaves one row to compute, as a decode does
PROMPTS = [list(range(5, 38)), list(range(300, 349))]
# a draft with the target's own weights: most proposals are kept, so verifying chunks run
DRAFT = SpeculativeConfig(method="draft", draft="draft", num_tokens=3)
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def wide_llm(tmp_path_factory):
    """Wide enough that a one-row matmul kernel sums in another order than a matrix one."""
    folder = tmp_path_factory.mktemp("wide-llm")
    return build_llm(folder, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=4096)  # fmt: skip


def _runs(path, dtype: str, **cfg):
    """The first prompt's output alone, then beside the second, then alone verifying a draft's
    proposals: each prompt cached first, so every run computes its rows the same way (a
    prompt's last token over its cached prefix, then one row per decode). Each is cached by
    itself: two prompts submitted together share a prefill step or not as the loop thread
    picks them up (a loaded machine changes which), and a bf16 prefill's bits follow what
    shares its step."""
    outs = []
    for batch, spec in ((1, None), (2, None), (1, DRAFT)):
        models = {"m": path} if spec is None else {"draft": path, "m": path}
        with engine(models, dtype=dtype, fast_linear=True, speculative=spec, **cfg) as eng:
            for prompt in PROMPTS:
                eng.generate([prompt], SamplingParams(max_tokens=1), model="m")
            outs.append(eng.generate(PROMPTS[:batch], PARAMS, model="m")[0])
            if spec is not None:  # proposals were verified, most kept
                counters = eng.llms["m"].speculator.counters
                assert counters.accepted > counters.proposed // 2
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_alone_batched_and_verifying_rows_get_the_same_tokens_and_logprobs(wide_llm, dtype):
    if getattr(torch, dtype) not in packable_dtypes():
        pytest.skip(f"oneDNN/zentorch cannot pack {dtype} on this CPU")
    alone, batched, verifying = _runs(wide_llm, dtype)
    # tokens exactly; logprobs within the float32 rounding of a log-softmax over one row or
    # several (a bf16 logit one unit apart moves its logprob by ~1e-3, which this catches)
    for other in (batched, verifying):
        assert other.token_ids == alone.token_ids
        assert other.logprobs == pytest.approx(alone.logprobs, abs=1e-5, rel=0)


def test_the_native_pointwise_kernels_change_no_bit_of_a_bf16_generation(wide_llm, monkeypatch):
    """One engine, the prompts cached first as in ``_runs`` (their prefill runs once, so
    its bits are the same for both), then with the native kernels and without them."""
    from trae_groups.kernels import cpu_native

    if not cpu_native.pointwise(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("the native pointwise kernels are built for AVX-512 only")
    calls = {"silu_mul": 0, "rotate": 0}
    for name in calls:
        kernel = getattr(cpu_native, name)
        monkeypatch.setattr(
            cpu_native,
            name,
            lambda *a, _k=kernel, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _k(*a),
        )
    with engine({"m": wide_llm}, dtype="bfloat16") as eng:
        eng.generate(PROMPTS, SamplingParams(max_tokens=1), model="m")
        calls.update(silu_mul=0, rotate=0)
        with_native = eng.generate(PROMPTS, PARAMS, model="m")
        assert calls["silu_mul"] and calls["rotate"]  # the kernels ran
        monkeypatch.setattr(cpu_native, "pointwise", lambda x: False)
        without = eng.generate(PROMPTS, PARAMS, model="m")
    for a, b in zip(with_native, without, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # the same bits, not merely close
