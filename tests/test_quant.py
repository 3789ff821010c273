"""int8 and bf16 LLM weights against float32, the hardware choice and the accuracy gate, on tiny
real models loaded through the weight store."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from trae_groups.engine import engine as engine_module
from trae_groups.engine import quant
from trae_groups.engine.accuracy_gate import check_llm
from trae_groups.engine.auto_weights import candidates, load_auto
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.fast_linear import PackedLinear, packable_dtypes
from trae_groups.engine.hardware import Hardware
from trae_groups.engine.llm_runner import ATTN_NAME
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.weights import WeightStore, tensor_slots
from trae_groups.kernels import onednn_calls

needs_int8 = pytest.mark.skipif(not quant.int8_available(), reason="no fbgemm/x86 int8 kernels")
VNNI_BF16 = Hardware("cpu", frozenset({"avx512_vnni", "avx512_bf16"}))
PROMPTS = [[5 + i, 17, 40 + 3 * i, 9, 100 + i, 11, 7 * i + 3] for i in range(8)]


@needs_int8
@pytest.mark.parametrize("shape", [(64,), (5, 64), (2, 3, 64)])
def test_int8_linear_is_a_drop_in_for_linear_and_packed_linear(shape):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).requires_grad_(False)
    x = torch.randn(shape)
    want = linear(x)
    got = quant.Int8Linear.from_linear(linear)(x)
    assert got.shape == want.shape
    # per-channel int8 weights, 8-bit activations (7-bit without VNNI): 1-2% of the scale
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())
    if torch.float32 in packable_dtypes():
        packed = PackedLinear.from_linear(linear)(x)
        torch.testing.assert_close(got, packed, atol=0.02 * float(want.abs().max()), rtol=0)
    with pytest.raises(TypeError, match="float32"):
        quant.Int8Linear.from_linear(linear)(x.bfloat16())


def _tokens_per_step_logits(model, prompts):
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([p])).logits[0].float() for p in prompts]


def _teacher_forced(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor(PROMPTS)).logits.float()


@needs_int8
def test_int8_llm_weights_are_counted_and_close_to_float32(llama_dir):
    store = WeightStore()
    ref = store.load(llama_dir, "generate")
    q8 = store.load(llama_dir, "generate", quantize="int8")
    layer = q8.model.model.layers[0]
    assert type(layer.self_attn.q_proj) is quant.Int8Linear
    assert type(q8.model.lm_head) is quant.Int8Linear
    assert type(layer.mlp.down_proj) is nn.Linear  # outlier inputs: kept float
    # the int8 weights are found by the store's per-module walk, so their bytes are counted
    int8 = {id(m): m for m in q8.model.modules() if isinstance(m, quant.Int8Linear)}
    walked = sum(t.numel() * t.element_size() for _, kind, _, t in tensor_slots(q8.model)
                 if kind == "held" and t.dtype == torch.qint8)  # fmt: skip
    assert walked == sum(m.in_features * m.out_features for m in int8.values())
    reports = {r.quantize: r for r in store.report()}
    assert reports["int8"].bytes < reports[None].bytes
    want, got = _teacher_forced(ref.model), _teacher_forced(q8.model)
    # measured: 2.9% of the logits' norm, top-1 agreement 96% (a random model: small margins)
    assert float((got - want).norm() / want.norm()) < 0.06
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_bf16_llm_weights_are_close_to_float32(llama_dir):
    store = WeightStore()
    want = _teacher_forced(store.load(llama_dir, "generate").model)
    got = _teacher_forced(store.load(llama_dir, "generate", dtype=torch.bfloat16).model)
    # measured: 1.0% of the logits' norm, top-1 agreement 98%
    assert float((got - want).norm() / want.norm()) < 0.02
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.95


def _engine_tokens(path, **config) -> tuple[list[list[int]], LLMEngine]:
    eng = LLMEngine({"m": path}, EngineConfig(pool_bytes=8 << 20, **config))
    with eng:
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    return [o.token_ids for o in outs], eng


@needs_int8
@pytest.mark.parametrize("config", [{"quantization": "int8"}, {"dtype": "bfloat16"}])
def test_engine_serves_compressed_weights_with_greedy_agreement(llama_dir, config):
    want, _ = _engine_tokens(llama_dir)
    got, eng = _engine_tokens(llama_dir, **config)
    worker = eng.llm("m")
    if "quantization" in config:
        assert type(worker.model.lm_head) is quant.Int8Linear
        assert worker.kv.layout.dtype == torch.float32  # int8 linears take float32 activations
    else:
        assert worker.kv.layout.dtype == torch.bfloat16
    # first greedy token equal for most prompts (a random model's margins are ~0.1 logit, so
    # later tokens drift once one differs); measured 8/8 for int8, 7/8 for bf16
    assert sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) >= 6


def test_auto_choice_is_a_function_of_the_hardware(monkeypatch):
    monkeypatch.setattr(onednn_calls, "bf16_panels_built", lambda: True)  # as on an AVX2 CPU

    def labels(hw, **kw):
        return [c.label for c in candidates(hw, "generate", **kw)]

    both = {"dtype_auto": True, "quant_auto": True}
    assert labels(VNNI_BF16, **both) == ["int8", "bfloat16", "float32"]
    assert labels(Hardware("cpu", frozenset({"avx512_vnni"})), **both) == ["int8", "float32"]
    assert labels(Hardware("cpu", frozenset({"amx_bf16"})), **both) == ["bfloat16", "float32"]
    assert labels(Hardware("cpu"), **both) == ["float32"]
    # no bf16 matmuls, but AVX2 without AVX-512: bf16 weights on our panels (a Zen 3 EPYC)
    avx2 = Hardware("cpu", frozenset({"avx2", "fma"}))
    assert labels(avx2, **both) == ["bfloat16", "float32"]
    assert labels(Hardware("cpu", avx2.cpu_flags | {"avx512f"}), **both) == ["float32"]
    with monkeypatch.context() as no_compiler:  # the panels not built: float32 copies, no gain
        no_compiler.setattr(onednn_calls, "bf16_panels_built", lambda: False)
        assert labels(avx2, **both) == ["float32"]
    assert labels(Hardware("cuda", cuda_capability=(9, 0)), **both) == ["bfloat16", "float32"]
    assert labels(Hardware("cuda", cuda_capability=(7, 5)), **both) == ["float16", "float32"]
    # only one of the two "auto": the other stays as the graph says
    assert labels(VNNI_BF16, dtype_auto=False, quant_auto=True) == ["int8", "float32"]
    assert labels(VNNI_BF16, dtype_auto=True, quant_auto=False) == ["bfloat16", "float32"]
    assert labels(VNNI_BF16, dtype_auto=False, quant_auto=True, base=torch.bfloat16) == [
        "int8",
        "bfloat16",
    ]
    assert labels(VNNI_BF16, **both) == labels(VNNI_BF16, **both)  # same input, same answer


@needs_int8
def test_auto_keeps_a_candidate_that_passes_the_gate(llama_dir):
    store = WeightStore()
    hw = Hardware("cpu", frozenset({"avx512_bf16"}))
    loaded, decision = load_auto(store, llama_dir, "generate", hw, dtype_auto=True,
                                 quant_auto=True, bound=0.05)  # fmt: skip
    assert decision.chosen.label == "bfloat16"
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    assert "gate passed: perplexity" in loaded.choice
    # the float32 reference used by the gate is released: only the chosen instance is held
    assert [(r.dtype, r.quantize) for r in store.report()] == [("bfloat16", None)]
    assert store.report()[0].choice == loaded.choice


def test_auto_reuses_an_instance_already_serving_without_gating_it_again(llama_dir):
    """A second graph (or node, or version) with dtype auto on a folder the store already
    holds gets that instance: its forward may be ours by then (fused projections), which the
    gate's transformers forward cannot run, and its weights were decided already."""
    from trae_groups.engine.flat_forward import FlatForward

    store = WeightStore()
    hw = Hardware("cpu", frozenset({"avx512_bf16"}))
    first, _ = load_auto(store, llama_dir, "generate", hw, dtype_auto=True, quant_auto=False)
    first.model.trae_flat = FlatForward(first.model)  # what preparing it for the engine does
    again, decision = load_auto(store, llama_dir, "generate", hw, dtype_auto=True,
                                quant_auto=False)  # fmt: skip
    assert again is first and first.loads == 2
    assert decision.chosen.label == "bfloat16" and decision.why == first.choice
    assert [(r.dtype, r.quantize) for r in store.report()] == [("bfloat16", None)]


