"""Engine benchmark: output tokens/s of transformers' ways to serve a batch vs ours, and the roofline.

    .venv/bin/python bench/engine.py --quick        # smoke run: 8 new tokens, 1 repeat
    .venv/bin/python bench/engine.py                # 32 prompts x 64 new tokens, median of 3

Slot d calls ``run_ours(model_dir, prompts, max_new_tokens) -> (tokens_per_s, outputs)`` from
bench/ours.py when that module exists; its greedy outputs are checked against unpadded batch-1
``generate``. ``--compiled`` adds slot d+, the same engine with ``EngineConfig(compile=True)``.
Prints, never asserts: absolute rates drift on shared machines, compare ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import peers  # noqa: E402
from peers import PeerResult  # noqa: E402

COMPILE = "TRAE_BENCH_COMPILE"  # read by bench/ours.py


def load_ours() -> Callable | None:
    """bench/ours.py's run_ours, or None while our engine is not plugged in."""
    path = BENCH_DIR / "ours.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("ours", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ours"] = module
    spec.loader.exec_module(module)
    return module.run_ours


def run_d(run_ours: Callable, model_dir: Path, prompts, max_new: int, repeats: int) -> PeerResult:
    samples, outputs = [], None
    for _ in range(repeats):
        rate, outputs = run_ours(str(model_dir), [list(p) for p in prompts], max_new)
        samples.append(float(rate))
    return PeerResult("trae-groups engine", statistics.median(samples), samples, outputs)


