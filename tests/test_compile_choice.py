"""EngineConfig(compile="auto"), the default: eager, unless TRAE_COMPILE=1 asks for the
batch-1 decode step compiled where it works (our flat forward on a CPU, plain KV pages, the
torch attention backend, a C++ compiler), with greedy parity against transformers' generate;
elsewhere the model stays eager with a reason. The suite itself runs with TRAE_COMPILE=0
(conftest); these tests set it where they need to."""

from __future__ import annotations

import shutil

import pytest
from test_engine import MAX_NEW, assert_parity, prompts

from trae_groups.engine.compile_choice import auto_compile_reason, compile_sizes
from trae_groups.engine.config import AUTO_COMPILE_SIZES, COMPILE_ENV, EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.sampling import SamplingParams

HAS_CXX = shutil.which("g++") is not None


def _worker(path, **cfg):
    cfg.setdefault("pool_bytes", 8 << 20)
    engine = LLMEngine({"m": path}, EngineConfig(**cfg))
    return engine, engine.llms["m"]


def test_compile_setting_is_checked():
    with pytest.raises(ValueError, match="compile: must be one of"):
        EngineConfig(compile="yes")
    assert EngineConfig().compile == "auto"


@pytest.mark.parametrize(
    "cfg,env,reason",
    [
        ({}, "0", "TRAE_COMPILE=0"),
        ({"model_forward": "transformers"}, None, "transformers' forward"),
        ({"kv_cache_dtype": "int8"}, None, "quantized KV cache"),
        ({}, None, "TRAE_COMPILE=1 compiles it"),  # the default: eager is as fast on CPU
        ({"model_forward": "transformers"}, "1", "transformers' forward"),
    ],
)
def test_auto_leaves_these_eager_with_a_reason(llama_dir, monkeypatch, cfg, env, reason):
    if env is None:
        monkeypatch.delenv(COMPILE_ENV, raising=False)
    else:
        monkeypatch.setenv(COMPILE_ENV, env)
    engine, worker = _worker(llama_dir, **cfg)
    with engine:
        assert reason in auto_compile_reason(worker.runner)
        assert compile_sizes(engine.config, worker.runner) == ()
    # an explicit True still compiles (every size that fits max_num_seqs)
    forced = EngineConfig(compile=True, compile_batch_sizes=(1, 4, 99), max_num_seqs=8)
    assert compile_sizes(forced, worker.runner) == (1, 4)
    assert compile_sizes(EngineConfig(compile=False), worker.runner) == ()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CXX, reason="inductor needs a C++ compiler")
def test_auto_compiles_batch_one_with_greedy_parity(llama_dir, monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "1")
    engine, worker = _worker(llama_dir, fast_linear=False)  # the reference path: exact parity
    assert auto_compile_reason(worker.runner) is None
    ps = prompts(n=3, seed=11, lo=4, hi=30)
    with engine.start():  # serving starts eagerly; the compile finishes on a thread
        assert engine.wait_compiled(timeout=600)
        compiled = worker.runner.compiled
        assert compiled.sizes == list(AUTO_COMPILE_SIZES)
        outs = [engine.generate([p], SamplingParams(max_tokens=MAX_NEW))[0] for p in ps]
        assert compiled.steps > 0  # one stream's decode steps ran compiled
    assert_parity(llama_dir, outs, ps)
