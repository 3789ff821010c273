"""GPU benchmark: the Triton decode kernel against memory bandwidth, and the engine against
transformers on the same GPU. Needs CUDA; prints ratios and writes every number as JSON.

    python bench/gpu.py --out results.json            # full run, < 8 min on an H200
    python bench/gpu.py --out results.json --quick    # ~1 min smoke run

(a) kernel: decode attention for 64 sequences x 1k-4k contexts, 8 kv heads, head_dim 128,
    bf16, over a byte pool laid out like the engine's (strided pages, scattered page ids).
    Achieved bandwidth = (K/V bytes read + q + out) / median time, as a fraction of the
    peak (--peak-tbps, 4.3 TB/s by default: what an H200 sustains in practice). The torch
    reference and, if installed, flash-attn (on its own 256-token pages) are timed too.
    Outputs are checked against the reference first.
(b) engine: a random-init Llama-architecture model of ~1.1B parameters in bf16, 64
    concurrent requests, greedy with eos ignored. Output tokens/s of trae-groups'
    LLMEngine vs transformers ``generate`` on one static left-padded batch and vs
    transformers' continuous batching (long-lived ``init_continuous_batching`` manager).
(c) graphs: the same engine with ``compile=True`` (decode steps replayed from CUDA graphs)
    against eager, at batch 1 and 64: tokens/s, start-up seconds and memory of the capture.
Peers that fail are reported and skipped, never fatal.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from peers import collect_results

# ~1.1B parameters: Llama-3.2-1B's shape with a 32k vocabulary and an untied head
LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# --cpu-dry-run: the same code paths on CPU with a toy model, to catch bugs before GPU time
TINY = dict(
    LLAMA_1B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
PAD_ID = 0
DEV = "cuda"  # "cpu" under --cpu-dry-run


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


def attempt(label: str, fn: Callable[[], dict]) -> dict:
    """Run one measurement; a failure is recorded with its cause and the run goes on."""
    log(f"-- {label}")
    start = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # a benchmark reports what broke and carries on
        log(f"   FAILED: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    res["wall_s"] = round(time.perf_counter() - start, 2)
    return res


def cuda_time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() between CUDA events."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if DEV != "cuda":
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---------------------------------------------------------------------------------------
# (a) decode kernel bandwidth
# ---------------------------------------------------------------------------------------


def decode_case(num_seqs: int, ctx_lens: list[int], kv_heads: int, heads: int, dim: int, page: int):
    """Caches as the engine sees them (a KVView of a byte pool: 4 layers, K and V per page)
    plus a decode-only PagedBatch with scattered pages."""
    from trae_groups.engine.memory_pool import KVLayout, MemoryPool
    from trae_groups.kernels import PagedBatch

    dtype, dev = torch.bfloat16, torch.device(DEV)
    layout = KVLayout(num_layers=4, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype)
    pages_per_seq = [-(-c // page) for c in ctx_lens]
    num_pages = sum(pages_per_seq) + 1
    pool = MemoryPool(num_pages, page * layout.bytes_per_token, dev)
    kv = pool.kv_view(layout, page)
    k_cache, v_cache = kv.k[2], kv.v[2]
    k_cache.normal_()
    v_cache.normal_()
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
    width = max(pages_per_seq)
    tables, at = [], 0
    for n in pages_per_seq:
        tables.append(order[at : at + n] + [0] * (width - n))
        at += n
    slots = [tables[s][(c - 1) // page] * page + (c - 1) % page for s, c in enumerate(ctx_lens)]
    batch = PagedBatch(
        slot_mapping=torch.tensor(slots, device=dev),
        query_starts=list(range(num_seqs + 1)),
        context_lens=list(ctx_lens),
        block_tables=torch.tensor(tables, device=dev),
        num_decodes=num_seqs,
        tokens_per_page=page,
        context_lens_t=torch.tensor(ctx_lens, device=dev),
    )
    q = torch.randn(num_seqs, heads, dim, dtype=dtype, device=dev)
    k = torch.randn(num_seqs, kv_heads, dim, dtype=dtype, device=dev)
    return q, k, k.clone(), k_cache, v_cache, batch, pool


def flash_decode_ms(q, ctx_lens, kv_heads, dim, iters) -> float | None:
    """flash-attn's paged decode on its own contiguous 256-token pages, same contexts."""
    from trae_groups.kernels import flash_attn_backend as fa

    if not fa.available(DEV):
        return None
    from trae_groups.kernels import PagedBatch

    page, dev = 256, q.device
    pages = [-(-c // page) for c in ctx_lens]
    kc = torch.randn(sum(pages) + 1, page, kv_heads, dim, dtype=q.dtype, device=dev)
    vc = torch.randn_like(kc)
    width, tables, at = max(pages), [], 1
    for n in pages:
        tables.append(list(range(at, at + n)) + [0] * (width - n))
        at += n
    n = q.shape[0]
    batch = PagedBatch(
        slot_mapping=torch.zeros(n, dtype=torch.long, device=dev),
        query_starts=list(range(n + 1)),
        context_lens=list(ctx_lens),
        block_tables=torch.tensor(tables, device=dev),
        num_decodes=n,
        tokens_per_page=page,
        context_lens_t=torch.tensor(ctx_lens, device=dev),
    )
    k = torch.zeros(n, kv_heads, dim, dtype=q.dtype, device=dev)
    return cuda_time_ms(lambda: fa.paged_attention(q, k, k, kc, vc, batch, dim**-0.5), iters)


def kernel_bench(args) -> dict:
    from trae_groups.kernels import attention as reference
    from trae_groups.kernels import triton_attention as tri

    if not tri.available(DEV) or (DEV == "cuda" and tri.INTERPRETED):
        raise RuntimeError("compiled triton on CUDA is required (is TRITON_INTERPRET set?)")
    num_seqs, kv_heads, heads, dim, page = 64, 8, 32, 128, 16
    if DEV == "cpu":  # dry run through the interpreter
        num_seqs, kv_heads, heads, dim = 4, 2, 8, 32
    peak = args.peak_tbps * 1e12
    gen = torch.Generator().manual_seed(1)
    shapes = {"ctx1k": [1024] * num_seqs, "ctx2k": [2048] * num_seqs, "ctx4k": [4096] * num_seqs}
    shapes["mixed_1k_4k"] = torch.randint(1024, 4097, (num_seqs,), generator=gen).tolist()
    if args.quick:
        shapes = {k: shapes[k] for k in ("ctx1k", "mixed_1k_4k")}
    if DEV == "cpu":
        shapes = {"tiny": [100, 37, 64, 5]}
    iters = 2 if DEV == "cpu" else 5 if args.quick else 20
    results = {}
    for name, ctx in shapes.items():
        q, k, v, kc, vc, batch, pool = decode_case(num_seqs, ctx, kv_heads, heads, dim, page)
        scale = dim**-0.5
        got = tri.paged_attention(q, k, v, kc, vc, batch, scale)
        want = reference.paged_attention(q, k, v, kc, vc, batch, scale)
        err = (got.float() - want.float()).abs().max().item()
        call = (q, k, v, kc, vc, batch, scale)
        tri_ms = cuda_time_ms(partial(tri.paged_attention, *call), iters)
        ref_ms = cuda_time_ms(partial(reference.paged_attention, *call), max(3, iters // 4))
        store_ms = cuda_time_ms(partial(tri.store_kv, k, v, kc, vc, batch.slot_mapping), iters)
        fa_ms = None
        if not args.quick:
            try:
                fa_ms = flash_decode_ms(q, ctx, kv_heads, dim, iters)
            except Exception as exc:
                log(f"   flash-attn decode skipped: {exc}")
        item = 2  # bf16
        kv_bytes = 2 * sum(ctx) * kv_heads * dim * item
        io_bytes = 2 * num_seqs * heads * dim * item
        bw = (kv_bytes + io_bytes) / (tri_ms * 1e-3)
        results[name] = {
            "contexts": [min(ctx), max(ctx), sum(ctx) // num_seqs],
            "max_abs_err_vs_reference": err,
            "triton_ms": tri_ms,
            "reference_ms": ref_ms,
            "flash_attn_ms": fa_ms,
            "store_kv_ms": store_ms,
            "bytes": kv_bytes + io_bytes,
            "achieved_tbps": bw / 1e12,
            "fraction_of_peak": bw / peak,
            "speedup_vs_reference": ref_ms / tri_ms,
        }
        fa_txt = f", flash-attn {fa_ms:.3f} ms" if fa_ms else ""
        log(
            f"   {name:12s} triton {tri_ms:.3f} ms = {bw / 1e12:.2f} TB/s "
            f"({100 * bw / peak:.0f}% of {args.peak_tbps} TB/s), {ref_ms / tri_ms:.1f}x the torch "
            f"reference ({ref_ms:.2f} ms){fa_txt}; max err {err:.2e}"
        )
        del q, k, v, kc, vc, batch, pool
        free_cuda()
    return {
        "config": dict(
            num_seqs=num_seqs,
            kv_heads=kv_heads,
            heads=heads,
            head_dim=dim,
            tokens_per_page=page,
            dtype="bfloat16",
        ),
        "shapes": results,
    }


# ---------------------------------------------------------------------------------------
# (b) engine vs transformers
# ---------------------------------------------------------------------------------------


def build_model(folder: Path, shape: dict) -> Path:
    """Random-init Llama saved once in bf16 (reused if the config matches)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    stamp = folder / "trae_bench.json"
    if stamp.exists() and json.loads(stamp.read_text()) == shape:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device(DEV):  # random init on the GPU: seconds, not a minute of CPU
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.generation_config.eos_token_id = -1
    model.save_pretrained(folder)
    stamp.write_text(json.dumps(shape))
    n = sum(p.numel() for p in model.parameters())
    log(f"   built {n / 1e9:.2f}B-parameter model in {folder}")
    del model
    free_cuda()
    return folder


def make_prompts(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n_,), generator=gen).tolist() for n_ in lens]


def free_cuda() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def run_engine(
    folder: Path,
    shape: dict,
    prompts,
    max_new: int,
    repeats: int,
    backend: str | None,
    compile: bool = False,
) -> dict:
    from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams

    longest = max(len(p) for p in prompts) + max_new
    token_bytes = (
        shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2
    )
    pool_bytes = 2 * len(prompts) * longest * token_bytes  # twice the workload's KV
    config = EngineConfig(
        device=DEV,
        dtype="bfloat16",
        pool_bytes=pool_bytes,
        fast_linear=False,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=4096,
        attention_backend=backend,
        compile=compile,  # CUDA graphs of decode steps (engine/decode_graphs.py)
    )
    engine = LLMEngine(models={"m": str(folder)}, config=config).start()
    try:
        params = SamplingParams(max_tokens=max_new, ignore_eos=True)
        engine.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        samples, outputs = [], None
        for _ in range(repeats):
            engine.pool.clear_cache()  # no prefix hits from the previous repeat
            sync()
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            sync()
            tokens = sum(len(o.token_ids) for o in outs)
            samples.append(tokens / (time.perf_counter() - start))
            outputs = [list(o.token_ids) for o in outs]
        model_device = str(next(engine.llms["m"].model.parameters()).device)
        fixed = engine.llms["m"].runner.compiled
        return {
            "decode_graphs": None
            if fixed is None
            else {
                "sizes": list(fixed.sizes),
                "steps": fixed.steps,
                "start_s": getattr(fixed, "capture_s", None),
                "memory_mib": getattr(fixed, "memory_bytes", 0) / 2**20,
            },
            "tokens_per_s": statistics.median(samples),
            "samples": samples,
            "backend": engine.backend.name,
            "model_device": model_device,
            "outputs": outputs,
        }
    finally:
        engine.shutdown()
        del engine
        free_cuda()


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return (
        AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
        .to(DEV)
        .eval()
    )


def greedy_config(max_new: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=PAD_ID,
    )


def run_static_generate(folder: Path, prompts, max_new: int, repeats: int) -> dict:
    """One ``generate`` call on all prompts, left-padded to the longest."""
    model = load_hf(folder)
    try:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        ids, mask = ids.to(DEV), mask.to(DEV)
        cfg = greedy_config(max_new)
        with torch.inference_mode():
            model.generate(ids[:4], attention_mask=mask[:4], generation_config=greedy_config(4))
            samples, out = [], None
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, generation_config=cfg)
                sync()
                samples.append(len(prompts) * max_new / (time.perf_counter() - start))
        return {
            "tokens_per_s": statistics.median(samples),
            "samples": samples,
            "outputs": out[:, width:].tolist(),
        }
    finally:
        del model
        free_cuda()


def run_cb(folder: Path, prompts, max_new: int, repeats: int) -> dict:
    """transformers' continuous batching, one long-lived manager (setup not timed), sized
    explicitly (unsized it claims most of the free GPU memory)."""
    import transformers

    model = load_hf(folder)
    page = 256
    blocks = 2 * len(prompts) * -(-(max(len(p) for p in prompts) + max_new) // page)
    cb_cfg = transformers.ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=4096
    )
    mgr = model.init_continuous_batching(
        generation_config=greedy_config(max_new), continuous_batching_config=cb_cfg
    )
    mgr.start()
    try:
        warm = mgr.add_requests(inputs=[list(p) for p in prompts[:4]], max_new_tokens=4)
        collect_results(mgr, warm, 300.0)
        samples, outputs = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            ids = mgr.add_requests(inputs=[list(p) for p in prompts], max_new_tokens=max_new)
            got = collect_results(mgr, ids, 300.0)
            tokens = sum(len(t) for t in got.values())
            samples.append(tokens / (time.perf_counter() - start))
            outputs = [got[i] for i in ids]
        return {
            "tokens_per_s": statistics.median(samples),
            "samples": samples,
            "attn_implementation": model.config._attn_implementation,
            "outputs": outputs,
        }
    finally:
        mgr.stop(block=True)
        if hasattr(mgr, "destroy"):
            mgr.destroy()
        del model, mgr
        free_cuda()


def agreement(a: list[list[int]] | None, b: list[list[int]] | None, n: int = 8) -> float | None:
    """Share of requests whose first n greedy tokens agree (bf16 noise makes later ones drift;
    random weights give near-flat logits, so this is a smoke signal, not a parity test)."""
    if not a or not b:
        return None
    return sum(x[:n] == y[:n] for x, y in zip(a, b, strict=False)) / len(a)


def engine_bench(args) -> dict:
    shape = TINY if DEV == "cpu" else LLAMA_1B
    folder = build_model(args.model_dir / ("tiny" if DEV == "cpu" else "llama-1b"), shape)
    n, max_new = 64, (32 if args.quick else 256)
    lo, hi = (64, 128) if args.quick else (128, 512)
    if DEV == "cpu":
        n, max_new, lo, hi = 8, 6, 5, 20
    prompts = make_prompts(n, lo, hi, shape["vocab_size"])
    repeats = 1 if args.quick or DEV == "cpu" else 2
    res: dict = {
        "requests": n,
        "max_new_tokens": max_new,
        "prompt_lens": [min(map(len, prompts)), max(map(len, prompts))],
    }
    res["ours"] = attempt(
        "trae-groups LLMEngine (default backend)",
        lambda: run_engine(folder, shape, prompts, max_new, repeats, None),
    )
    if not args.quick:
        res["ours_torch_attention"] = attempt(
            "trae-groups LLMEngine (torch reference attention)",
            lambda: run_engine(folder, shape, prompts, max_new, 1, "torch"),
        )
    res["hf_generate_static"] = attempt(
        "transformers generate, static batch",
        lambda: run_static_generate(folder, prompts, max_new, repeats),
    )
    res["hf_continuous_batching"] = attempt(
        "transformers continuous batching", lambda: run_cb(folder, prompts, max_new, repeats)
    )
    ours = res["ours"].get("tokens_per_s")
    for peer in ("ours_torch_attention", "hf_generate_static", "hf_continuous_batching"):
        rate = res.get(peer, {}).get("tokens_per_s")
        if ours and rate:
            res[f"ratio_ours_over_{peer}"] = ours / rate
        if rate:
            log(f"   {peer:24s} {rate:9.1f} tok/s")
    if ours:
        log(f"   {'ours':24s} {ours:9.1f} tok/s ({res['ours'].get('backend')})")
    for key, val in res.items():
        if key.startswith("ratio_"):
            log(f"   {key}: {val:.2f}x")
    ref = res["hf_generate_static"].get("outputs")
    for key in ("ours", "hf_continuous_batching"):
        res[f"first8_agreement_{key}_vs_generate"] = agreement(res[key].get("outputs"), ref)
    for key in ("ours", "ours_torch_attention", "hf_generate_static", "hf_continuous_batching"):
        if key in res:
            res[key].pop("outputs", None)  # keep the JSON small
    return res


def graphs_bench(args) -> dict:
    """(c) decode steps replayed from CUDA graphs against the same engine eager: one request
    (launch-bound) and 64 (the engine workload), greedy tokens compared."""
    shape = LLAMA_1B
    folder = build_model(args.model_dir / "llama-1b", shape)
    lo, hi = (64, 128) if args.quick else (128, 512)
    prompts = make_prompts(64, lo, hi, shape["vocab_size"])
    res: dict = {}
    for label, batch, max_new in (("batch1", prompts[:1], 64 if args.quick else 128),
                                  ("batch64", prompts, 32 if args.quick else 64)):  # fmt: skip
        eager = attempt(f"{label} eager", lambda b=batch, m=max_new: run_engine(
            folder, shape, b, m, 1, None))  # fmt: skip
        graphs = attempt(f"{label} CUDA graphs", lambda b=batch, m=max_new: run_engine(
            folder, shape, b, m, 1, None, compile=True))  # fmt: skip
        row = {"eager": eager, "graphs": graphs}
        if eager.get("tokens_per_s") and graphs.get("tokens_per_s"):
            row["ratio_graphs_over_eager"] = graphs["tokens_per_s"] / eager["tokens_per_s"]
            row["same_tokens"] = eager["outputs"] == graphs["outputs"]
            row["first8_agreement"] = agreement(graphs["outputs"], eager["outputs"])
            log(f"   {label}: eager {eager['tokens_per_s']:.1f} tok/s, graphs "
                f"{graphs['tokens_per_s']:.1f} ({row['ratio_graphs_over_eager']:.2f}x), "
                f"{graphs.get('decode_graphs')}")  # fmt: skip
        for side in (eager, graphs):
            side.pop("outputs", None)
        res[label] = row
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    parser.add_argument("--quick", action="store_true", help="~1 minute smoke run")
    parser.add_argument("--peak-tbps", type=float, default=4.3, help="HBM bandwidth to compare to")
    parser.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "trae-bench"
    )
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-graphs", action="store_true")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="toy shapes on CPU (kernels need TRITON_INTERPRET=1): checks the script, not speed",
    )
    args = parser.parse_args()
    global DEV
    if args.cpu_dry_run:
        DEV = "cpu"
    elif not torch.cuda.is_available():
        log("bench/gpu.py needs a CUDA GPU (or --cpu-dry-run)")
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "quick": args.quick,
        "peak_tbps": args.peak_tbps,
    }
    for mod in ("triton", "transformers", "flash_attn"):
        try:
            report[mod] = __import__(mod).__version__
        except Exception:
            report[mod] = None
    log(
        f"{report['device']}, torch {report['torch']}, triton {report['triton']}, "
        f"transformers {report['transformers']}, flash_attn {report['flash_attn']}"
    )
    if not args.skip_kernel:
        report["kernel"] = attempt("(a) decode kernel bandwidth", lambda: kernel_bench(args))
    if not args.skip_engine:
        report["engine"] = attempt("(b) engine vs transformers", lambda: engine_bench(args))
    if not args.skip_graphs and DEV == "cuda":
        report["graphs"] = attempt("(c) decode CUDA graphs vs eager", lambda: graphs_bench(args))
    report["total_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    log(f"wrote {args.out} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
