"""Constrained decoding cost: the same 32 concurrent requests with a JSON Schema on
every one, and without, on one engine, in this run; plus the grammar compile time of
a schema, cold (first request) and cached.

By default a tiny LLM built here (random weights, a byte-level BPE tokenizer trained
on a small corpus); ``--model FOLDER`` takes any local transformers LLM folder with a
tokenizer (the demo's SmolLM2, for a real 49k vocabulary). ``ignore_eos`` keeps every
request at --tokens tokens, constrained or not, so tokens/s compare like for like.

    python bench/structured.py [--model FOLDER] [--runs 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build_llm  # noqa: E402
from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from trae_groups.engine.constraints import Constraint  # noqa: E402

#: The demo's extraction: an order id and a product, as the support graph would ask.
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[0-9]{4,6}$"},
        "product": {"type": "string", "maxLength": 24},
        "urgent": {"type": "boolean"},
    },
    "required": ["order_id", "product", "urgent"],
    "additionalProperties": False,
}
#: For tokens/s: a schema no request can complete within --tokens (a long string), so
#: constrained rows run as many steps as unconstrained ones and batches stay alike.
LONG = {
    "type": "object",
    "properties": {"order_id": {"type": "integer"}, "note": {"type": "string", "minLength": 4000}},
    "required": ["order_id", "note"],
}
PROMPT = "Extract the order from: my order 48213 for a blue kettle never came. JSON:"


def run(engine: LLMEngine, params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = engine.generate([PROMPT] * len(params), params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    folder = args.model
    if folder is None:
        folder = build_llm(Path(tempfile.mkdtemp()) / "llm", "llama", hidden_size=256,
                           intermediate_size=512, num_hidden_layers=4,
                           max_position_embeddings=1024)  # fmt: skip
    engine = LLMEngine({"m": folder}, EngineConfig(pool_bytes=256 << 20))
    worker = engine.llms["m"]
    vocab = worker.model.config.get_text_config().vocab_size

    started = time.perf_counter()
    grammars = worker.grammars()
    tokenizer_s = time.perf_counter() - started
    constraint = Constraint.json_schema(SCHEMA)
    started = time.perf_counter()
    grammars.matcher(constraint)
    cold_s = time.perf_counter() - started
    started = time.perf_counter()
    grammars.matcher(constraint)
    cached_s = time.perf_counter() - started

    # a schema the engine must follow to the end: no EOS before it is complete
    n = args.requests
    plain = [SamplingParams(max_tokens=args.tokens, ignore_eos=True)] * n
    long = Constraint.json_schema(LONG)
    typed = [SamplingParams(max_tokens=args.tokens, constraint=long)] * n
    for _ in range(2):  # warm-up at the measured batch: the first runs of a shape are slow
        run(engine, plain)
        run(engine, typed)
    rates: dict[str, list[float]] = {"plain": [], "typed": []}
    for _ in range(args.runs):  # alternate, so drift lands on both
        for name, params in (("plain", plain), ("typed", typed)):
            seconds, tokens = run(engine, params)
            rates[name].append(tokens / seconds)
    plain_tps, typed_tps = (statistics.median(rates[k]) for k in ("plain", "typed"))
    print(f"model {folder} (vocab {vocab}), {n} concurrent requests, medians of {args.runs}")
    print(f"unconstrained: {plain_tps:.0f} tok/s; JSON Schema on every request: {typed_tps:.0f} tok/s"
          f" ({100 * (1 - typed_tps / plain_tps):+.1f}% slower; target <= 10%)")  # fmt: skip
    print(f"llguidance tokenizer: {tokenizer_s * 1000:.0f} ms once per model; schema compile: "
          f"{cold_s * 1000:.1f} ms cold, {cached_s * 1000:.2f} ms cached")  # fmt: skip
    engine.shutdown()


if __name__ == "__main__":
    main()
