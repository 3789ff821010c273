"""Where one decode step's time goes: linears, attention, norms, other ops, Python, sampling.

    .venv/bin/python bench/step_profile.py                       # synthetic bench model, fp32
    .venv/bin/python bench/step_profile.py --dtype bfloat16 --batch 1 32
    .venv/bin/python bench/step_profile.py --model /path/to/smollm2   # any transformers folder
    .venv/bin/python bench/step_profile.py --forward auto   # only our flat forward (default: both)

Method. B requests (64-token prompts, no eos) are prefilled through the engine's worker, then
decode steps are timed twice, with the worker's own ``step()``:
1. plain timers (no profiler): wall time of the whole step and of ``runner.prepare`` (metadata),
   ``runner.run`` (the forward) and the sampler; the rest of the step is scheduler +
   postprocessing ("bookkeeping"). Median over ``--steps`` steps.
2. torch.profiler over the same number of steps splits the forward: top-level aten ops by name
   (linears: ``mkldnn::_linear_pointwise``, ``aten::linear``/``addmm``/``mm``), our attention
   (store_kv + paged attention, wrapped in a ``record_function``) and RMSNorm modules (a
   ``record_function`` per call from forward hooks); every other top-level op is "other ops"
   (rotary, SiLU*mul, residual adds, embedding, views). What the forward's wall time leaves
   uncovered by those ops is "Python/dispatch" (transformers' module code, kwargs plumbing,
   our attention glue outside its kernels). The profiler inflates small ops, so its shares are
   applied to the unprofiled forward time of step 1: the split is approximate (a few %).
With --compile only the timers run (a compiled graph's kernels carry no aten names).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

LINEAR_OPS = {
    "mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm",
    "zentorch::zentorch_linear_unary",
}  # fmt: skip
LINEAR_LIBRARY = {"value": "auto"}  # EngineConfig.linear_library, from --linear-library
CATEGORIES = ("linears", "attention", "norms", "other ops", "python/dispatch")


def build_engine(
    model_dir: str, dtype: str, compile_: bool, batch_sizes: list[int], forward: str = "auto"
):
    from trae_groups.engine import EngineConfig, LLMEngine

    extra = {"compile": True, "compile_batch_sizes": tuple(batch_sizes)} if compile_ else {}
    config = EngineConfig(
        dtype=dtype, pool_bytes=512 << 20, max_num_seqs=64, max_num_batched_tokens=1024,
        model_forward=forward, linear_library=LINEAR_LIBRARY["value"], **extra,
    )  # fmt: skip
    engine = LLMEngine({"m": model_dir}, config)
    engine.size_pool()  # what start() does first: the pool is final, compiled sizes are built
    return engine, engine.llm("m")


def fill(worker, batch: int, vocab: int, prompt_len: int = 64) -> None:
    """B running sequences, prefilled, each with a long way to go."""
    from trae_groups.engine import SamplingParams
    from trae_groups.engine.protocol import GenerateRequest

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        worker.submit(GenerateRequest(f"p{i}", params, prompt=tuple(prompt)), lambda out: None)
    while worker.scheduler.waiting or any(s.num_computed < prompt_len for s in _running(worker)):
        worker.step()
    for _ in range(3):  # the first decode steps of a shape are slower (oneDNN primitives)
        worker.step()


def _running(worker):
    return list(worker.scheduler.running)


class Timers:
    """Wraps the runner's prepare/run and the sampler of one worker with perf counters."""

    def __init__(self, worker):
        self.t: dict[str, list[float]] = defaultdict(list)
        for owner, name, label in (
            (worker.runner, "prepare", "metadata"),
            (worker.runner, "run", "forward"),
            (worker, "sampler", "sampling"),
        ):
            setattr(owner, name, self._timed(getattr(owner, name), label))

    def _timed(self, fn, label):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.t[label].append(time.perf_counter() - start)
            return out

        return wrapped


def timed_steps(worker, timers: Timers, steps: int) -> dict[str, float]:
    timers.t.clear()
    for _ in range(steps):
        start = time.perf_counter()
        worker.step()
        timers.t["step"].append(time.perf_counter() - start)
    ms = {k: statistics.median(v) * 1e3 for k, v in timers.t.items()}
    ms["bookkeeping"] = ms["step"] - ms["metadata"] - ms["forward"] - ms["sampling"]
    return ms


