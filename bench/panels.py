"""Float32 rows on onednn_calls.c's own panels against oneDNN's op, on one packed weight each.

The engine's fused linears of SmolLM2 (q/k/v, o, gate/up, down) for ``--layers`` layers, each
weight and each input its own (so weights stream from memory as in a step), multiplied at each
row count by the panels (``onednn_calls.linear``) and by the op (``mkldnn._linear_pointwise``),
the two alternating in one process. Prints, never asserts: medians of ``--rounds`` rounds, and
whether the panels gave the op's bits. Where the panels do not run (no AVX2/AVX-512 build, no
panel layout), both columns are the op.

    .venv/bin/python bench/panels.py --rows 32 2048
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from trae_groups.engine.fast_linear import DEFAULT_BATCH_HINT
from trae_groups.kernels import onednn_calls

# SmolLM2-135M's fused linears of one layer: (out_features, in_features)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _layers(rows: int, count: int, g: torch.Generator) -> tuple[list, onednn_calls.WeightHandles]:
    handles = onednn_calls.WeightHandles()
    layers = []
    for _ in range(count):
        for n, k in SHAPES:
            weight = torch.randn(n, k, generator=g) * 0.05
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, DEFAULT_BATCH_HINT)
            layers.append((packed, handles.of(packed), n, torch.randn(rows, k, generator=g)))
    return layers, handles


def _run(layers: list, panels: bool) -> float:
    start = time.perf_counter()
    for packed, address, n, x in layers:
        if panels:
            onednn_calls.linear(x, address, n)
        else:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 512, 2048])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if onednn_calls.library() is None:
        raise SystemExit("no oneDNN caller here (see the log)")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in cpu.splitlines() if line.startswith("Model name")), "CPU ?"))
    print(f"panels take float32 rows up to {onednn_calls.own_rows_limit(torch.float32)} here")
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        layers, handles = _layers(rows, args.layers, g)
        _run(layers, True)  # each weight's first call at this count checks the bits (the op's)
        same = all(
            torch.equal(
                onednn_calls.linear(x, address, n),
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            )
            for packed, address, n, x in layers[: len(SHAPES)]
        )
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(args.rounds):
            for panels in (True, False) if i % 2 == 0 else (False, True):
                times[panels].append(_run(layers, panels))
        flops = sum(2 * rows * n * x.shape[1] for _, _, n, x in layers)
        mine, op = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"{rows:5d} rows: panels {mine * 1e3:8.1f} ms ({flops / mine / 1e9:5.0f} GFLOP/s), "
            f"op {op * 1e3:8.1f} ms ({flops / op / 1e9:5.0f} GFLOP/s), panels / op "
            f"{mine / op:.2f}x; the op's bits: {same}"
        )
        handles.release()


if __name__ == "__main__":
    main()
