"""Packed oneDNN linears vs nn.Linear (MKL) on the engine benchmark model's decode matmuls.

Prints, never asserts: timings on these shared machines swing 2x between minutes, so each
figure is a median of interleaved plain/packed runs measured in the same process.

    .venv/bin/python bench/linear.py              # per-step and per-shape speedups, T = 1 and 32
    .venv/bin/python bench/linear.py --hints      # also sweep the reorder's batch-size hint
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from trae_groups.engine.fast_linear import (
    DEFAULT_BATCH_HINT,
    PackedLinear,
    fast_linear_available,
)

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 512, 1536, 8, 4, 64, 8, 32000

# (name, in_features, out_features) of one decoder layer; lm_head separately.
LAYER_SHAPES = [
    ("q_proj", HIDDEN, HEADS * HEAD_DIM),
    ("k_proj", HIDDEN, KV_HEADS * HEAD_DIM),
    ("v_proj", HIDDEN, KV_HEADS * HEAD_DIM),
    ("o_proj", HEADS * HEAD_DIM, HIDDEN),
    ("gate_proj", HIDDEN, INTER),
    ("up_proj", HIDDEN, INTER),
    ("down_proj", INTER, HIDDEN),
]
LM_HEAD = ("lm_head", HIDDEN, VOCAB)


def median_time(fn: Callable[[], object], inner: int, repeats: int) -> float:
    """Median seconds per call over `repeats` batches of `inner` calls (after a warm-up)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def interleaved(fns: dict[str, Callable[[], object]], inner: int, repeats: int) -> dict[str, float]:
    """Median per-call seconds of each fn, alternating them so load swings hit all alike."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[key].append((time.perf_counter() - start) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def build_step_linears(seed: int = 0) -> list[nn.Linear]:
    """All 57 linears of one decode step, each with its own weights (166 MB: no cache reuse)."""
    torch.manual_seed(seed)
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [LM_HEAD]
    return [nn.Linear(k, n, bias=False) for _, k, n in shapes]


def step_fn(mods: list[nn.Module], rows: int) -> Callable[[], None]:
    """One decode step's matmuls in model order (lm_head last), on `rows` tokens."""
    inputs = {m_in: torch.randn(rows, m_in) for m_in in {HIDDEN, INTER, HEADS * HEAD_DIM}}

    def run() -> None:
        for m in mods:
            m(inputs[m.in_features])

    return run


def bench_step(rows_list: list[int], repeats: int) -> None:
    plain = build_step_linears()
    packed = [PackedLinear.from_linear(m) for m in plain]
    print(f"\n## Whole decode step: 57 matmuls (8 layers x 7 + lm_head), hint {DEFAULT_BATCH_HINT}")
    print(f"{'tokens':>6} {'nn.Linear ms':>13} {'packed ms':>10} {'speedup':>8}")
    for rows in rows_list:
        res = interleaved(
            {"plain": step_fn(plain, rows), "packed": step_fn(packed, rows)}, 3, repeats
        )
        print(
            f"{rows:>6} {res['plain'] * 1e3:>13.2f} {res['packed'] * 1e3:>10.2f} "
            f"{res['plain'] / res['packed']:>7.2f}x"
        )


def bench_shapes(rows_list: list[int], repeats: int) -> None:
    print("\n## Per shape (us per call, one weight reused: cache-warm for the small ones)")
    print(
        f"{'shape':>22} {'tokens':>6} {'nn.Linear':>10} {'packed':>9} {'speedup':>8} {'GFLOP/s packed':>15}"
    )
    for name, k, n in [*LAYER_SHAPES, LM_HEAD]:
        torch.manual_seed(0)
        lin = nn.Linear(k, n, bias=False)
        pk = PackedLinear.from_linear(lin)
        for rows in rows_list:
            x = torch.randn(rows, k)
            inner = max(3, min(200, int(3e7 / (rows * k * n))))
            fns = {"plain": lambda m=lin, x=x: m(x), "packed": lambda m=pk, x=x: m(x)}
            res = interleaved(fns, inner, repeats)
            gflops = 2 * rows * k * n / res["packed"] / 1e9
            print(
                f"{f'{name} {k}x{n}':>22} {rows:>6} {res['plain'] * 1e6:>10.1f} "
                f"{res['packed'] * 1e6:>9.1f} {res['plain'] / res['packed']:>7.2f}x {gflops:>15.1f}"
            )


def bench_hints(repeats: int) -> None:
    """Sweep the reorder's batch-size hint: the packed weight serves any row count, only speed varies."""
    rows_list = [1, 2, 4, 8, 16, 32, 48, 64, 512]
    hints: list[int | None] = [None, 1, 8, 16, 32, 64, 512]
    print("\n## Batch-size hint sweep (us per call; rows x shape)")
    print(f"{'shape':>12} {'rows':>5} " + " ".join(f"{f'h={h}':>8}" for h in hints))
    totals = dict.fromkeys(hints, 0.0)
    for _, k, n in [LAYER_SHAPES[0], LAYER_SHAPES[1], LAYER_SHAPES[4], LAYER_SHAPES[6], LM_HEAD]:
        torch.manual_seed(0)
        weight = torch.randn(n, k)
        packs = {h: PackedLinear(weight, None, h) for h in hints}
        for rows in rows_list:
            x = torch.randn(rows, k)
            inner = max(2, min(200, int(3e7 / (rows * k * n))))
            res = interleaved(
                {h: (lambda p=p, x=x: p(x)) for h, p in packs.items()}, inner, repeats
            )
            best = min(res.values())
            for h in hints:
                totals[h] += res[h] / best  # relative to the best hint for this cell
            print(f"{f'{k}x{n}':>12} {rows:>5} " + " ".join(f"{res[h] * 1e6:>8.1f}" for h in hints))
    cells = len(rows_list) * 5
    print(
        "mean slowdown vs best hint per cell: "
        + ", ".join(f"h={h}: {totals[h] / cells:.3f}" for h in hints)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hints", action="store_true", help="also sweep the batch-size hint")
    parser.add_argument("--no-shapes", action="store_true", help="skip the per-shape table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not fast_linear_available():
        raise SystemExit("oneDNN (mkldnn) not available in this torch build")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"loadavg {' '.join(f'{v:.2f}' for v in os.getloadavg())} (2 cores shared), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    with torch.inference_mode():
        bench_step([1, 32], args.repeats)
        if not args.no_shapes:
            bench_shapes([1, 32], args.repeats)
        if args.hints:
            bench_hints(args.repeats)


if __name__ == "__main__":
    main()
