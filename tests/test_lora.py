"""Batched LoRA adapters on the engine against peft's merged model and transformers' generate.

Each family gets three random-init adapters made by peft itself (ranks 4, 8 and 16 with a
rank pattern; different target modules; rsLoRA and an alpha pattern on one), and every row
of a mixed batch (the base and all three, 32 requests at once) must produce exactly the
tokens peft's ``merge_and_unload()`` model generates for that adapter.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import LORA_VARIANTS, build_llm, build_lora, lora_reference
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.errors import ModelLoadError, RequestError
from trae_groups.engine.fast_linear import PackedLinear
from trae_groups.engine.flat_forward import FusedSlice
from trae_groups.engine.lora import LoraLinear
from trae_groups.engine.sampling import SamplingParams
from trae_groups.kernels.lora import LoraRows, lora_update, lora_update_reference, runs_of

MAX_NEW = 10


@pytest.fixture(scope="session")
def lora_sets(llm_dirs, tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """family -> (base folder, {adapter name: folder})."""
    root = tmp_path_factory.mktemp("loras")
    sets = {}
    for family in ("llama", "qwen3"):
        base = llm_dirs[family]
        adapters = {
            name: build_lora(root / family / name, base, seed=i, **kw)
            for i, (name, kw) in enumerate(LORA_VARIANTS.items())
        }
        sets[family] = (base, adapters)
    return sets


def prompts(n=8, seed=0, lo=2, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def engine(base: Path, adapters: dict[str, Path], **cfg) -> LLMEngine:
    cfg.setdefault("pool_bytes", 8 << 20)
    cfg.setdefault("fast_linear", False)
    eng = LLMEngine({"m": base}, EngineConfig(**cfg))
    for name, folder in adapters.items():
        eng.add_adapter("m", name, folder)
    return eng.start()


def mixed(ps, names) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt once per adapter and once for the base, interleaved."""
    pairs = [(p, a) for p in ps for a in [None, *names]]
    return [p for p, _ in pairs], [a for _, a in pairs]


def assert_parity(base, adapters, outs, ps, names, max_new=MAX_NEW):
    for prompt, name, out in zip(ps, names, outs, strict=True):
        folder = adapters[name] if name else None
        expected = lora_reference(base, folder, prompt, max_new)
        assert out.token_ids == expected, f"adapter {name}, prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_batch_of_base_and_three_adapters_matches_peft_merged(lora_sets, family):
    base, adapters = lora_sets[family]
    ps, names = mixed(prompts(seed=len(family)), list(adapters))
    assert len(ps) == 32
    # qwen3 runs on oneDNN-packed base linears: the adapters wrap whatever the base module is
    with engine(base, adapters, fast_linear=family == "qwen3") as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW), adapters=names)
        worker = eng.llms["m"]
        wrapped = [m for m in worker.model.modules() if isinstance(m, LoraLinear)]
        assert eng.pool.stats().used_pages == 0
    assert_parity(base, adapters, outs, ps, names)
    # every linear of the model is targeted by "wide" (all-linear but the lm_head)
    assert len(wrapped) == 7 * 2
    # q/k/v and gate/up are slices of the flat forward's fused projections; o/down packed
    kinds = {type(m.base_layer) for m in wrapped}
    assert FusedSlice in kinds, kinds
    if family == "qwen3":
        assert kinds == {FusedSlice, PackedLinear}, kinds
    # the adapters matter: no adapter's rows equal the base's for the same prompts
    by_name = {}
    for name, out in zip(names, outs, strict=True):
        by_name.setdefault(name, []).append(out.token_ids)
    for name in adapters:
        assert by_name[name] != by_name[None], name


def test_chunked_prefill_and_preemption_with_adapters(lora_sets, monkeypatch):
    from trae_groups.kernels import lora as kernel

    # steps of at most 7 rows: here every one takes the all-slots masked path (the mixed
    # batch test above takes the per-run one)
    monkeypatch.setattr(kernel, "DENSE_MIN_RUNS", 0)
    base, adapters = lora_sets["llama"]
    ps, names = mixed(prompts(n=3, seed=5), list(adapters))  # rows the first test checked
    # 512 B/token (2 layers x 2 kv heads x 16 dims x 4 B x 2); 12 pages of 16 tokens
    with engine(
        base,
        adapters,
        max_num_batched_tokens=7,
        pool_bytes=12 * 8192,
        enable_prefix_cache=False,
    ) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW), adapters=names)
        worker = eng.llms["m"]
        assert max(worker.counters.batch_tokens) <= 7
        assert worker.scheduler.num_preemptions > 0
        assert eng.pool.stats().used_pages == 0
    assert_parity(base, adapters, outs, ps, names)


