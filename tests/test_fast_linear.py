"""Packed oneDNN linears must be a drop-in for nn.Linear on real transformers models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    Qwen3Config,
)

from trae_groups.engine import fast_linear
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.fast_linear import (
    UPCAST_ROWS,
    PackedLinear,
    fast_linear_available,
    linear_library,
    pack_linears,
    packable_dtypes,
    widened_dtypes,
    zentorch_available,
)
from trae_groups.kernels import onednn_calls

pytestmark = pytest.mark.skipif(not fast_linear_available(), reason="needs oneDNN (mkldnn)")

TINY = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def _config(arch: str, tied: bool):
    if arch == "qwen3":
        return Qwen3Config(**TINY, tie_word_embeddings=tied)
    return LlamaConfig(**TINY, tie_word_embeddings=tied)


def _n_linears(model: nn.Module) -> int:
    return len({id(m) for m in model.modules() if type(m) is nn.Linear})


needs_zentorch = pytest.mark.skipif(not zentorch_available(), reason="zentorch not installed")
LIBRARIES = ["onednn", pytest.param("zentorch", marks=needs_zentorch)]
MODELS = [("qwen3", True), ("qwen3", False), ("llama", False)]


@pytest.fixture(
    scope="module",
    params=[(*m, lib) for m in MODELS for lib in ("onednn", "zentorch")],
    ids=lambda p: "-".join(map(str, p)),
)
def model_pair(request, tmp_path_factory):
    """A tiny random model saved and reloaded twice: one plain reference, one packed (by
    oneDNN, or by zentorch where it is installed)."""
    arch, tied, library = request.param
    if library == "zentorch" and not zentorch_available():
        pytest.skip("zentorch not installed")
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(_config(arch, tied))
    path = tmp_path_factory.mktemp(f"{arch}_tied{tied}_{library}")
    built.save_pretrained(path)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = _n_linears(packed)
    n = pack_linears(packed, library=library)
    assert {m.library for m in packed.modules() if isinstance(m, PackedLinear)} == {library}
    return plain, packed, n, expected, tied


def test_every_linear_packed_including_lm_head(model_pair):
    _, packed, n, expected, _ = model_pair
    # 7 projections per layer x 2 layers + lm_head.
    assert n == expected == 15
    assert isinstance(packed.lm_head, PackedLinear)
    assert _n_linears(packed) == 0


def test_input_embedding_intact(model_pair):
    plain, packed, _, _, tied = model_pair
    emb = packed.get_input_embeddings()
    assert isinstance(emb, nn.Embedding)
    assert torch.equal(emb.weight, plain.get_input_embeddings().weight)
    if tied:
        assert torch.equal(plain.lm_head.weight, emb.weight)


@pytest.mark.parametrize("seq_len", [1, 7, 33])
def test_logits_match_plain(model_pair, seq_len):
    plain, packed, *_ = model_pair
    ids = torch.randint(0, 1000, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    with torch.no_grad():
        want = plain(ids).logits
        got = packed(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_logits_match_batched_left_padding(model_pair):
    plain, packed, *_ = model_pair
    ids = torch.randint(1, 1000, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    with torch.no_grad():
        want = plain(ids, attention_mask=mask).logits
        got = packed(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)


def test_greedy_generate_equal(model_pair):
    plain, packed, *_ = model_pair
    cfg = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=-1, pad_token_id=0)
    gen = torch.Generator().manual_seed(2)
    for length in (5, 17, 40):
        ids = torch.randint(1, 1000, (1, length), generator=gen)
        want = plain.generate(ids, generation_config=cfg)
        got = packed.generate(ids, generation_config=cfg)
        assert got.shape == (1, length + 20)
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 2, 3, 31, 64, 65, 512])
def test_packed_linear_any_row_count(rows):
    torch.manual_seed(rows)
    lin = nn.Linear(48, 80)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x[None]), lin(x[None]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_multiplied_in_c_give_the_ops_bits(dtype, bias):
    """Rows onednn_calls.c multiplies from the packed buffer itself (float32 panels, bf16 on AMX
    tiles: decode steps' lm_head and the Python loop's decode rows; on AVX2 CPUs float32 prompt
    rows too) give the op's bits, for any leading shape, and past its limit the op runs."""
    if dtype not in packable_dtypes():
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    torch.manual_seed(0)
    lin = nn.Linear(1104, 192, bias=bias).to(dtype)  # k past 1,024: oneDNN sums it in blocks
    packed = PackedLinear.from_linear(lin)
    # prompt rows (300) for float32 only: bf16 rows from UPCAST_ROWS on multiply in float32
    for rows in (1, 5, 32, 33, 64, 65) + ((300,) if dtype == torch.float32 else ()):
        x = torch.randn(rows, 1104).to(dtype)
        want = torch.ops.mkldnn._linear_pointwise(
            x, packed.packed_weight, packed.bias, "none", [], ""
        )
        with torch.no_grad():
            assert torch.equal(packed(x), want), rows
            assert torch.equal(packed(x.view(1, rows, -1))[0], want), rows
    own = packed._own_rows
    if dtype == torch.float32 and onednn_calls.own_rows_limit(torch.float32):
        assert own is not None and own.max_rows == onednn_calls.own_rows_limit(torch.float32)


