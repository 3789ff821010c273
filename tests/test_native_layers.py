"""The flat forward's layer stack in one native call (trae_kernels/zen_layers.py) gives the
Python loop's bits: the same kernels with the same arguments, from C. Where it runs (bf16 or
float32 weights packed for zentorch or oneDNN, or bf16 weights on our AVX2 panels, with the
AVX-512 or the AVX2 kernels built) every family's steps are compared logit for logit with the
loop in each dtype it takes and with each linear library, and a generation token for token and
logprob for logprob."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from test_engine import engine

from conftest import LLM_FAMILIES, build_llm
from trae_groups.engine import native_layers
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.fast_linear import linear_library, widened_dtypes
from trae_groups.engine.flat_forward import forward_path
from trae_groups.engine.sampling import SamplingParams
from trae_groups.kernels import attention, cpu_native, zen_calls, zen_layers

pytestmark = pytest.mark.skipif(
    zen_layers.library() is None,
    reason="needs the AVX-512 kernels and zentorch's shims, or the AVX2 kernels",
)
# head size 64 and an MLP width of 16s: what the native rotation and SiLU take
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_hidden_layers=3)  # fmt: skip


@pytest.fixture(scope="module")
def wide_llms(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wide-llms")
    return {family: build_llm(root / family, family, **WIDE) for family in LLM_FAMILIES}


@contextlib.contextmanager
def stepped(path, dtype="bfloat16", **cfg) -> Iterator:
    """An engine's worker that the test steps itself (no loop thread)."""
    eng = LLMEngine({"m": path}, EngineConfig(dtype=dtype, fast_linear=True,
                                              pool_bytes=8 << 20, **cfg))  # fmt: skip
    eng.size_pool()
    try:
        yield eng.llms["m"]
    finally:
        eng.shutdown()


class Counted:
    """Counts the native loop's calls (it is a module function: patched for the test)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        run = zen_layers.run

        def counted(*args):
            self.calls += 1
            return run(*args)

        monkeypatch.setattr(zen_layers, "run", counted)


def _both(worker, sched):
    """The step's logits from the native loop, then from the Python loop, on one input."""
    inputs = worker.runner.prepare(sched)
    native = worker.runner.run(inputs)
    with zen_layers.turned_off():
        python = worker.runner.run(inputs)  # rewrites the same K/V into the same slots
    return native, python


def _start(worker, prompts, gen):
    from trae_groups.engine.protocol import GenerateRequest

    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i, n in enumerate(prompts):
        prompt = torch.randint(3, 500, (n,), generator=gen).tolist()
        worker.submit(GenerateRequest(f"r{n}-{i}", params, prompt=tuple(prompt)), lambda o: None)


def _loop_takes(dtype: str) -> bool:
    return (
        zen_layers.library() is not None and zen_layers.step_kind(getattr(torch, dtype)) is not None
    )


DTYPES = [
    pytest.param(d, marks=pytest.mark.skipif(not _loop_takes(d), reason=f"no {d} loop here"))
    for d in ("bfloat16", "float32")
]
LOOP_DTYPE = "bfloat16" if _loop_takes("bfloat16") else "float32"  # the single-dtype tests'


