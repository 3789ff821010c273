"""Our flat forward (engine/flat_forward.py) against transformers' own model classes.

The engine's greedy-parity tests (test_engine.py, test_lora.py, test_compiled_decode.py...)
run every supported family through it already; these check the forward itself, which path a
model takes, and that fusing keeps the memory a model holds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from conftest import LLM_FAMILIES, build_llm
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.fast_linear import linear_library, zentorch_available
from trae_groups.engine.flat_forward import FlatForward, FusedSlice, forward_path
from trae_groups.engine.llm_runner import ATTN_NAME
from trae_groups.engine.sampling import SamplingParams


def dense_attend(layer, q, k, v, window, scale):
    """One sequence, no cache: plain causal attention (the prompt is shorter than any
    window here)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize("family", sorted(LLM_FAMILIES))
def test_flat_forward_logits_equal_transformers(llm_dirs, family):
    path = llm_dirs[family]
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_NAME).eval()
    flat = FlatForward(ours)
    ids = torch.randint(
        0, reference.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        want = reference(input_ids=ids[None]).logits[0]
        got = flat(ids, torch.arange(20), None, dense_attend).float()
        rows = flat(ids, torch.arange(20), torch.tensor([4, 19]), dense_attend)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.allclose(rows.float(), got[[4, 19]], atol=1e-5, rtol=1e-5)
    # the fused weights replaced the separate ones: only the slices' shapes are left
    names = {n for n, _ in ours.named_parameters()}
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    slices = [m for m in ours.modules() if isinstance(m, FusedSlice)]
    assert len(slices) == 5 * ours.config.num_hidden_layers


@pytest.mark.parametrize("family", sorted(LLM_FAMILIES))
def test_supported_families_take_our_forward_and_the_option_turns_it_off(llm_dirs, family):
    path = llm_dirs[family]
    held = {}
    for choice in ("auto", "transformers"):
        config = EngineConfig(pool_bytes=1 << 22, model_forward=choice)
        with LLMEngine({"m": path}, config) as eng:
            model = eng.llms["m"].model
            held[choice] = eng.store.report()[0]
            assert held[choice].forward == forward_path(model)
            outs = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6))
            held[choice + " tokens"] = outs[0].token_ids
    assert held["auto"].forward.startswith("trae")
    assert held["transformers"].forward.split(";")[0] == "transformers"
    packed = f"; linears: {linear_library()}"  # the library this host packs them with
    assert held["auto"].forward.endswith(packed) and held["transformers"].forward.endswith(packed)
    assert held["auto tokens"] == held["transformers tokens"]
    # fused and packed weights take what the separate packed ones took (layout padding aside)
    assert held["auto"].bytes <= 1.02 * held["transformers"].bytes


@pytest.mark.parametrize("family", sorted(LLM_FAMILIES))
def test_the_last_layer_runs_only_the_rows_that_sample(llm_dirs, family):
    """Past its K/V the last layer reaches the logits only through the rows that sample: a
    long prompt's chunks stop there (the first chunk samples no row, the last one row), yet
    every row's K/V is stored, so the greedy tokens are transformers'. A prompt scored for
    its logprobs keeps every row."""
    path = llm_dirs[family]
    prompt = torch.randint(5, 100, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    rows: dict[str, list[int]] = {"first": [], "last": []}
    config = EngineConfig(pool_bytes=1 << 22, max_num_batched_tokens=64, fast_linear=False)
    with LLMEngine({"m": path}, config) as eng:
        layers = eng.llms["m"].model.model.layers
        for name, layer in (("first", layers[0]), ("last", layers[-1])):
            seen = rows[name]
            layer.mlp.down_proj.register_forward_pre_hook(lambda m, a, s=seen: s.append(len(a[0])))
        outs = eng.generate([prompt], SamplingParams(max_tokens=6))
        assert rows["first"][:2] == [64, 36] and rows["last"][:2] == [0, 1]
        # a prompt's logprobs take every row's logits: the last layer keeps them all
        rows["last"].clear()
        eng.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
        assert rows["last"][:2] == [64, 36]
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    want = reference.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None
    )[0, 100:]
    assert outs[0].token_ids == want.tolist()


def test_an_unsupported_model_runs_through_transformers_and_says_why(tmp_path):
    path = build_llm(tmp_path / "gelu", "llama", hidden_act="gelu_pytorch_tanh")
    with LLMEngine({"m": path}, EngineConfig(pool_bytes=1 << 22)) as eng:
        report = eng.store.report()[0]
        outs = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6))
    assert report.forward.startswith("transformers: activation 'gelu_pytorch_tanh'")
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    want = reference.generate(
        torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, do_sample=False, eos_token_id=None
    )[0, 4:]
    assert outs[0].token_ids == want.tolist()


def test_model_forward_is_checked():
    with pytest.raises(ValueError, match="model_forward"):
        EngineConfig(model_forward="ours")


@pytest.mark.skipif(not zentorch_available(), reason="needs zentorch")
def test_zentorch_norms_match_torchs_and_take_empty_batches(capfd):
    """The fused add-and-norm puts the sum in the residual and the norm in the sublayer's
    output, as ours does; a step that samples no row normalizes nothing, silently."""
    from trae_groups.engine import flat_forward as ff

    torch.manual_seed(0)
    norm = nn.Module()
    norm.weight, norm.variance_epsilon = torch.randn(64), 1e-5
    hidden, residual = torch.randn(5, 64), torch.randn(5, 64)
    ours_residual, zen_residual = residual.clone(), residual.clone()
    want = ff._add_rms_norm(hidden.clone(), ours_residual, norm)
    got = ff._zen_add_rms_norm(hidden.clone(), zen_residual, norm)
    torch.testing.assert_close(zen_residual, ours_residual)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ff._zen_rms_norm(torch.randn(0, 64), norm).shape == (0, 64)
    assert "error" not in capfd.readouterr().err