@needs_int8
def test_gate_refuses_a_broken_quantization_and_falls_back(llama_dir, monkeypatch, caplog):
    real = quant.quantize_weight

    def broken(weight):  # a scale 30x too small: almost every weight clips to +-127
        q = real(weight)
        return torch.quantize_per_channel(
            q.dequantize().clamp(-1e-3, 1e-3) * 30, q.q_per_channel_scales(),
            q.q_per_channel_zero_points(), 0, torch.qint8,
        )  # fmt: skip

    monkeypatch.setattr(quant, "quantize_weight", broken)
    store = WeightStore()
    with caplog.at_level(logging.WARNING, logger="trae_groups.engine"):
        loaded, decision = load_auto(store, llama_dir, "generate", VNNI_BF16, dtype_auto=False,
                                     quant_auto=True, attn_implementation=ATTN_NAME)  # fmt: skip
    assert decision.chosen.label == "float32"
    assert loaded.quantize is None and type(loaded.model.lm_head) is nn.Linear
    assert "int8 refused by the accuracy gate" in caplog.text
    assert loaded.choice.startswith("int8 refused (perplexity")
    assert [(r.dtype, r.quantize) for r in store.report()] == [("float32", None)]
    # the gate ran the paged-attention model through SDPA and put it back
    assert loaded.model.config._attn_implementation == ATTN_NAME


