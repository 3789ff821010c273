"""Which padded decode sizes a model compiles: ``EngineConfig.compile`` resolved per model.

``compile=True`` compiles every size of ``compile_batch_sizes`` wherever the runner can;
``"auto"`` (the default) compiles nothing unless ``TRAE_COMPILE=1`` asks for it: measured on
CPU, the eager batch-1 step (with the native attention kernels) is as fast as the compiled one
or faster, and compiling costs ~100 MB of memory and half a minute of a core. With
``TRAE_COMPILE=1`` it compiles ``AUTO_COMPILE_SIZES`` where that works: our flat forward on a
CPU, plain KV pages, the torch attention backend, and a C++ compiler for inductor. Anywhere
else the model stays eager, with the reason in the log and in ``trae model info``, never an
error: the default must not make a model fail to load.
"""

from __future__ import annotations

import os
import shutil

from trae_groups.engine.config import AUTO_COMPILE_SIZES, COMPILE_ENV, EngineConfig


def auto_compile_reason(runner) -> str | None:
    """Why ``compile="auto"`` leaves this model's decode eager, or None when it compiles."""
    asked = os.environ.get(COMPILE_ENV)
    if asked == "0":
        return f"{COMPILE_ENV}=0 in the environment"
    if runner.device.type != "cpu":
        return "on a GPU decode graphs are opt-in (compile=True)"
    if runner.flat is None:
        return "runs transformers' forward (compiled only with compile=True)"
    if runner.kv.layout.storage is not None:
        return "a quantized KV cache runs eager"
    if runner.backend.name != "torch":
        return f"the {runner.backend.name} attention backend runs eager"
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++")):
        return "no C++ compiler for inductor (g++)"
    if asked != "1":
        return (
            "eager decode is as fast on CPU (compiled batch-1 steps measured slower, "
            f"docs/engine.md); {COMPILE_ENV}=1 compiles it"
        )
    return None


def compile_sizes(config: EngineConfig, runner) -> tuple[int, ...]:
    """The padded batch sizes this model's decode-only steps compile at; () for none."""
    if config.compile is True:
        sizes = config.compile_batch_sizes
    elif config.compile == "auto" and auto_compile_reason(runner) is None:
        sizes = AUTO_COMPILE_SIZES
    else:
        return ()
    return tuple(b for b in sizes if b <= config.max_num_seqs) or (config.max_num_seqs,)
