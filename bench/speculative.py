"""Speculative decoding on the demo's SmolLM2: tokens/s with and without, same run.

    .venv/bin/python bench/speculative.py --model /tmp/trae-bench/smollm2-135m \\
        --batch 1 4 32 --new 96 --rounds 3
    .venv/bin/python bench/speculative.py --model /tmp/trae-bench/smollm2-135m \\
        --only graph --dtype float32          # (c) through the graph executor, batch 1

One engine with ``speculative=SpeculativeConfig(num_tokens=K)``; the runs without speculation
are the same engine's requests with ``SamplingParams(speculative=False)``, so both use the same
model, pool and threads, alternating round by round (medians of ``--rounds``). Workloads,
through the model's chat template, greedy:

(a) extraction: "copy the customer's message" prompts whose answer repeats their input;
(b) free chat: open questions, nothing to copy;
(c) rewrite, on the engine: what the second LLM of a two-LLM graph runs, a prompt holding the
    first one's reply (to (b), generated once, before timing) and asking to fix its grammar,
    with prompt lookup (``ngram``) over that prompt;
(c) graph: the real two-LLM graph (``GRAPH``) through the graph executor, one request at a
    time (batch 1): ``reply`` answers the question, a second node fixes the reply's grammar,
    in three variants that run one after another on the same reply (``after:``): plain; with ``speculative: {method: follows}`` (its model sets no
    speculation: only that node drafts, from the reply's text); and with prompt lookup
    (the same weights as a second model of the graph that sets ``ngram``). Measured:
    the rewrite node's generated tokens over its time (its node record: prefill and
    decode), acceptance of the proposals, and whether every rewrite is the same text as
    the plain one.

Engines decode eagerly (``--compile``: compile="auto" with TRAE_COMPILE=1, waited for first, so no
compile runs beside the measurement); a verifying step always runs eagerly.

For each workload and batch size: generated tokens per second with and without, their ratio,
the acceptance rate and tokens per verifying step, and whether every output is the same token
for token (greedy; how many of the outputs are): in bfloat16 as in float32, since a one-row
step runs as two rows (engine/flat_forward.py). There is no smaller model of SmolLM2's tokenizer
here for ``draft``: it is not measured. Prints, never asserts: absolute rates drift on shared
machines; compare ratios, and read the load average printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams
from trae_groups.engine.chat import chat_token_ids
from trae_groups.engine.config import COMPILE_ENV
from trae_groups.engine.spec_config import SpeculativeConfig
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime

MESSAGES = [
    "Hello, my order 48213 arrived broken. The blue ceramic mug has a crack along the handle "
    "and the box was wet. I would like a replacement sent to 12 Baker Street, London.",
    "Hi team, I was charged twice for my subscription on March 3rd. Please refund the second "
    "payment of 9.99 dollars to my card ending in 4421. Thanks, Maria Lopez.",
    "Good morning. The delivery for invoice INV-2291 is late by a week. The tracking number "
    "is ZX81-553-001 and it still says in transit at the Paris depot.",
    "Dear support, my password reset link expires before I can use it. I tried three times "
    "today from the same laptop. My account email is tom.baker@example.com.",
]
QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old.",
    "What are three good habits for staying healthy while working from home?",
    "Describe your ideal weekend in a small mountain town.",
]


def extraction(text: str) -> list[dict]:
    ask = f"Copy the customer's message below exactly, word for word.\n\nMessage: {text}"
    return [{"role": "user", "content": ask}]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def rewrite(reply: str) -> list[dict]:
    return [{"role": "user", "content": REWRITE_ASK + reply}]


REWRITE_ASK = "Fix the grammar of this text and repeat it in full.\n\nText: "
#: (c) as a graph: two generate nodes on the demo's model, the rewrite in three variants that
#: run one after another on the same reply (``after:``), each alone on the engine (batch 1):
#: ``plain``, ``followed`` (``speculative: {method: follows}``) and ``looked_up`` (prompt
#: lookup: the same weights as a second model of the graph that sets ``ngram``)
GRAPH = """\
name: rewrite
models:
  llm: {{source: {model}, task: generate}}
  lookup: {{source: {model}, task: generate, speculative: {{method: ngram, num_tokens: {k}}}}}