def test_gate_passes_identical_weights_and_measures_a_drop(llama_dir):
    store = WeightStore()
    ref = store.load(llama_dir, "generate")
    same = check_llm(ref.model, ref.model, ref.tokenizer)
    assert same.passed and same.drop == 0.0
    other = store.load(llama_dir, "generate", dtype=torch.bfloat16)
    result = check_llm(ref.model, other.model, ref.tokenizer, bound=1e-9)
    assert not result.passed and result.drop > 0


@needs_int8
@pytest.mark.parametrize(("flags", "reduced"), [(set(), True), ({"avx512_vnni"}, False),
                                                ({"avx_vnni"}, False), ({"amx_int8"}, False)])  # fmt: skip
def test_activations_are_7_bit_where_the_cpu_has_no_vnni(monkeypatch, flags, reduced):
    """Without VNNI the kernel's 16-bit sums saturate on 8-bit activations (an AVX2 EPYC put a
    64-wide output 12-36% off): the default takes 7 bits there, 8 where dot products are exact."""
    from trae_groups.engine import hardware

    monkeypatch.setattr(hardware, "detect", lambda device="cpu": Hardware("cpu", frozenset(flags)))
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))
    assert quant.quantize_linears(model) == 2
    assert [m.reduce_range for m in model] == [reduced, reduced]


def test_bf16_without_bf16_instructions_is_said_at_start_up(llama_dir, monkeypatch, caplog):
    # bf16 matmuls without AVX512-BF16 or AMX run oneDNN's reference kernel, many times slower
    # than float32 (where our AVX2 panels do not take them): an explicit bfloat16 there gets a
    # warning naming the model, auto none
    assert Hardware("cpu").slow_dtype(torch.bfloat16)
    assert Hardware("cpu", frozenset({"avx512f", "avx2", "fma"})).slow_dtype(torch.bfloat16)
    assert Hardware("cpu", frozenset({"amx_bf16"})).slow_dtype(torch.bfloat16) is None
    # AVX2 without AVX-512: bf16 weights on our panels, faster than float32 there
    assert Hardware("cpu", frozenset({"avx2", "fma"})).slow_dtype(torch.bfloat16) is None
    assert Hardware("cpu").slow_dtype(torch.float32) is None
    assert Hardware("cuda", cuda_capability=(7, 5)).slow_dtype(torch.bfloat16) is None
    monkeypatch.setattr(engine_module, "detect", lambda device="cpu": Hardware("cpu"))
    with caplog.at_level(logging.WARNING, logger=engine_module.log.name):
        LLMEngine({"m": llama_dir}, EngineConfig(dtype="bfloat16", pool_bytes=8 << 20)).shutdown()
        assert "model m: cpu without int8/bf16 instructions: bfloat16 matmuls" in caplog.text
        caplog.clear()
        LLMEngine({"m": llama_dir}, EngineConfig(dtype="float32", pool_bytes=8 << 20)).shutdown()
        assert "bfloat16 matmuls" not in caplog.text