@pytest.mark.parametrize("hint", [None, 1, 8, 512])
def test_batch_hint_does_not_change_results(hint):
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=False)
    packed = PackedLinear.from_linear(lin, batch_hint=hint)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)


def test_shared_linear_packed_once():
    lin = nn.Linear(8, 8)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    assert pack_linears(model) == 1
    assert model[0] is model[2]
    assert isinstance(model[0], PackedLinear)


def test_unsupported_dtype_left_plain():
    model = nn.Sequential(nn.Linear(8, 8).double(), nn.Linear(8, 8))
    assert pack_linears(model) == 1
    assert type(model[0]) is nn.Linear
    assert isinstance(model[1], PackedLinear)


def test_wrong_input_dtype_raises():
    packed = PackedLinear.from_linear(nn.Linear(8, 8))
    with pytest.raises(TypeError):
        packed(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="CPU lacks oneDNN bf16")
def test_bf16_packed_matches_plain_bf16():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(packed(x).float(), lin(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="CPU lacks oneDNN bf16")
@pytest.mark.parametrize("rows", [1, UPCAST_ROWS - 1, UPCAST_ROWS, 3 * UPCAST_ROWS])
def test_bf16_rows_past_the_upcast_threshold_match_float32(rows):
    """Below UPCAST_ROWS the packed bf16 weight multiplies, from it on a float32 copy of the
    plain one: both round to bf16 from float32 accumulation, within a bf16 step of float32."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        got = packed(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1e-2)
    # the plain weight the large rows read is held, so memory accounting counts it
    assert [name for name, _ in packed.held_tensors()] == ["packed_weight", "plain_weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [256, 200])
def test_widened_weights_give_the_float32_product_rounded_once(dtype, bias, out_features):
    """Where oneDNN has no fast matmul for a half-precision dtype (bf16 without AVX512-BF16 or
    AMX), the linear multiplies in float32: rows of any count give the float32 linear's product
    of the same values, bit for bit, rounded to the dtype once. A bf16 weight of whole panels
    (256 outputs) stays bf16 where our AVX2 panels read it; otherwise a float32 copy is held."""
    if dtype not in widened_dtypes():
        pytest.skip(f"{dtype} weights are packed as they are on this CPU")
    torch.manual_seed(0)
    lin = nn.Linear(1104, out_features, bias=bias).to(dtype)
    packed = PackedLinear.from_linear(lin)
    wide = PackedLinear(lin.weight.float(), None if lin.bias is None else lin.bias.float())
    assert (packed.dtype, packed.weight_dtype, packed.widened) == (dtype, torch.float32, True)
    panels = dtype == torch.bfloat16 and onednn_calls.bf16_panels_take(out_features)
    assert packed.bf16_panels == panels
    assert out_features % 64 == 0 or not panels
    assert [name for name, _ in packed.held_tensors()] == ["packed_weight"]
    assert packed.packed_weight.dtype == (torch.bfloat16 if panels else torch.float32)
    for rows in (1, 7, 65, 300):
        x = torch.randn(rows, 1104).to(dtype)
        with torch.no_grad():
            got, want = packed(x.view(1, rows, -1))[0], wide(x.float()).to(dtype)
            assert got.dtype == dtype
            # the bf16 panels sum k in blocks of 1,024, the k block oneDNN's float32 kernels
            # took on the AVX2 EPYC; where the op's proof found another, only the values agree
            if not panels or _k_block_found(wide, rows) == 1024:
                assert torch.equal(got, want), rows
            reference = F.linear(
                x.float(), lin.weight.float(), None if not bias else lin.bias.float()
            )
        torch.testing.assert_close(got.float(), reference, atol=0.1, rtol=0.02)
    with pytest.raises(TypeError):
        packed(torch.randn(2, 1104))  # float32 rows into a half-precision model's linear


def _k_block_found(packed: PackedLinear, rows: int) -> int:
    """The k block the float32 panels proved at this row count (onednn_calls.c's ``found``)."""
    own = packed._own_rows
    if not own:
        return 0
    return own._handles._weights[-1].found[min(rows, onednn_calls.F32_SLOTS - 1)]


@pytest.mark.skipif(not onednn_calls.bf16_panels_take(64), reason="no AVX2 build's bf16 panels")
def test_bf16_panels_give_each_row_the_same_bits_whatever_rows_come_with_it():
    """The bf16 panels' product of a row does not depend on the rows beside it (chunks of 2 MB
    of rows, blocks of 6) or on the row stride, and is the float32 product rounded once."""
    torch.manual_seed(0)
    weight = torch.randn(128, 1536).bfloat16()
    panels = onednn_calls.bf16_panels_of(weight)
    assert panels.shape == (2, 1536, 64)
    x = torch.randn(700, 1536).bfloat16()  # a copy of 700 rows at k 1,536 spans two chunks
    bias = torch.randn(128)
    every = onednn_calls.bf16_panels(x, panels, bias)
    assert every.dtype == torch.bfloat16
    for rows in (slice(0, 1), slice(3, 10), slice(0, 64), slice(600, 700)):
        assert torch.equal(onednn_calls.bf16_panels(x[rows], panels, bias), every[rows])
    apart = torch.cat((x, x), dim=1)[:, :1536]  # rows 3,072 apart: the row stride is honoured
    assert torch.equal(onednn_calls.bf16_panels(apart, panels, bias), every)
    want = (x.float() @ weight.float().T + bias).bfloat16()
    torch.testing.assert_close(every.float(), want.float(), atol=0.05, rtol=0.02)
    with pytest.raises(ValueError):
        onednn_calls.bf16_panels(x.float(), panels, None)


def test_widened_dtypes_are_the_half_precisions_onednn_cannot_pack():
    assert widened_dtypes() == ({torch.bfloat16, torch.float16} - packable_dtypes())
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    assert pack_linears(model) == 2  # packed as they are, or widened
    assert all(m.widened == (torch.bfloat16 in widened_dtypes()) for m in model)


def test_float32_keeps_no_plain_weight():
    packed = PackedLinear.from_linear(nn.Linear(8, 4))
    assert packed.plain_weight is None
    assert [name for name, _ in packed.held_tensors()] == ["packed_weight"]


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="CPU lacks oneDNN bf16")
@pytest.mark.parametrize(
    ("flags", "vendor", "keeps_plain"),
    [
        ({"avx512_bf16"}, "GenuineIntel", True),
        ({"avx512_bf16", "amx_bf16"}, "GenuineIntel", False),
        ({"avx512_bf16"}, "AuthenticAMD", False),
    ],
)
def test_plain_weights_are_kept_only_where_upcasting_pays(monkeypatch, flags, vendor, keeps_plain):
    """With AMX, or AVX512-BF16 on AMD, bf16 matmuls are the fast path at every row count: no
    plain copy is held; Intel's AVX512-BF16 alone upcasts large row counts."""
    from trae_groups.engine import hardware

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: vendor)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    assert pack_linears(model, library="onednn") == 2
    assert all((m.plain_weight is not None) == keeps_plain for m in model)


