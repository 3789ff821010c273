"""The OpenMP runtime and thread pinning, as vLLM's CPU backend sets them, tried on our engine.

vLLM pins each OpenMP thread to a core and ships Intel's OpenMP (``libiomp5``) with
``KMP_BLOCKTIME=1`` and ``KMP_TPAUSE=0``. Each setting below runs our engine in a process of
its own (a runtime is chosen when the process starts), settings alternating round by round:
offline 32 prompts x 100 tokens (64 new) and batch-1 decode ms/token, medians of 3 runs
within the process. Prints, never asserts; names the CPU.

    .venv/bin/python bench/threads.py --model-dir /path/to/smollm2 \\
        --iomp /path/to/vllm-venv/lib/libiomp5.so --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {  # name -> environment on top of ours; "{iomp}" is --iomp
    "libgomp (torch's), unpinned": {},
    "libgomp, OMP_PROC_BIND=close OMP_PLACES=cores": {
        "OMP_PROC_BIND": "close", "OMP_PLACES": "cores",
    },
    "libiomp5, its defaults": {"LD_PRELOAD": "{iomp}"},
    "libiomp5, KMP_BLOCKTIME=1 KMP_TPAUSE=0": {
        "LD_PRELOAD": "{iomp}", "KMP_BLOCKTIME": "1", "KMP_TPAUSE": "0",
    },
}  # fmt: skip


def measure(model_dir: str, dtype: str) -> dict:
    """In this process: (32 x 100 tok/s, batch-1 ms/token), medians of 3."""
    import torch

    from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30000, (100,), generator=gen).tolist() for _ in range(32)]
    engine = LLMEngine({"m": model_dir}, EngineConfig(dtype=dtype))
    engine.size_pool()
    engine.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), model="m")
    tps, ms = [], []
    for run in range(3):  # fresh prompts each run: no prefix-cache hits
        batch = [[t + run + 1 for t in p] for p in prompts]
        start = time.perf_counter()
        engine.generate(batch, SamplingParams(max_tokens=64, ignore_eos=True), model="m")
        tps.append(32 * 64 / (time.perf_counter() - start))
        timed = []
        for prompt, new in ((batch[0][:50], 2), (batch[1][:50], 66)):  # the difference: 64
            start = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True), model="m")
            timed.append(time.perf_counter() - start)
        ms.append((timed[1] - timed[0]) / 64 * 1e3)
    return {"tok_s": statistics.median(tps), "ms": statistics.median(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--iomp", help="libiomp5.so (vLLM's venv has one); without it, libgomp only"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.model_dir, args.dtype)))
        return
    from vs_vllm import cpu_info  # bench/vs_vllm.py

    print(cpu_info())
    settings = {k: v for k, v in SETTINGS.items() if args.iomp or "LD_PRELOAD" not in v}
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, extra in settings.items():
            env = {**os.environ, **{k: v.format(iomp=args.iomp) for k, v in extra.items()}}
            argv = [sys.executable, __file__, "--worker", "--model-dir", args.model_dir,
                    "--dtype", args.dtype]  # fmt: skip
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                print(f"{name}: failed: {done.stderr.strip()[-300:]}")
                continue
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'setting':<48} {'32 x 100 tok/s by round':>26} {'batch-1 ms by round':>22}")
    for name, runs in results.items():
        tok = " / ".join(f"{r['tok_s']:.1f}" for r in runs)
        ms = " / ".join(f"{r['ms']:.1f}" for r in runs)
        print(f"{name:<48} {tok:>26} {ms:>22}")


if __name__ == "__main__":
    main()