inputs: {{question: str}}
nodes:
  reply:
    model: llm
    messages: [{{role: user, content: "{{{{ inputs.question }}}}"}}]
    params: {{max_tokens: {new}}}
  plain:
    model: llm
    messages: [{{role: user, content: {ask}}}]
    params: {{max_tokens: {new}}}
  followed:
    model: llm
    messages: [{{role: user, content: {ask}}}]
    params: {{max_tokens: {new}}}
    speculative: {{method: follows, num_tokens: {k}}}
    after: [plain]
  looked_up:
    model: lookup
    messages: [{{role: user, content: {ask}}}]
    params: {{max_tokens: {new}}}
    after: [followed]
outputs: {{plain: plain.text, followed: followed.text, looked_up: looked_up.text}}
"""
VARIANTS = {"followed": "llm", "looked_up": "lookup"}  # the speculating ones, and their model


def encode(engine: LLMEngine, messages: list[dict]) -> list[int]:
    return chat_token_ids(engine.llms["m"].tokenizer, messages, None)


def run(engine: LLMEngine, prompts, new: int, speculate: bool):
    """(generated tokens per second, outputs, proposed, accepted, verifying steps)."""
    counters = engine.llms["m"].speculator.counters
    before = (counters.proposed, counters.accepted, counters.verify_steps)
    params = SamplingParams(max_tokens=new, speculative=speculate)
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    after = (counters.proposed, counters.accepted, counters.verify_steps)
    proposed, accepted, steps = (a - b for a, b in zip(after, before, strict=True))
    return tokens / seconds, [o.token_ids for o in outs], proposed, accepted, steps


def measure(engine, name: str, prompts, new: int, rounds: int) -> None:
    # the prompts' pages in the prefix cache first: every timed run then prefills the same
    # way (in bf16 a cached prefix changes the first logits by ~0.1 and flips near-ties)
    engine.generate(prompts, SamplingParams(max_tokens=1, speculative=False))
    rates = {True: [], False: []}
    same = 0
    proposed = accepted = steps = 0
    for r in range(rounds):
        outputs = {}
        for speculate in (r % 2 == 0, r % 2 != 0):  # alternate which goes first
            rate, outs, p, a, s = run(engine, prompts, new, speculate)
            rates[speculate].append(rate)
            outputs[speculate] = outs
            if speculate:
                proposed, accepted, steps = proposed + p, accepted + a, steps + s
        same += sum(a == b for a, b in zip(outputs[True], outputs[False], strict=True))
    with_, without = statistics.median(rates[True]), statistics.median(rates[False])
    rate = accepted / proposed if proposed else 0.0
    per_step = (accepted / steps + 1) if steps else 0.0
    print(
        f"{name:<12} batch {len(prompts):>3}: {without:7.1f} -> {with_:7.1f} tok/s "
        f"x{with_ / without:5.2f}  acceptance {rate:5.1%}  tokens/verify {per_step:4.2f}  "
        f"greedy identical: {same}/{rounds * len(prompts)}  load {os.getloadavg()[0]:.2f}"
    )


def measure_graph(args) -> None:
    """(c) through the graph executor, batch 1: the rewrite node plain, with follows and
    with prompt lookup, on the same reply."""
    ask = json.dumps(REWRITE_ASK + "{{ reply.text }}")
    text = GRAPH.format(model=args.model, new=args.new, ask=ask, k=args.num_tokens)
    spec = load_graph_text(text, "rewrite.yaml")
    compile_ = "auto" if args.compile else False
    if args.compile:
        os.environ[COMPILE_ENV] = "1"  # "auto" compiles batch 1 only when asked
    config = EngineConfig(
        dtype=args.dtype, pool_bytes=256 << 20, num_threads=args.threads, compile=compile_
    )
    rt = ModelRuntime.for_specs([spec], config)
    variants = ("plain", *VARIANTS)
    try:
        executor = rt.bind(spec)
        rt.start()
        if args.compile:
            rt.engine.wait_compiled()
        run = lambda question: asyncio.run(executor.run({"question": question}))  # noqa: E731
        for question in QUESTIONS:  # prompts and replies in the prefix cache, as in measure
            run(question)
        workers = {v: rt.engine.llms[executor.clients[m].name] for v, m in VARIANTS.items()}
        counters = {v: w.speculator.counters for v, w in workers.items()}
        before = {v: (c.proposed, c.accepted, c.verify_steps) for v, c in counters.items()}
        rates: dict[str, list[float]] = {v: [] for v in variants}
        same = dict.fromkeys(VARIANTS, 0)
        for _ in range(args.rounds):
            tokens, seconds = dict.fromkeys(variants, 0), dict.fromkeys(variants, 0.0)
            for question in QUESTIONS:
                result = run(question)
                for v in variants:
                    tokens[v] += result.nodes[v].usage["tokens"]
                    seconds[v] += result.nodes[v].ms / 1000
                for v in VARIANTS:
                    same[v] += result.outputs[v] == result.outputs["plain"]
            for v in variants:
                rates[v].append(tokens[v] / seconds[v])
    finally:
        rt.shutdown()
    without = statistics.median(rates["plain"])
    each = "; ".join(f"{v} " + " ".join(f"{r:.1f}" for r in rates[v]) for v in variants)
    print(f"graph (c) tok/s per round: {each}")
    for v, c in counters.items():
        proposed, accepted, steps = (
            a - b for a, b in zip((c.proposed, c.accepted, c.verify_steps), before[v], strict=True)
        )
        with_ = statistics.median(rates[v])
        rate = accepted / proposed if proposed else 0.0
        per_step = (accepted / steps + 1) if steps else 0.0
        print(
            f"graph (c) {v:<9} batch 1: {without:7.1f} -> {with_:7.1f} tok/s "
            f"x{with_ / without:5.2f}  acceptance {rate:5.1%}  tokens/verify {per_step:4.2f}  "
            f"greedy identical: {same[v]}/{args.rounds * len(QUESTIONS)}  "
            f"load {os.getloadavg()[0]:.2f}  (the rewrite node, k={args.num_tokens})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a SmolLM2 (or any causal LM) folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--new", type=int, default=96, help="tokens to generate per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-tokens", type=int, default=4, help="proposed tokens per step")
    parser.add_argument("--max-batch", type=int, default=None, help="SpeculativeConfig.max_batch")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--only", choices=["engine", "graph"], default=None,
        help="engine: workloads (a), (b), (c) on the engine; graph: (c) through a graph",
    )  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="wait for compile=auto first")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    if args.only != "graph":
        measure_engine(args)
    if args.only != "engine":
        measure_graph(args)
    print(f"load average at end: {os.getloadavg()}")
    print("not measured: `draft` (no smaller SmolLM2-tokenizer model)")


def measure_engine(args) -> None:
    """(a), (b) and (c) on one engine with ``ngram``."""
    spec = SpeculativeConfig(num_tokens=args.num_tokens)
    if args.max_batch is not None:
        spec = SpeculativeConfig(num_tokens=args.num_tokens, max_batch=args.max_batch)
    compile_ = "auto" if args.compile else False
    if args.compile:
        os.environ[COMPILE_ENV] = "1"  # "auto" compiles batch 1 only when asked
    config = EngineConfig(
        dtype=args.dtype,
        pool_bytes=256 << 20,
        num_threads=args.threads,
        speculative=spec,
        compile=compile_,
    )
    print(f"engine workloads: {spec}")
    with LLMEngine({"m": args.model}, config) as engine:
        if args.compile:
            engine.wait_compiled()
        workloads = {
            "extraction": [encode(engine, extraction(m)) for m in MESSAGES],
            "free chat": [encode(engine, chat(q)) for q in QUESTIONS],
        }
        replies = engine.generate(workloads["free chat"], SamplingParams(max_tokens=args.new))
        workloads["rewrite"] = [encode(engine, rewrite(r.text)) for r in replies]
        for batch in args.batch:
            for name, base in workloads.items():
                prompts = [base[i % len(base)] for i in range(batch)]
                measure(engine, name, prompts, args.new, args.rounds)


if __name__ == "__main__":
    main()