def attempt(label: str, fn: Callable[[], PeerResult]) -> PeerResult | None:
    """Run one peer; a failing peer is reported, not fatal, so the others still print."""
    print(f"running {label} ...", flush=True)
    start = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # a benchmark reports what broke and carries on
        print(f"  {label} FAILED: {type(exc).__name__}: {exc}", flush=True)
        return None
    print(f"  {res.tokens_per_s:.1f} tok/s ({time.perf_counter() - start:.1f} s)", flush=True)
    return res


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per peer (median)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 new tokens, 1 repeat")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the model is cached")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--seq-subset", type=int, default=4, help="requests timed per repeat in a")
    parser.add_argument("--cb-attn", default="sdpa", choices=["sdpa", "paged|eager"])
    parser.add_argument("--no-generate-batch", action="store_true", help="skip generate_batch")
    parser.add_argument("--no-peers", action="store_true", help="only reference + ours")
    parser.add_argument("--no-roofline", action="store_true")
    parser.add_argument(
        "--compiled", action="store_true", help="also slot d+: ours with EngineConfig(compile=True)"
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
        args.max_new_tokens = args.max_new_tokens or 8
        args.seq_subset = min(args.seq_subset, 2)
    args.max_new_tokens = args.max_new_tokens or peers.MAX_NEW_TOKENS
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)  # before anything builds a thread pool
    peers.quiet_known_warnings()
    model_dir = peers.build_model(args.model_dir)
    prompts = peers.make_prompts()
    max_new, reps = args.max_new_tokens, args.repeats
    lens = sorted(len(p) for p in prompts)
    print(
        f"torch {torch.__version__}, transformers {peers.transformers.__version__}, "
        f"{torch.get_num_threads()} threads; model {model_dir}\n"
        f"{len(prompts)} prompts of {lens[0]}-{lens[-1]} tokens (median {lens[len(lens) // 2]}), "
        f"{max_new} new tokens, greedy, eos off; medians of {reps} repeats\n"
        f"machine at start: {peers.machine_load()}"
    )

    plain = peers.load_model(model_dir, "sdpa")
    print("reference: unpadded batch-1 generate on every prompt ...", flush=True)
    reference, full_pass_rate = peers.reference_outputs(plain, prompts, max_new)
    results: dict[str, PeerResult | None] = {}
    latency = None
    if not args.no_peers:
        results["a"] = attempt(
            "a", lambda: peers.generate_sequential(plain, prompts, max_new, reps, args.seq_subset)
        )
        results["b"] = attempt("b", lambda: peers.generate_padded(plain, prompts, max_new, reps))
        latency = peers.batch1_latency(plain, prompts[len(prompts) // 2], max_new, max(reps, 3))
        cb_model = peers.load_model(model_dir, args.cb_attn)  # never reused for plain generate
        results["c"] = attempt("c", lambda: peers.cb_manager(cb_model, prompts, max_new, reps))
        if not args.no_generate_batch:
            results["c'"] = attempt(
                "c'", lambda: peers.cb_generate_batch(cb_model, prompts, max_new, reps)
            )
        del cb_model

    # Before d: our engine may keep a background thread alive after run_ours returns.
    roof = None if args.no_roofline else peers.measure_roofline(plain, max(reps, 3))

    run_ours = load_ours()
    slots = {"d": "0", "d+": "1"} if args.compiled else {"d": os.environ.get(COMPILE, "0")}
    for slot, compiled in slots.items() if run_ours is not None else ():
        os.environ[COMPILE] = compiled  # bench/ours.py keeps one engine per value
        results[slot] = attempt(slot, lambda: run_d(run_ours, model_dir, prompts, max_new, reps))
        ours_module = sys.modules.get("ours")
        if ours_module is not None and hasattr(ours_module, "batch1_decode_ms"):
            mid = list(prompts[len(prompts) // 2])
            ms = ours_module.batch1_decode_ms(str(model_dir), mid, max_new, max(reps, 3))
            print(f"  {slot} batch-1 decode: {ms:.2f} ms/token", flush=True)
            if roof is not None:
                floor = roof.batch1_floor_ms
                print(
                    f"  {slot} batch-1 decode / bandwidth floor ({floor:.2f} ms): "
                    f"{ms / floor:.2f}x (target <= 1.5x)"
                )
    print(f"machine at end: {peers.machine_load()}")
    report(results, reference, full_pass_rate, latency, roof, run_ours is not None, args)


def report(
    results: dict[str, PeerResult | None],
    reference: list[list[int]],
    full_pass_rate: float,
    latency: tuple[float, float] | None,
    roof: peers.Roofline | None,
    have_ours: bool,
    args: argparse.Namespace,
) -> None:
    n, max_new = len(reference), args.max_new_tokens
    print(f"\n## Output tokens/s ({n} prompts x {max_new} new tokens)")
    print(f"{'':3} {'what':<46} {'tok/s':>8} {'greedy = ref':>13}  note")
    for key, res in results.items():
        if res is None:
            print(f"{key:3} {'(failed, see above)':<46}")
            continue
        same = "-" if res.outputs is None else f"{peers.count_equal(res.outputs, reference)}/{n}"
        print(f"{key:3} {res.name:<46} {res.tokens_per_s:>8.1f} {same:>13}  {res.note}")
    print(
        f"{'a*':3} {'generate, one at a time: reference pass':<46} {full_pass_rate:>8.1f} "
        f"{'-':>13}  all {n} requests timed, one pass"
    )
    if not have_ours:
        print(f"{'d':3} {'trae-groups engine':<46} {'--':>8} {'--':>13}  bench/ours.py not present")
    for slot in ("d", "d+"):
        ours = results.get(slot)
        if ours is None:
            continue
        for key in ("a", "b", "c", "c'"):
            peer = results.get(key)
            if peer is not None:
                print(f"{slot}/{key}: {ours.tokens_per_s / peer.tokens_per_s:.2f}x")
        print(f"{slot} greedy == generate: {peers.count_equal(ours.outputs, reference)}/{n}")
    if latency is not None:
        print(f"\nbatch-1 generate: prefill {latency[0]:.1f} ms, decode {latency[1]:.2f} ms/token")
    if roof is not None:
        print_roofline(roof, latency, results)


def print_roofline(
    roof: peers.Roofline,
    latency: tuple[float, float] | None,
    results: dict[str, PeerResult | None],
) -> None:
    print("\n## Roofline (this machine, now)")
    print(f"memory: read {roof.read_gb_s:.1f} GB/s (sum), copy {roof.copy_gb_s:.1f} GB/s (r+w)")
    for key, rate in roof.gemm_gflops.items():
        print(f"GEMM {key:<26} {rate:7.1f} GFLOP/s")
    floor = roof.batch1_floor_ms
    print(
        f"weights read per decode step {roof.weight_bytes_per_step / 1e6:.1f} MB -> "
        f"batch-1 floor {floor:.2f} ms/token ({1e3 / floor:.0f} tok/s)"
        + (f"; generate is at {floor / latency[1]:.0%} of it" if latency else "")
    )
    print(f"matmul FLOPs per token {roof.flops_per_token / 1e6:.1f} M")
    for key in roof.gemm_gflops:
        print(f"  large-batch ceiling at {key:<26} {roof.batch_ceiling_tokens_s(key):7.0f} tok/s")
    best = max(roof.gemm_gflops, key=roof.gemm_gflops.get)
    ceiling = roof.batch_ceiling_tokens_s(best)
    shares = [
        f"{k} {r.tokens_per_s / ceiling:.0%}"
        for k, r in results.items()
        if r is not None and k != "a"
    ]
    print(f"share of the best ceiling ({best}, {ceiling:.0f} tok/s): " + ", ".join(shares))


if __name__ == "__main__":
    main()
