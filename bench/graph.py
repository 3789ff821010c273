"""A composite app end to end: ours against the same models called one by one.

Workload: N concurrent requests through classify → tag → generate (32 new tokens,
greedy) on a 4-layer hidden-256 BERT classifier and tagger and the engine
benchmark's Qwen3 (~58M). The peer is what a user writes with transformers: for
each request, ``pipeline("text-classification")``, ``pipeline("token-classification")``
then ``model.generate`` — one request at a time. Both see the same requests, all
arriving at once; both are measured in this run. Also: the executor's own overhead
per node hop, on a chain of trivial python nodes.

    python bench/graph.py [--requests 32] [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertTokenizerFast,
    pipeline,
)

sys.path.insert(0, str(Path(__file__).parent))
import peers

from trae_groups.engine import EngineConfig
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime

INTENTS = ["order", "refund", "shipping", "greeting", "spam"]
TAGS = ["O", "B-PRODUCT", "I-PRODUCT", "B-CITY", "I-CITY"]
NEW_TOKENS = 32


def words(n: int, rng: random.Random) -> list[str]:
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
    return sorted(out)


def build_encoders(root: Path, vocab_words: list[str]) -> dict[str, Path]:
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *vocab_words, *chars]
    vocab += ["##" + c for c in chars]
    folders = {}
    for name, cls, labels in (
        ("intent", BertForSequenceClassification, INTENTS),
        ("ner", BertForTokenClassification, TAGS),
    ):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
        BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
        config = BertConfig(
            vocab_size=len(vocab), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, max_position_embeddings=128,
            id2label=dict(enumerate(labels)), label2id={x: i for i, x in enumerate(labels)},
        )  # fmt: skip
        torch.manual_seed(len(name))
        cls(config).save_pretrained(folder)
        folders[name] = folder
    return folders


def build_dialog(root: Path, vocab_words: list[str]) -> Path:
    """The engine benchmark's Qwen3 with a small BPE tokenizer (ids past its vocabulary
    decode to nothing; the text is not the point here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = root / "dialog"
    source = peers.build_model()
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix in (".json", ".safetensors") and not (folder / item.name).exists():
            (folder / item.name).symlink_to(item)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(vocab_words[i : i + 20]) for i in range(0, len(vocab_words), 5)],
        trainers.BpeTrainer(vocab_size=4000, special_tokens=["<unk>", "<eos>"]),
    )
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(
        folder
    )
    return folder


GRAPH = """
name: app
models:
  intent: {{source: {intent}, task: classify, max_batch_size: 32, max_queue_delay_ms: 5}}
  ner: {{source: {ner}, task: tag, max_batch_size: 32, max_queue_delay_ms: 5}}
  dialog: {{source: {dialog}, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  entities: {{model: ner, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "{{{{ intent.label }}}} {{{{ entities.spans | length }}}} {{{{ inputs.text }}}}"
    params: {{max_tokens: {new}, temperature: 0}}
outputs: {{intent: intent.label, reply: reply.text, tokens: reply.tokens}}
"""


def naive(folders: dict[str, Path], texts: list[str]) -> tuple[float, list[float]]:
    """One request at a time; latency of request i counts its wait behind the others."""
    clf = pipeline("text-classification", model=str(folders["intent"]))
    ner = pipeline("token-classification", model=str(folders["ner"]), aggregation_strategy="simple")
    model = AutoModelForCausalLM.from_pretrained(folders["dialog"]).eval()
    tok = AutoTokenizer.from_pretrained(folders["dialog"])
    config = peers.greedy_config(NEW_TOKENS)
    start = time.perf_counter()
    done = []
    for text in texts:
        label = clf(text)[0]["label"]
        spans = ner(text)
        ids = tok(f"{label} {len(spans)} {text}", return_tensors="pt").input_ids
        with torch.no_grad():
            model.generate(ids, generation_config=config)
        done.append(time.perf_counter() - start)
    return done[-1], done


def ours(executor, texts: list[str]) -> tuple[float, list[float]]:
    async def one(text: str, start: float) -> float:
        result = await executor.run({"text": text})
        assert result.outputs["tokens"] == NEW_TOKENS
        return time.perf_counter() - start

    async def all_at_once() -> list[float]:
        start = time.perf_counter()
        return await asyncio.gather(*(one(t, start) for t in texts))

    latencies = asyncio.run(all_at_once())
    return max(latencies), latencies


