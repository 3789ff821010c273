"""Memory for speed and accuracy on the demo's real models: float32, bf16 and int8 weights, and
int8 KV pages, in one process, peers measured in the same run.

    .venv/bin/python -m trae_groups.demo.prepare      # once: SmolLM2 + MiniLM heads, cached
    .venv/bin/python bench/memory.py                   # everything (~5 minutes on 2 cores)
    .venv/bin/python bench/memory.py --only decode --repeats 5

Sections (``--only``):
- decode: batch-1 and batch-32 decode tokens/s of SmolLM2-135M through our engine with float32,
  bf16 and int8 weights (``quantization: int8``), float KV, and with int8 KV pages (float32
  weights); rounds alternate between the configurations, medians of ``--repeats``. Greedy,
  eos off, 16-token prompts, ``--new`` tokens (the rate includes the one prefill step). Also
  per CPU second of this process (``time.process_time``): on a shared, oversubscribed machine
  wall time mostly measures the neighbours, CPU time the work (with OMP_WAIT_POLICY=PASSIVE,
  so idle threads do not spin).
- perplexity: SmolLM2's perplexity on a fixed text per weight dtype, computed through our paged
  attention (chunks of 8 tokens over the cached pages, so int8 KV is exercised), and with int8
  KV pages.
- heads: held-out intent accuracy and entity F1 of the demo's MiniLM heads, float32 vs int8,
  on the demo's own test split (data seed 0, 400 examples).
- pool: KV tokens of SmolLM2 that fit in a 256 MiB pool per KV dtype.
- gate: what ``quantization: auto`` / ``dtype: auto`` choose here, and the gate's figures.

Prints, never asserts: absolute rates drift on shared machines; compare ratios.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from trae_groups.demo.prepare import default_cache_dir
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.llm_runner import StepContext, kv_layout
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.weights import WeightStore
from trae_groups.kernels import PagedBatch

TEXT = (
    "The history of the city begins in the early medieval period, when a small settlement grew "
    "up around a river crossing. Over the following centuries, merchants built warehouses along "
    "the banks, and the town became a centre of trade in wool and grain. In the nineteenth "
    "century the arrival of the railway transformed the economy, bringing factories, new "
    "housing and a rapid rise in population. Today the old warehouses hold galleries, cafes and "
    "small workshops, and the river path is a favourite place for walkers and cyclists. Every "
    "summer a festival fills the streets with music, and visitors come from across the country "
    "to see the illuminated boats drift slowly past the medieval bridge at night."
)
CONFIGS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8 weights": {"quantization": "int8"},
    "float32 + int8 KV": {"kv_cache_dtype": "int8"},
}


def engine(folder: Path, **options) -> LLMEngine:
    config = EngineConfig(pool_bytes=256 << 20, max_num_seqs=64, **options)
    return LLMEngine({"dialog": folder}, config).start()


# -- decode ----------------------------------------------------------------------------------
def decode(folder: Path, repeats: int, new: int) -> None:
    engines = {name: engine(folder, **opts) for name, opts in CONFIGS.items()}
    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(16)] for i in range(32)]
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    rates: dict[tuple[str, int], list[float]] = {}
    per_cpu: dict[tuple[str, int], list[float]] = {}
    try:
        for eng in engines.values():  # warm-up: first-call allocations, oneDNN kernels
            eng.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
        for _ in range(repeats):
            for batch in (1, 32):
                for name, eng in engines.items():
                    start, cpu = time.perf_counter(), time.process_time()
                    outs = eng.generate(prompts[:batch], params)
                    seconds = time.perf_counter() - start
                    cpu = time.process_time() - cpu
                    tokens = sum(len(o.token_ids) for o in outs)
                    rates.setdefault((name, batch), []).append(tokens / seconds)
                    per_cpu.setdefault((name, batch), []).append(tokens / cpu)
    finally:
        for eng in engines.values():
            eng.shutdown()
    for label, table in (("tokens per second", rates), ("tokens per CPU second", per_cpu)):
        print(f"\ndecode {label}, SmolLM2-135M, {new} new tokens, median of {repeats}")
        print(f"  {'weights / KV':<22}{'batch 1':>10}{'x f32':>8}{'batch 32':>10}{'x f32':>8}")
        for name in CONFIGS:
            row = [statistics.median(table[(name, b)]) for b in (1, 32)]
            base = [statistics.median(table[("float32", b)]) for b in (1, 32)]
            print(f"  {name:<22}{row[0]:>10.1f}{row[0] / base[0]:>7.2f}x"
                  f"{row[1]:>10.1f}{row[1] / base[1]:>7.2f}x")  # fmt: skip


# -- perplexity --------------------------------------------------------------------------------
@torch.inference_mode()
def paged_perplexity(eng: LLMEngine, ids: list[int], chunk: int = 8) -> float:
    """Perplexity of ``ids`` through the engine's own model, pages and attention backend:
    the text goes in chunks, each attending to the pages the earlier ones filled."""
    worker = eng.llm("dialog")
    page = worker.kv.tokens_per_page
    pages = eng.pool.allocate("bench", -(-len(ids) // page), zero=True)
    try:
        nll = 0.0
        for lo in range(0, len(ids) - 1, chunk):
            hi = min(lo + chunk, len(ids) - 1)
            positions = list(range(lo, hi))
            batch = PagedBatch(
                slot_mapping=torch.tensor([pages[p // page] * page + p % page for p in positions]),
                query_starts=[0, hi - lo],
                context_lens=[hi],
                block_tables=torch.tensor([pages[: -(-hi // page)]]),
                num_decodes=0,
                tokens_per_page=page,
                context_lens_t=torch.tensor([hi]),
            )
            logits = (
                worker.model(
                    input_ids=torch.tensor([ids[lo:hi]]),
                    position_ids=torch.tensor([positions]),
                    use_cache=False,
                    logits_to_keep=torch.arange(hi - lo),
                    trae_step=StepContext(batch, worker.kv, eng.backend),
                )
                .logits[0]
                .float()
            )
            target = torch.tensor(ids[lo + 1 : hi + 1])
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        return math.exp(nll / (len(ids) - 1))
    finally:
        eng.pool.release(pages)


def perplexity(folder: Path) -> None:
    tokenizer = WeightStore().load(folder, "generate").tokenizer
    ids = tokenizer(TEXT)["input_ids"]
    print(f"\nperplexity of SmolLM2-135M on a fixed {len(ids)}-token text (paged, chunks of 8)")
    base = None
    for name, opts in CONFIGS.items():
        eng = engine(folder, **opts)
        try:
            ppl = paged_perplexity(eng, ids)
        finally:
            eng.shutdown()
        base = base or ppl
        print(f"  {name:<22}{ppl:>9.3f}  ({ppl / base - 1:+.2%} vs float32)")


# -- heads -------------------------------------------------------------------------------------
@torch.inference_mode()
def heads(root: Path) -> None:
    from trae_groups.demo.data import make_dataset
    from trae_groups.engine.ner import aggregate

    test = make_dataset(0, 1600, 400).test
    texts = [e.text for e in test]
    print(f"\ndemo heads on the held-out split ({len(test)} examples), float32 vs int8")
    store = WeightStore()
    for quantize in (None, "int8"):
        intent = store.load(root / "intent", "classify", quantize=quantize)
        ner = store.load(root / "ner", "tag", quantize=quantize)
        hits, (tp, fp, fn) = 0, (0, 0, 0)
        for start in range(0, len(texts), 64):
            part, gold = texts[start : start + 64], test[start : start + 64]
            enc = intent.tokenizer(part, padding=True, return_tensors="pt")
            labels = intent.model(**enc).logits.argmax(-1).tolist()
            hits += sum(
                intent.config.id2label[i] == e.intent for i, e in zip(labels, gold, strict=True)
            )
            enc = ner.tokenizer(
                part, padding=True, return_offsets_mapping=True, return_tensors="pt"
            )
            offsets = enc.pop("offset_mapping").tolist()
            best, index = ner.model(**enc).logits.softmax(-1).max(-1)
            for row, example in enumerate(gold):
                tags = [ner.config.id2label[int(i)] for i in index[row]]
                spans = aggregate(
                    tags, best[row].tolist(), offsets[row], example.text, enc.word_ids(row)
                )
                got = {(s.start, s.end, s.entity) for s in spans}
                want = set(example.spans)
                tp, fp, fn = tp + len(got & want), fp + len(got - want), fn + len(want - got)
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        print(
            f"  {quantize or 'float32':<8} intent accuracy {hits / len(test):.4f}  entity F1 {f1:.4f}"
        )


# -- pool --------------------------------------------------------------------------------------
def pool(folder: Path) -> None:
    config = WeightStore().load(folder, "generate").config
    print("\nKV tokens of SmolLM2-135M in a 256 MiB pool (16-token pages)")
    base = None
    for name, dtype, storage in (("float32", torch.float32, None), ("bfloat16", torch.bfloat16, None),
                                 ("int8", torch.float32, torch.int8)):  # fmt: skip
        layout = kv_layout(config, dtype, storage)
        p = MemoryPool.from_size(256 << 20, -(-layout.bytes_per_token * 16 // 64) * 64, "cpu")
        tokens = p.num_pages * p.tokens_per_page(layout)
        base = base or tokens
        print(
            f"  {name:<10}{layout.bytes_per_token:>7} B/token{tokens:>10,} tokens ({tokens / base:.2f}x)"
        )


# -- gate --------------------------------------------------------------------------------------
def gate(root: Path) -> None:
    from trae_groups.engine.auto_weights import load_auto
    from trae_groups.engine.hardware import detect
    from trae_groups.engine.llm_runner import ATTN_NAME

    hw = detect()
    print(f"\nauto weights on this machine ({hw.describe()})")
    store = WeightStore()
    for name, task, kwargs in (("dialog", "generate", {"attn_implementation": ATTN_NAME}),
                               ("intent", "classify", {}), ("ner", "tag", {})):  # fmt: skip
        start = time.perf_counter()
        loaded, _ = load_auto(store, root / name, task, hw, dtype_auto=True, quant_auto=True,
                              **kwargs)  # fmt: skip
        print(f"  {name}: {loaded.choice}  [{time.perf_counter() - start:.1f} s]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="the demo's models folder")
    parser.add_argument("--only", choices=["decode", "perplexity", "heads", "pool", "gate"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new", type=int, default=32, help="new tokens per request (decode)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = args.root or default_cache_dir()
    dialog = root / "dialog"
    print(f"models: {root}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    sections = {
        "pool": lambda: pool(dialog),
        "heads": lambda: heads(root),
        "perplexity": lambda: perplexity(dialog),
        "gate": lambda: gate(root),
        "decode": lambda: decode(dialog, args.repeats, args.new),
    }
    for name, run in sections.items():
        if args.only in (None, name):
            run()


if __name__ == "__main__":
    main()
