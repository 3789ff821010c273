"""Encoder serving vs transformers' pipeline, measured in the same run.

256 texts of about 32 tokens go to a 4-layer, hidden-256 BERT classifier (random
init, saved to a temp dir, loaded through WeightStore):

* ours: all sent concurrently (8 client threads) through EngineLoop + EncoderWorker;
* peer 1: ``pipeline("text-classification")`` one text at a time;
* peer 2: the same pipeline with ``batch_size=32``.

Prints medians of ``--runs`` runs (seq/s) and the ratios, then memory (three graph
nodes on one model vs one model's bytes) and int8-vs-float agreement.

    python bench/encoders.py [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer, pipeline

from trae_groups.engine.batcher import BatcherConfig
from trae_groups.engine.encoder_runner import EncoderRunner
from trae_groups.engine.encoder_worker import EncoderWorker
from trae_groups.engine.loop import EngineLoop
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.weights import WeightStore, tensor_slots

N_TEXTS, CLIENTS = 256, 8
LABELS = ["billing", "support", "sales", "spam"]


def make_words(n: int, rng: random.Random) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
    return sorted(words)


def build_model(folder: Path, words: list[str]) -> None:
    """A WordPiece tokenizer from a generated vocab and a random BERT classifier."""
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = [*specials, *words, *chars, *("##" + c for c in chars)]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def make_texts(words: list[str], rng: random.Random) -> list[str]:
    """~32 tokens each (24..40 words of one token, plus [CLS]/[SEP])."""
    return [" ".join(rng.choices(words, k=rng.randint(22, 38))) for _ in range(N_TEXTS)]


def interleaved(methods: dict[str, Callable[[], object]], runs: int) -> dict[str, list[float]]:
    """Seconds per run per method; runs alternate between methods so that load from
    other processes on the machine falls on every method alike."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(runs):
        for name, fn in methods.items():
            gc.collect()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def ours(worker: EncoderWorker, texts: list[str]) -> list[dict]:
    results: list = [None] * len(texts)
    chunk = len(texts) // CLIENTS
    barrier = threading.Barrier(CLIENTS)

    def client(k: int) -> None:
        barrier.wait()
        span = range(k * chunk, (k + 1) * chunk)
        futures = [(i, worker.submit(texts[i], request_id=f"r{i}")) for i in span]
        for i, f in futures:
            results[i] = f.result()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def serve(loaded, pool: MemoryPool, name: str) -> tuple[EngineLoop, EncoderWorker]:
    loop = EngineLoop(name="bench-encoders")
    config = BatcherConfig(max_batch_size=32, preferred_batch_size=32, timeout_ms=5)
    worker = EncoderWorker(name, loaded, batcher=config, pool=pool, wake=loop.wake)
    loop.add_worker(worker)
    loop.start()
    return loop, worker


def throughput(folder: Path, texts: list[str], runs: int) -> dict[str, float]:
    store = WeightStore()
    loaded = store.load(folder, "classify")
    q8 = store.load(folder, "classify", quantize="int8")
    pool = MemoryPool.from_size(256 << 20, page_bytes=64 << 10)
    pipe = pipeline("text-classification", model=loaded.model, tokenizer=loaded.tokenizer)
    pipe(texts[:4], batch_size=4)  # warm up every path once
    (loop, worker), (loop8, worker8) = serve(loaded, pool, "clf"), serve(q8, pool, "clf-int8")
    try:
        ours(worker, texts[:64])
        ours(worker8, texts[:64])
        seconds = interleaved(
            {
                "ours": lambda: ours(worker, texts),
                "ours int8": lambda: ours(worker8, texts),
                "pipeline 1-at-a-time": lambda: [pipe(t) for t in texts],
                "pipeline batch 32": lambda: pipe(texts, batch_size=32),
            },
            runs,
        )
    finally:
        loop.stop()
        loop8.stop()
    assert pool.stats().used_pages == 0
    stats = worker.stats()
    sizes = stats["batch_sizes"]
    return {
        "median": {name: N_TEXTS / statistics.median(t) for name, t in seconds.items()},
        "best": {name: N_TEXTS / min(t) for name, t in seconds.items()},
        "batching": {
            "ours mean batch size": sum(k * n for k, n in sizes.items()) / sum(sizes.values()),
            "ours padded/real tokens": stats["padding_ratio"],
        },
    }


def print_rates(rates: dict[str, dict[str, float]]) -> None:
    med, best = rates["median"], rates["best"]
    print(f"  {'seq/s':<24} {'median':>8} {'best':>8}")
    for name in med:
        print(f"  {name:<24} {med[name]:8.1f} {best[name]:8.1f}")
    for peer in ("pipeline 1-at-a-time", "pipeline batch 32"):
        label = f"ours / {peer}"
        print(f"  {label:<32} {med['ours'] / med[peer]:5.2f}x {best['ours'] / best[peer]:5.2f}x")
    label = "ours int8 / ours"
    print(
        f"  {label:<32} {med['ours int8'] / med['ours']:5.2f}x {best['ours int8'] / best['ours']:5.2f}x"
    )
    for name, value in rates["batching"].items():
        print(f"  {name:<32} {value:6.2f}")


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def memory(folder: Path) -> dict[str, float]:
    gc.collect()
    store = WeightStore()
    before = rss()
    nodes = [store.load(folder, "classify") for _ in range(3)]
    for node in nodes:  # touch every weight page
        for _, _, _, t in tensor_slots(node.model):
            t.sum()
    one = store.report()[0].bytes
    return {
        "model MB": one / 1e6,
        "three nodes / one model (store)": store.total_bytes() / one,
        "three nodes / one model (RSS growth)": (rss() - before) / one,
    }


def int8_agreement(folder: Path, texts: list[str]) -> dict[str, float]:
    store = WeightStore()
    f32 = EncoderRunner(store.load(folder, "classify")).run(texts)
    q8 = EncoderRunner(store.load(folder, "classify", quantize="int8")).run(texts)
    pairs = list(zip(f32, q8, strict=True))
    diffs = [abs(a["scores"][k] - b["scores"][k]) for a, b in pairs for k in a["scores"]]
    margin = [a["score"] - sorted(a["scores"].values())[-2] for a in f32]
    return {
        "label agreement": sum(a["label"] == b["label"] for a, b in pairs) / len(pairs),
        "mean |dp|": statistics.mean(diffs),
        "max |dp|": max(diffs),
        "median top-2 margin (float)": statistics.median(margin),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    rng = random.Random(0)
    words = make_words(3000, rng)
    texts = make_texts(words, rng)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bert-4x256"
        build_model(folder, words)
        lengths = [len(x) for x in BertTokenizer.from_pretrained(folder)(texts)["input_ids"]]
        print(
            f"{N_TEXTS} texts, tokens min/median/max {min(lengths)}/"
            f"{statistics.median(lengths)}/{max(lengths)}; torch threads 2; "
            f"medians of {args.runs} runs"
        )
        load_before = os.getloadavg()[0]
        rates = throughput(folder, texts, args.runs)
        print(f"  load average (1 min) before/after: {load_before:.1f}/{os.getloadavg()[0]:.1f}")
        print_rates(rates)
        for name, value in memory(folder).items():
            print(f"  {name:<38} {value:.3f}")
        for name, value in int8_agreement(folder, texts).items():
            print(f"  int8 {name:<33} {value:.4f}")


if __name__ == "__main__":
    main()
