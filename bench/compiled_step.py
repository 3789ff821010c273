"""One decode forward, eager against compiled, and the linears alone: what compiling leaves.

    .venv/bin/python bench/compiled_step.py --model ~/.cache/trae-groups/demo/dialog
    .venv/bin/python bench/compiled_step.py --dtype bfloat16 --batch 16

An engine with ``EngineConfig(compile=True)`` at the one size ``--batch`` is filled with that
many running requests (64-token prompts, bench/step_profile.py's ``fill``), then the same
decode step's inputs go through the runner's forward ``--pairs`` times each way, alternating:
eager (``runner.compiled`` set aside) and compiled. The same inputs rewrite the same K/V
slots with the same values, so every call does the same work. In between, every oneDNN-packed
linear of the model runs once in model order on a [batch, in] input: a step's linears with
nothing else, the part compiling cannot remove. Medians; ratios are per pair.
Prints, never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import peers  # noqa: E402
import step_profile  # noqa: E402


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(model_dir: str, dtype: str, batch: int, pairs: int) -> None:
    from trae_groups.engine.fast_linear import PackedLinear

    start = time.perf_counter()
    engine, worker = step_profile.build_engine(model_dir, dtype, True, [batch])
    runner, compiled = worker.runner, worker.runner.compiled
    print(
        f"\n## {dtype}, batch {batch}: engine start {time.perf_counter() - start:.1f} s, "
        f"of which compile {compiled.compile_s:.1f} s",
        flush=True,
    )
    step_profile.fill(worker, batch, worker.model.config.get_text_config().vocab_size)
    inputs = runner.prepare(worker.scheduler.schedule())
    assert compiled.size_for(inputs) == batch

    def eager():
        runner.compiled = None
        try:
            return runner.run(inputs)
        finally:
            runner.compiled = compiled

    linears = [m for m in worker.model.modules() if isinstance(m, PackedLinear)]
    xs = {m.in_features: torch.randn(batch, m.in_features, dtype=m.dtype) for m in linears}

    @torch.inference_mode()
    def linears_alone():
        for m in linears:
            m(xs[m.in_features])

    for _ in range(3):
        eager(), runner.run(inputs), linears_alone()
    diff = (eager() - runner.run(inputs)).abs().max().item()
    times = {"eager": [], "compiled": [], "linears": []}
    for _ in range(pairs):
        times["eager"].append(_timed(eager))
        times["compiled"].append(_timed(lambda: runner.run(inputs)))
        times["linears"].append(_timed(linears_alone))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = sorted(c / e for c, e in zip(times["compiled"], times["eager"], strict=True))
    q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
    print(
        f"forward: eager {ms['eager']:.2f} ms, compiled {ms['compiled']:.2f} ms; compiled/eager "
        f"{statistics.median(ratios):.3f} (quartiles {q1:.2f}-{q3:.2f})\n"
        f"{len(linears)} linears alone {ms['linears']:.2f} ms: eager {ms['eager'] - ms['linears']:.2f}"
        f" ms besides them, compiled {ms['compiled'] - ms['linears']:.2f}\n"
        f"max |logit difference| {diff:.2g}; machine: {peers.machine_load()}",
        flush=True,
    )
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the bench model)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peers.quiet_known_warnings()
    if args.model is None:
        args.model = str(peers.build_model())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    for dtype in args.dtype:
        for batch in args.batch:
            measure(args.model, dtype, batch, args.pairs)


if __name__ == "__main__":
    main()