def test_prefix_cache_is_shared_within_an_adapter_never_across(lora_sets):
    base, adapters = lora_sets["llama"]
    system = prompts(n=1, seed=9, lo=40, hi=41)[0]
    tails = prompts(n=3, seed=4, lo=2, hi=8)
    with engine(base, adapters) as eng:
        params = SamplingParams(max_tokens=MAX_NEW)
        first = eng.generate([system + tails[0]], params, adapters=["short"])[0]
        same = eng.generate([system + tails[1]], params, adapters=["short"])[0]
        other = eng.generate([system + tails[1]], params, adapters=["mlp"])[0]
        plain = eng.generate([system + tails[2]], params)[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens >= 32  # two full pages of the shared system prompt
    assert other.num_cached_tokens == 0  # "short"'s pages hold KV of another model
    assert plain.num_cached_tokens == 0
    assert_parity(
        base,
        adapters,
        [first, same, other, plain],
        [system + tails[0], system + tails[1], system + tails[1], system + tails[2]],
        ["short", "short", "mlp", None],
    )


def test_two_slots_three_adapters_load_on_demand_and_evict(lora_sets):
    base, adapters = lora_sets["qwen3"]
    ps, names = mixed(prompts(n=6, seed=5), list(adapters))
    # few sequences at once: an adapter's requests straggle, so slots change hands often
    with engine(base, adapters, max_loras=2, max_num_seqs=4) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW), adapters=names)
        slots = eng.llms["m"].adapters
        assert slots.num_evictions > 0
        assert slots.num_loads == 2 + slots.num_evictions
        assert len(slots.resident_names()) == 2
        loads = slots.num_loads
        # a second round after the first finished: the idle adapter missing is loaded again
        again = eng.generate(ps[:4], SamplingParams(max_tokens=MAX_NEW), adapters=names[:4])
        assert slots.num_loads > loads
        assert eng.pool.stats().used_pages == 0
    assert_parity(base, adapters, outs, ps, names)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:4]]


def test_adapter_bytes_are_reported(lora_sets):
    base, adapters = lora_sets["llama"]
    with engine(base, adapters, max_loras=2, max_lora_rank=16) as eng:
        slots = eng.llms["m"].adapters
        sizes = slots.adapter_bytes()
        assert slots.slot_bytes() == 0  # nothing resident until a request needs it
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2), adapters=["short"])
        resident = slots.slot_bytes()
    # "short": rank 4 on q_proj (64 -> 64) and v_proj (64 -> 32), 2 layers, float32
    assert sizes["short"] == 2 * 4 * 4 * ((64 + 64) + (64 + 32))
    assert sizes["wide"] > sizes["mlp"] > sizes["short"]
    # the slots of the linears "short" targets: 2 slots x rank 16, zero-padded
    assert resident == 2 * 2 * 16 * 4 * ((64 + 64) + (64 + 32))


def _variant(folder: Path, source: Path, edit) -> Path:
    shutil.copytree(source, folder)
    edit(folder)
    return folder


def test_bad_adapter_folders_are_refused_and_the_engine_keeps_serving(lora_sets, tmp_path):
    import json

    import peft
    from transformers import AutoModelForCausalLM

    base, adapters = lora_sets["llama"]
    small = build_llm(tmp_path / "small", "llama", hidden_size=32, head_dim=8)
    wrong_base = build_lora(tmp_path / "wrong-base", small, **LORA_VARIANTS["short"])
    loha = tmp_path / "loha"
    peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), peft.LoHaConfig(target_modules=["q_proj"])
    ).save_pretrained(loha)

    def truncate(folder):
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    def set_config(**changes):
        def edit(folder):
            config = json.loads((folder / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))

        return edit

    def drop_config(folder):
        (folder / "adapter_config.json").unlink()

    cases = {
        wrong_base: "do not fit the base's 64 -> 64 linear",
        loha: "a LOHA adapter; only LORA is served",
        _variant(tmp_path / "cut", adapters["short"], truncate): "corrupt adapter_model",
        _variant(tmp_path / "dora", adapters["short"], set_config(use_dora=True)): "DoRA",
        _variant(tmp_path / "nocfg", adapters["short"], drop_config): "no adapter_config.json",
        tmp_path / "missing": "no such adapter folder",
        adapters["wide"]: "down_proj has rank 12; this model takes at most 8 (max_lora_rank)",
    }
    with engine(base, {"short": adapters["short"]}, max_lora_rank=8) as eng:
        for folder, message in cases.items():
            with pytest.raises(ModelLoadError, match=re.escape(message)):
                eng.add_adapter("m", "bad", folder)
        with pytest.raises(RequestError, match="no adapter 'nope'"):
            eng.generate([[5, 6]], SamplingParams(max_tokens=2), adapters=["nope"])
        outs = eng.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=4), adapters=[None, "short"])
        assert all(o.finished and o.finish_reason == "length" for o in outs)
        assert eng.llms["m"].adapters.names() == ["short"]
        assert eng.pool.stats().used_pages == 0