def instrument_forward(worker) -> list:
    """record_function ranges around attention kernels and RMSNorm modules (profiling only)."""
    runner = worker.runner
    backend = runner.backend

    def ranged(fn):
        def wrapped(*args, **kwargs):
            with record_function("trae::attention"):
                return fn(*args, **kwargs)

        return wrapped

    runner.backend = dataclasses.replace(
        backend, store_kv=ranged(backend.store_kv), paged_attention=ranged(backend.paged_attention)
    )
    handles = []
    for module in worker.model.modules():
        if "RMSNorm" in type(module).__name__:

            def pre(mod, args):
                mod._trae_range = record_function("trae::norm").__enter__()

            def post(mod, args, out):
                mod._trae_range.__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return [lambda: setattr(runner, "backend", backend), *(h.remove for h in handles)]


def forward_split(worker, steps: int) -> dict[str, float]:
    """Share of the forward per category, from torch.profiler (see the module docstring)."""
    undo = instrument_forward(worker)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function("trae::step"):
                    worker.step()
    finally:
        for fn in undo:
            fn()
    events = prof.events()
    forward_us = 0.0
    spent: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.name == "trae::forward":
            forward_us += ev.cpu_time_total
    for ev in events:
        cat = _category(ev)
        if cat is not None:
            spent[cat] += ev.cpu_time_total
    spent["python/dispatch"] = max(forward_us - sum(spent.values()), 0.0)
    return {k: spent[k] / forward_us for k in CATEGORIES}


# modules (transformers'), torch's op (ours), zentorch's ops (ours beside zentorch's linears)
NORM_OPS = (
    "trae::norm", "aten::rms_norm", "zentorch::zentorch_rms_norm",
    "zentorch::zentorch_add_rms_norm_",
)  # fmt: skip


def _category(ev) -> str | None:
    """A top-level event inside the forward → its category; None for everything else
    (nested events are counted with their top-level ancestor)."""
    chain, parent = [], ev.cpu_parent
    while parent is not None:
        chain.append(parent.name)
        parent = parent.cpu_parent
    if "trae::forward" not in chain:
        return None
    if any("::" in name for name in chain[: chain.index("trae::forward")]):
        return None
    if ev.name == "trae::attention":
        return "attention"
    if ev.name in NORM_OPS:
        return "norms"
    if "::" not in ev.name or ev.name.startswith("trae::"):
        return None
    return "linears" if ev.name in LINEAR_OPS else "other ops"


def wrap_forward(worker) -> None:
    run = worker.runner.run

    def ranged(inputs):
        with record_function("trae::forward"):
            return run(inputs)

    worker.runner.run = ranged


def profile_one(
    model_dir: str, dtype: str, batch: int, steps: int, compile_: bool, forward: str
) -> dict:
    engine, worker = build_engine(model_dir, dtype, compile_, [batch], forward)
    vocab = worker.model.config.get_text_config().vocab_size
    fill(worker, batch, vocab)
    wrap_forward(worker)
    timers = Timers(worker)
    ms = timed_steps(worker, timers, steps)
    # a compiled graph's kernels are not aten ops by name: no split, timers only
    shares = None if compile_ else forward_split(worker, steps)
    ms_again = timed_steps(worker, timers, steps)  # the same after profiling: noise check
    engine.shutdown()
    return {"ms": ms, "ms_again": ms_again, "shares": shares}


def report(label: str, res: dict) -> None:
    ms, again, shares = res["ms"], res["ms_again"], res["shares"]
    fwd = ms["forward"]
    if shares is None:
        parts = ["(compiled: not split)"]
    else:
        parts = [f"{k} {shares[k] * fwd:.2f} ({shares[k]:.0%})" for k in CATEGORIES]
    print(
        f"{label}: step {ms['step']:.2f} ms (again {again['step']:.2f}) = "
        f"forward {fwd:.2f} + metadata {ms['metadata']:.2f} + sampling {ms['sampling']:.2f} "
        f"+ bookkeeping {ms['bookkeeping']:.2f}\n    forward: " + ", ".join(parts),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the bench model)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="EngineConfig(compile=True)")
    parser.add_argument(
        "--forward", nargs="+", default=["auto", "transformers"],
        help="EngineConfig.model_forward: ours (auto) and/or transformers'",
    )  # fmt: skip
    parser.add_argument(
        "--linear-library", choices=["auto", "onednn", "zentorch"], default="auto",
        help="EngineConfig.linear_library (auto: zentorch on AMD CPUs where installed)",
    )  # fmt: skip
    args = parser.parse_args()
    LINEAR_LIBRARY["value"] = args.linear_library
    torch.set_num_threads(args.threads)
    if args.model is None:
        import peers

        peers.quiet_known_warnings()
        args.model = str(peers.build_model())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    for dtype in args.dtype:
        for batch in args.batch:
            for forward in args.forward:
                res = profile_one(args.model, dtype, batch, args.steps, args.compile, forward)
                label = f"{dtype} batch {batch} forward {forward} linears {args.linear_library}"
                report(label, res)


if __name__ == "__main__":
    main()
