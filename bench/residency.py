"""What serving more models than fit costs: three LLMs, all resident vs on demand.

Workload: three Llama-shaped LLMs (hidden 512, 4 layers, vocab 8000, ~83 MB each in
float32, random weights), one graph, requests that each name one model, interleaved
(a, b, c, a, ...), ``--concurrency`` at a time, 16 new tokens, greedy. The same
requests run three ways in this process, each on a fresh runtime:

* all resident (no budget): the peer;
* a weight budget for two of the three (``resident: on_demand``): a request for the
  third waits while the least recently used idle model is evicted and it loads;
* a budget for one: every change of model is an eviction and a load.

Printed: requests/s of each as a ratio of the peer's (median of runs), loads,
evictions, median load time, and whether every answer equals the peer's.

    python bench/residency.py [--requests 24] [--runs 3] [--concurrency 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import peers

from trae_groups.engine import EngineConfig
from trae_groups.engine.weights import estimate_bytes
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime

NAMES = ("a", "b", "c")
SHAPE = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=8000, max_position_embeddings=512,
)  # fmt: skip


def tokenizer():
    """A small byte-level BPE tokenizer (graph prompts are text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["hello world, how are you today?"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def build(root: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    for seed, name in enumerate(NAMES):
        torch.manual_seed(seed)
        config = LlamaConfig(**SHAPE, tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
        LlamaForCausalLM(config).save_pretrained(root / name)
        tok.save_pretrained(root / name)


def graph(root: Path, budget: int | None) -> str:
    resident = ", resident: on_demand" if budget else ""
    models = "\n".join(f"  {n}: {{source: {root / n}, task: generate{resident}}}" for n in NAMES)
    nodes = "\n".join(
        f"  {n}: {{model: {n}, prompt: '{{{{ inputs.text }}}}', params: {{max_tokens: 16, "
        f"temperature: 0}}}}"
        for n in NAMES
    )
    resources = f"resources: {{weight_budget: {budget}}}\n" if budget else ""
    outputs = ", ".join(f"{n}: {n}.text" for n in NAMES)
    return (
        f"name: trio\n{resources}models:\n{models}\ninputs: {{text: str}}\nnodes:\n{nodes}\n"
        f"outputs: {{{outputs}}}\n"
    )


def run_once(root: Path, budget: int | None, calls: list[str], concurrency: int) -> dict:
    spec = load_graph_text(graph(root, budget), str(root / "trio.yaml"))
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=64 << 20))
    executor = rt.bind(spec)
    rt.start()

    async def drive() -> list[str]:
        results: list[str] = []
        for start in range(0, len(calls), concurrency):
            batch = calls[start : start + concurrency]
            done = await asyncio.gather(
                *(executor.run({"text": "hello world"}, outputs=[m]) for m in batch)
            )
            results += [r.outputs[m] for r, m in zip(done, batch, strict=True)]
        return results

    try:
        started = time.perf_counter()
        texts = asyncio.run(drive())
        seconds = time.perf_counter() - started
        residency = rt.stats().residency
    finally:
        rt.shutdown()
    loads = sum(r.loads for r in residency.values())
    return {
        "rps": len(calls) / seconds,
        "texts": texts,
        "loads": loads,
        "evictions": sum(r.evictions for r in residency.values()),
        "load_s": [r.load_seconds for r in residency.values() if r.loads],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=3)
    args = parser.parse_args()
    peers.quiet_known_warnings()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="trae-residency-"))
    build(root)
    one = estimate_bytes(root / "a", torch.float32)
    calls = [NAMES[i % 3] for i in range(args.requests)]
    setups = {
        "all resident": None,
        "budget for two": int(2.5 * one),
        "budget for one": int(1.5 * one),
    }
    results: dict[str, list[dict]] = {name: [] for name in setups}
    for _ in range(args.runs):  # interleave the setups so machine noise hits each alike
        for name, budget in setups.items():
            results[name].append(run_once(root, budget, calls, args.concurrency))
    peer = statistics.median(r["rps"] for r in results["all resident"])
    print(f"machine: {peers.machine_load()}")
    print(f"{args.requests} requests, {args.concurrency} at a time, median of {args.runs} runs")
    print(f"{'setup':<16} {'req/s':>7} {'vs all':>7} {'loads':>6} {'evictions':>9} "
          f"{'load s':>7}  same answers")  # fmt: skip
    for name, runs in results.items():
        rps = statistics.median(r["rps"] for r in runs)
        load_s = [s for r in runs for s in r["load_s"]]
        same = all(r["texts"] == results["all resident"][0]["texts"] for r in runs)
        print(
            f"{name:<16} {rps:7.2f} {rps / peer:7.2f} {runs[-1]['loads']:6d} "
            f"{runs[-1]['evictions']:9d} {statistics.median(load_s) if load_s else 0:7.2f}  {same}"
        )


if __name__ == "__main__":
    main()