def test_an_adapter_that_cannot_be_read_when_needed_fails_its_requests_only(lora_sets, tmp_path):
    base, adapters = lora_sets["llama"]
    gone = shutil.copytree(adapters["mlp"], tmp_path / "gone")
    with engine(base, {"short": adapters["short"], "gone": gone}) as eng:
        (gone / "adapter_model.safetensors").unlink()  # after registration, before any use
        outs = eng.generate(
            [[5, 6, 7]] * 3,
            SamplingParams(max_tokens=4, ignore_eos=True),
            adapters=["gone", "short", None],
        )
        assert outs[0].finish_reason == "error"
        assert "adapter 'gone' could not be loaded" in outs[0].error
        assert [o.finish_reason for o in outs[1:]] == ["length", "length"]
        assert eng.pool.stats().used_pages == 0


def test_an_adapter_in_use_cannot_be_removed(lora_sets):
    import asyncio

    base, adapters = lora_sets["llama"]
    with engine(base, {"short": adapters["short"]}) as eng:

        async def go():
            stream = eng.add_request(
                [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), adapter="short"
            )
            async for _ in stream:
                with pytest.raises(RequestError, match="still serves 1 request"):
                    eng.remove_adapter("m", "short")
                break
            await stream.final()  # closing the stream aborted it

        asyncio.run(go())
        eng.remove_adapter("m", "short")
        with pytest.raises(RequestError, match="no adapter 'short'"):
            eng.generate([[5, 6]], SamplingParams(max_tokens=2), adapters=["short"])
        # a new registration under the same name is a new adapter (fresh prefix-cache salt)
        again = eng.add_adapter("m", "short", adapters["mlp"])
        out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=MAX_NEW), adapters=["short"])
        assert again.path == str(adapters["mlp"])
    assert out[0].token_ids == lora_reference(base, adapters["mlp"], [5, 6, 7], MAX_NEW)


@pytest.mark.parametrize("path", ["runs", "dense"])
def test_grouped_update_matches_the_row_by_row_oracle(path, monkeypatch):
    from trae_groups.kernels import lora as kernel

    # the per-run slices, or (many short runs) every slot's A at once, other slots masked
    monkeypatch.setattr(kernel, "DENSE_MIN_RUNS", 10**6 if path == "runs" else 0)
    torch.manual_seed(0)
    slots, rank, d_in, d_out = 3, 8, 24, 40
    a = torch.randn(slots, rank, d_in)
    b = torch.randn(slots, rank, d_out)
    ranks = [8, 5, 0]  # slot 1 uses rank 5 (rest zero-padded), slot 2 skips this linear
    a[1, 5:] = b[1, 5:] = 0
    a[2] = b[2] = 0
    per_row = [1, -1, 0, 0, 1, 1, 2, 2, -1, 0, 1]  # runs of a slot, base rows between
    assert runs_of(per_row) == ((1, 0, 1), (0, 2, 4), (1, 4, 6), (2, 6, 8), (0, 9, 10), (1, 10, 11))
    x, y = torch.randn(len(per_row), d_in), torch.randn(len(per_row), d_out)
    slots_t = torch.tensor(per_row)
    got = lora_update(y.clone(), x, a, b, ranks, LoraRows(slots_t, runs_of(per_row)))
    torch.testing.assert_close(got, lora_update_reference(y, x, a, b, slots_t))
    with pytest.raises(ValueError, match="do not fit"):
        lora_update(y, x[:, :5], a, b, ranks, LoraRows(slots_t, runs_of(per_row)))


def test_compiled_decode_keeps_base_steps_compiled_and_runs_adapter_steps_eagerly(lora_sets):
    base, adapters = lora_sets["llama"]
    ps = prompts(n=4, seed=5)  # rows the first test checked
    # every row of the middle run on an adapter: the loop thread may take its requests
    # over two steps, and a step of base rows only would rightly run compiled
    names = ["short", "mlp", "short", "mlp"]
    params = SamplingParams(max_tokens=MAX_NEW)
    with engine(base, adapters, compile=True, compile_batch_sizes=(4,)) as eng:
        runner = eng.llms["m"].runner
        plain = eng.generate(ps, params)
        compiled = runner.compiled.steps
        assert compiled > 0  # base-only decode steps ran compiled
        mixed = eng.generate(ps, params, adapters=names)  # wraps the linears on first use
        assert runner.compiled.steps == compiled  # steps with adapter rows ran eagerly
        again = eng.generate(ps, params)
        assert runner.compiled is not None and runner.compiled.steps > compiled  # still compiled
    assert_parity(base, adapters, plain + mixed + again, ps * 3, [None] * 4 + names + [None] * 4)