@pytest.mark.parametrize("library", ["zentorch", "onednn"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(LLM_FAMILIES))
def test_decode_and_mixed_steps_give_the_python_loops_logits(
    wide_llms, family, dtype, library, monkeypatch
):
    """Prompt steps (long chunks: the Python loop), decodes past Mistral's 24-token window,
    and a short prompt chunk beside decodes (the native loop), each run both ways, with the
    linears packed by either library (each runs on either vendor's CPUs)."""
    counted = Counted(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    seen = []
    with stepped(
        wide_llms[family], dtype, max_num_batched_tokens=64, long_prefill_token_threshold=64,
        linear_library=library,
    ) as worker:  # fmt: skip
        layer = native_layers.modules_of(worker.runner.flat)[0]
        assert {native_layers.caller_of(m) for m in layer} == {_caller(dtype, library)}
        _start(worker, [30, 41, 7], gen)
        for step in range(12):
            if step == 9:
                _start(worker, [5], gen)
            worker._take_new_and_aborts()
            sched = worker.scheduler.schedule()
            inputs = worker.runner.prepare(sched)
            whole = attention.native_rows(inputs.batch) is not None
            before = counted.calls
            native, python = _both(worker, sched)
            assert counted.calls - before == whole, step
            assert torch.equal(native, python), (step, (native - python).abs().max())
            chunks = len(sched.prefills)
            seen.append((whole, chunks > 0 and len(sched.decodes) > 0))
            worker._postprocess(sched, *_sampled(worker, sched, native))
    assert (False, False) in seen and (True, False) in seen  # prompt steps; decode steps
    assert (True, True) in seen  # a short chunk beside decodes


def _caller(dtype: str, library: str) -> str:
    """What multiplies the linears: bf16 weights that oneDNN cannot pack on this CPU are our
    AVX2 panels, whichever library was asked to pack them."""
    return "bf16_panels" if getattr(torch, dtype) in widened_dtypes() else library


def _sampled(worker, sched, logits):
    sampling = [item for item in sched.scheduled if item.samples]
    return sampling, worker._sample(logits, sampling)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_one_row_step_is_padded_as_in_the_python_loop(wide_llms, dtype, monkeypatch):
    counted = Counted(monkeypatch)
    with stepped(wide_llms["llama"], dtype) as worker:
        _start(worker, [20], torch.Generator().manual_seed(4))
        for _ in range(3):
            worker.step()
        sched = worker.scheduler.schedule()
        assert len(sched.decodes) == 1
        native, python = _both(worker, sched)
    assert counted.calls >= 1 and native.shape[0] == 1 and torch.equal(native, python)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_generation_gets_the_same_tokens_and_logprobs_with_and_without_it(
    wide_llms, dtype, monkeypatch
):
    """Prompts cached first (a bf16 prompt step is not always the same bits run to run on a
    loaded machine), then generated with the native loop and with the Python loop."""
    counted = Counted(monkeypatch)
    prompts = [list(range(5, 38)), list(range(300, 349)), list(range(40, 47))]
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=0)
    with engine({"m": wide_llms["qwen3"]}, dtype=dtype, fast_linear=True) as eng:
        eng.generate(prompts, SamplingParams(max_tokens=1))
        calls = counted.calls
        native = eng.generate(prompts, params)
        assert counted.calls > calls
        monkeypatch.setattr(zen_layers, "library", lambda: None)
        calls = counted.calls
        python = eng.generate(prompts, params)
        assert counted.calls == calls
    for a, b in zip(native, python, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_unpacked_linears_keep_the_python_loop_and_model_info_says_which(wide_llms, monkeypatch):
    counted = Counted(monkeypatch)
    paths = {}
    for fast in (True, False):
        with engine({"m": wide_llms["llama"]}, dtype=LOOP_DTYPE, fast_linear=fast) as eng:
            calls = counted.calls
            eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
            paths[fast] = (forward_path(eng.llms["m"].runner.model), counted.calls > calls)
    library = linear_library("auto", getattr(torch, LOOP_DTYPE))  # what this host packs
    path, ran = paths[True]
    assert ran and path.startswith(f"trae (fused projections); linears: {library}")
    assert path.endswith("; layer loop: native")
    assert paths[False] == ("trae (fused projections)", False)


COMPILED = """
import sys
from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams
config = EngineConfig(dtype=sys.argv[2], fast_linear=True, pool_bytes=8 << 20, compile=True,
                      compile_batch_sizes=(1,))
with LLMEngine({"m": sys.argv[1]}, config) as eng:
    eng.size_pool()  # compiles now, before any eager step has loaded the kernels
    out = eng.generate([list(range(5, 30))], SamplingParams(max_tokens=8, ignore_eos=True))
    assert eng.llms["m"].runner.compiled.steps > 0
    print(out[0].token_ids)
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_decode_steps_run_beside_it(wide_llms, dtype):
    """compile=True where the native loop runs the eager steps, in a fresh process: dynamo
    traces the Python loop (it had traced into the kernel library's load lock, which the
    first step takes, and the engine failed at start-up). float32 gives the eager engine's
    greedy tokens; bf16's may differ by a rounding (compiled steps take torch's norms)."""
    path = wide_llms["llama"]
    done = subprocess.run([sys.executable, "-c", COMPILED, str(path), dtype],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(got) == 8
    if dtype == "float32":
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        with engine({"m": path}, dtype=dtype, fast_linear=True) as eng:
            assert got == eng.generate([list(range(5, 30))], params)[0].token_ids


@pytest.mark.skipif(
    not hasattr(cpu_native.library(), "add_rms_norm_call"),
    reason="AVX-512 builds use zentorch's norm",
)
def test_avx2_builds_run_the_loop_without_zentorch():
    # AVX2 builds norm with our own kernel and multiply with oneDNN's panels: a host without
    # the zen extra (its shims turned off here) still gets the native loop
    code = "from trae_groups.kernels import zen_layers; print(zen_layers.library() is None)"
    env = {**os.environ, zen_calls.ENV_SWITCH: "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (done.stdout.strip() or done.stderr) == "False"


def test_the_switch_turns_the_native_loop_off():
    code = "from trae_groups.kernels import zen_layers; print(zen_layers.library() is None)"
    outs = {}
    for value in ("0", "1"):
        env = {**os.environ, zen_layers.ENV_SWITCH: value}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        outs[value] = done.stdout.strip() or done.stderr
    assert outs == {"0": "True", "1": "False"}


def test_a_failed_native_step_runs_again_in_python_and_the_model_keeps_python(
    wide_llms, monkeypatch
):
    def fails(*args):
        raise RuntimeError("a native decoder layer failed (kernel error 1)")

    with stepped(wide_llms["qwen3"], dtype=LOOP_DTYPE) as worker:
        _start(worker, [20, 9], torch.Generator().manual_seed(5))
        for _ in range(3):
            worker.step()
        worker._take_new_and_aborts()
        sched = worker.scheduler.schedule()
        inputs = worker.runner.prepare(sched)
        with zen_layers.turned_off():
            want = worker.runner.run(inputs)
        monkeypatch.setattr(zen_layers, "run", fails)
        got = worker.runner.run(inputs)
        assert worker.runner.flat.native.failed
        monkeypatch.undo()
        counted = Counted(monkeypatch)
        again = worker.runner.run(inputs)
    assert torch.equal(got, want) and torch.equal(again, want) and counted.calls == 0