@pytest.mark.parametrize(
    ("flags", "want"),
    [(set(), {torch.float32}), ({"avx512_bf16"}, {torch.float32, torch.bfloat16})],
)
def test_zentorch_takes_bf16_weights_only_where_the_cpu_has_bf16_dot_products(
    monkeypatch, flags, want
):
    from trae_groups.engine import hardware

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset(flags))
    assert set(fast_linear.zentorch_dtypes()) == want


@pytest.mark.skipif(
    not (fast_linear.zentorch_available() and torch.bfloat16 in fast_linear.zentorch_dtypes()),
    reason="needs zentorch and a CPU with AVX512-BF16",
)
def test_zentorch_bf16_linear_matches_a_float32_reference():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    packed = PackedLinear(weight, bias, library="zentorch")
    assert packed.library == "zentorch"
    for rows in (1, 5, 130):
        x = torch.randn(rows, 64).bfloat16()
        want = F.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(packed(x).float(), want, atol=0.1, rtol=0.02)


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("choice", "vendor", "installed", "vector", "dtype", "want"),
    [
        ("auto", "AuthenticAMD", True, "avx512", BF16, "zentorch"),
        ("auto", "AuthenticAMD", True, "avx512", F32, "onednn"),  # oneDNN's faster on Zen 5
        ("auto", "AuthenticAMD", True, "avx2", F32, "zentorch"),  # no panels built
        ("auto", "AuthenticAMD", True, "avx2 panels", F32, "onednn"),  # ours on oneDNN's layout
        ("auto", "AuthenticAMD", True, "avx2 panels", BF16, "onednn"),
        ("auto", "GenuineIntel", True, "avx512", BF16, "onednn"),
        ("auto", "AuthenticAMD", False, "avx512", BF16, "onednn"),
        ("onednn", "AuthenticAMD", True, "avx512", BF16, "onednn"),
        ("zentorch", "GenuineIntel", True, "avx512", F32, "zentorch"),
        ("zentorch", "AuthenticAMD", True, "avx2 panels", F32, "zentorch"),
        ("zentorch", "AuthenticAMD", False, "avx512", F32, ValueError),
        ("mkl", "AuthenticAMD", True, "avx512", F32, ValueError),
    ],
)
def test_linear_library_is_chosen_by_cpu_dtype_and_what_is_installed(
    monkeypatch, choice, vendor, installed, vector, dtype, want
):
    from trae_groups.engine import hardware

    flags = {"avx512": {"avx512f", "avx512_bf16"}}.get(vector, {"avx2", "fma"})
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(fast_linear, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(fast_linear, "zentorch_available", lambda: installed)
    monkeypatch.setattr(fast_linear, "_avx2_panels", lambda: vector == "avx2 panels")
    if want is ValueError:
        with pytest.raises(ValueError, match="linear_library"):
            linear_library(choice, dtype)
    else:
        assert linear_library(choice, dtype) == want


def test_engine_config_checks_linear_library():
    with pytest.raises(ValueError, match="linear_library: must be one of"):
        EngineConfig(linear_library="mkl")


@pytest.mark.parametrize("library", LIBRARIES)
def test_engine_config_linear_library_reaches_the_model(tmp_path, library):
    """EngineConfig.linear_library decides which library packs a served model's linears, and
    greedy tokens match transformers' generate either way."""
    from trae_groups.engine.engine import LLMEngine
    from trae_groups.engine.flat_forward import forward_path
    from trae_groups.engine.sampling import SamplingParams

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("llama", False)).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [5, 17, 40, 9, 100, 11, 7]
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        want = reference.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt) :]
    config = EngineConfig(pool_bytes=8 << 20, linear_library=library)
    with LLMEngine({"m": tmp_path}, config).start() as engine:
        model = engine.llms["m"].runner.model
        libraries = {m.library for m in model.modules() if isinstance(m, PackedLinear)}
        path = forward_path(model)
        out = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert libraries == {library}
    assert path == f"trae (fused projections); linears: {library}"  # as trae model info says
    assert out.token_ids == want.tolist()