HOPS = 50


async def _time_chain(executor, runs: int) -> list[float]:
    per_hop = []
    for _ in range(runs):
        t = time.perf_counter()
        await executor.run({"x": "a"})
        per_hop.append((time.perf_counter() - t) * 1000 / HOPS)
    return per_hop


def hop_overhead(runs: int) -> tuple[float, float]:
    """p50 ms per hop on a chain of trivial async python nodes (and sync ones)."""
    results = []
    for fn in ("bench_nodes:passthrough_async", "bench_nodes:passthrough"):
        nodes = [f'  n0: {{function: "{fn}", args: {{x: "{{{{ inputs.x }}}}"}}}}']
        nodes += [
            f'  n{i}: {{function: "{fn}", args: {{x: "{{{{ n{i - 1} }}}}"}}}}'
            for i in range(1, HOPS)
        ]
        text = (
            "name: chain\ninputs: {x: str}\nnodes:\n"
            + "\n".join(nodes)
            + f"\noutputs: {{x: n{HOPS - 1}}}\n"
        )
        spec = load_graph_text(text, "chain.yaml")
        rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=1 << 20))
        executor = rt.bind(spec)
        rt.start()
        per_hop = asyncio.run(_time_chain(executor, runs))
        rt.shutdown()
        results.append(statistics.median(per_hop))
    return results[0], results[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    peers.quiet_known_warnings()
    global NEW_TOKENS
    if args.quick:
        NEW_TOKENS, args.runs, args.requests = 8, 1, 8
    rng = random.Random(0)
    vocab_words = words(3000, rng)
    texts = [
        " ".join(rng.choices(vocab_words, k=rng.randint(12, 24))) for _ in range(args.requests)
    ]
    root = Path(tempfile.mkdtemp(prefix="trae-graph-bench-"))
    folders = {**build_encoders(root, vocab_words), "dialog": build_dialog(root, vocab_words)}
    spec = load_graph_text(GRAPH.format(new=NEW_TOKENS, **folders), "app.yaml")
    rt = ModelRuntime.for_specs(
        [spec], EngineConfig(pool_bytes=256 << 20, max_num_batched_tokens=1024)
    )
    executor = rt.bind(spec)
    rt.start()
    ours(executor, texts[:4])  # warm-up
    print(f"{args.requests} concurrent requests, classify → tag → generate({NEW_TOKENS}); "
          f"{torch.get_num_threads()} threads; {peers.machine_load()}")  # fmt: skip
    naive_runs, our_runs = [], []
    for _ in range(args.runs):  # interleaved, so load from elsewhere hits both alike
        our_runs.append(ours(executor, texts))
        naive_runs.append(naive(folders, texts))
    rt.shutdown()
    n = args.requests
    ours_rps = statistics.median(n / total for total, _ in our_runs)
    naive_rps = statistics.median(n / total for total, _ in naive_runs)
    ours_lat = statistics.median(statistics.mean(lat) for _, lat in our_runs)
    naive_lat = statistics.median(statistics.mean(lat) for _, lat in naive_runs)
    naive_one = statistics.median(lat[-1] / n for _, lat in naive_runs)
    print(f"  naive per-request pipeline: {naive_rps:7.2f} req/s   mean latency {naive_lat * 1000:8.0f} ms "
          f"(one request alone: {naive_one * 1000:.0f} ms)")  # fmt: skip
    print(
        f"  trae-groups graph:          {ours_rps:7.2f} req/s   mean latency {ours_lat * 1000:8.0f} ms"
    )
    print(f"  ratio: {ours_rps / naive_rps:.1f}x requests/s (target >= 10x); "
          f"mean latency {naive_lat / ours_lat:.1f}x lower")  # fmt: skip
    async_hop, sync_hop = hop_overhead(max(args.runs, 5) * 4)
    print(f"  executor overhead per hop (p50, {HOPS}-node chain): async python {async_hop:.3f} ms, "
          f"sync python (thread) {sync_hop:.3f} ms (target <= 0.5 ms)")  # fmt: skip


if __name__ == "__main__":
    main()
