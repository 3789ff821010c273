"""AMD's zentorch against our oneDNN packed linears, on one SmolLM2 step's matmuls.

The engine-speed issue asks to prefer a well-kept kernel library over our own code where it is
faster: zentorch (``pip install zentorch==2.13.0.1``, the version vLLM CPU's ``zen`` extra pins
for torch 2.13) ships ZenDNN kernels for AMD EPYC. This measures what it would buy, in one
process, interleaved, medians: every linear of one SmolLM2-135M step (30 layers of fused QKV,
o, fused gate/up and down, plus the lm_head on the rows that sample) through

- ``mkl``: ``F.linear`` on the plain weight (torch's default);
- ``onednn``: our ``PackedLinear`` (the engine's path);
- ``zentorch``: ``zentorch_linear_unary`` on a weight prepacked by
  ``zentorch_weight_prepack_for_linear``; ``zentorch-plain`` on the plain weight;

and the norm ops beside them (``torch.rms_norm`` against ``zentorch_rms_norm``). Prints, never
asserts; names the CPU.

    .venv/bin/python bench/zentorch_linear.py
    .venv/bin/python bench/zentorch_linear.py --rows 1 32 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from trae_groups.engine.fast_linear import PackedLinear, packable_dtypes

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 576, 1536, 9, 3, 64, 30, 49152
LAYER = [  # (name, in, out) of one decoder layer, with the engine's fusions
    ("qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    ("o", HEADS * HEAD_DIM, HIDDEN),
    ("gate_up", HIDDEN, 2 * INTER),
    ("down", INTER, HIDDEN),
]


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown CPU")  # fmt: skip
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])  # fmt: skip
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(simd) or 'no AVX2'})"


def step_fns(dtype: torch.dtype, rows: int) -> dict[str, Callable[[], object]]:
    """One callable per backend running every linear of one step on ``rows`` rows."""
    import zentorch  # noqa: F401  (registers torch.ops.zentorch)

    torch.manual_seed(0)
    shapes = [s for s in LAYER] * LAYERS
    weights = [torch.randn(out, inp, dtype=dtype) * 0.02 for _, inp, out in shapes]
    head = torch.randn(VOCAB, HIDDEN, dtype=dtype) * 0.02
    xs = {inp: torch.randn(rows, inp, dtype=dtype) for _, inp, _ in LAYER}
    x_head = torch.randn(min(rows, 32), HIDDEN, dtype=dtype)
    ins = [inp for _, inp, _ in shapes]
    fns: dict[str, Callable[[], object]] = {}

    def mkl() -> None:
        for w, inp in zip(weights, ins, strict=True):
            F.linear(xs[inp], w)
        F.linear(x_head, head)

    fns["mkl"] = mkl
    if dtype in packable_dtypes():
        packed = [PackedLinear(w, upcast_large=False) for w in weights]
        packed_head = PackedLinear(head, upcast_large=False)

        def onednn() -> None:
            for p, inp in zip(packed, ins, strict=True):
                p(xs[inp])
            packed_head(x_head)

        fns["onednn"] = onednn
    zt = torch.ops.zentorch
    try:
        zw = [zt.zentorch_weight_prepack_for_linear(w) for w in weights]
        zh = zt.zentorch_weight_prepack_for_linear(head)
        prepacked = True
    except RuntimeError as exc:  # some dtypes cannot be prepacked on some CPUs
        print(f"  zentorch prepack failed for {dtype}: {str(exc).splitlines()[0]}")
        zw, zh, prepacked = weights, head, False

    def zen() -> None:
        for w, inp in zip(zw, ins, strict=True):
            zt.zentorch_linear_unary(xs[inp], w, is_weight_prepacked=prepacked)
        zt.zentorch_linear_unary(x_head, zh, is_weight_prepacked=prepacked)

    fns["zentorch"] = zen

    def zen_plain() -> None:  # no prepack: what the plain weight (a mapped file) costs
        for w, inp in zip(weights, ins, strict=True):
            zt.zentorch_linear_unary(xs[inp], w)
        zt.zentorch_linear_unary(x_head, head)

    fns["zentorch-plain"] = zen_plain
    return fns


def norm_fns(dtype: torch.dtype, rows: int) -> dict[str, Callable[[], object]]:
    """61 RMSNorms of one step (two per layer and the final one)."""
    x = torch.randn(rows, HIDDEN, dtype=dtype)
    w = torch.ones(HIDDEN, dtype=dtype)
    zt = torch.ops.zentorch
    return {
        "torch.rms_norm": lambda: [torch.rms_norm(x, (HIDDEN,), w, 1e-5) for _ in range(61)],
        "zentorch_rms_norm": lambda: [zt.zentorch_rms_norm(x, w, 1e-5) for _ in range(61)],
    }


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per call of each function, the functions alternating round by round."""
    for fn in fns.values():
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import zentorch

    print(f"{cpu_name()}, torch {torch.__version__}, zentorch {zentorch.__version__}, "
          f"{args.threads} threads; ms per step (median of {args.repeats}, interleaved)")  # fmt: skip
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for rows in args.rows:
            times = interleaved(step_fns(dtype, rows), args.repeats)
            times.update(interleaved(norm_fns(dtype, rows), args.repeats))
            base = times.get("onednn", times["mkl"])
            cells = "  ".join(f"{k} {v:7.2f}" for k, v in times.items())
            print(f"{name:<9} rows {rows:>4}: {cells}  | zentorch / ours "
                  f"{times['zentorch'] / base:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
