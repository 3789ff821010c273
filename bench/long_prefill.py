"""A short chat behind a long prompt's prefill: what ``step_time_target_ms`` buys and costs.

    .venv/bin/python bench/long_prefill.py --model /tmp/trae-bench/smollm2-135m \\
        --long 3000 8000 --targets none 100 150 --dtype bfloat16

One engine per target (the loop thread running, as when serving). For each long-prompt length:
1. the chat alone (a few prompt tokens, ``--chat-tokens`` new), median of 3;
2. the long prompt alone (``--long`` random token ids, 1 new token): its time to first token;
3. the long prompt, and ``--delay`` seconds later the chat: both times.
Reported: the chat's time behind the long prompt against 2x its time alone + 0.3 s (the
issue's bound), and how much the long prompt's own time grew (bound: 25%). Plus the offline
throughput of ``--batch`` x 100-token prompts x 64 new tokens, inline, to show what the cap
costs a batch job. Medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams


def timed(engine: LLMEngine, prompt, max_tokens: int, started: threading.Event | None = None):
    """Seconds from submit to the request's last output."""
    done = threading.Event()
    t0 = time.perf_counter()

    def sink(out) -> None:
        if out.finished:
            done.set()

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.submit(prompt, params, sink=sink)
    if started is not None:
        started.set()
    done.wait()
    return time.perf_counter() - t0


def interference(engine: LLMEngine, chat, long_ids, chat_tokens: int, delay: float):
    results = {}

    def long_run() -> None:
        results["long"] = timed(engine, long_ids, 1, started)

    started = threading.Event()
    thread = threading.Thread(target=long_run)
    thread.start()
    started.wait()
    time.sleep(delay)
    results["chat"] = timed(engine, chat, chat_tokens)
    thread.join()
    return results["chat"], results["long"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--long", type=int, nargs="+", default=[3000])
    ap.add_argument("--targets", nargs="+", default=["none", "100"])
    ap.add_argument("--chat-tokens", type=int, default=8)
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    rng = random.Random(0)
    for target in args.targets:
        ms = None if target == "none" else float(target)
        config = EngineConfig(dtype=args.dtype, step_time_target_ms=ms, max_model_len=8192)
        engine = LLMEngine({"m": args.model}, config)
        tok = engine.llm("m").tokenizer
        vocab = min(tok.vocab_size, 40000)
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "Hi there!"}], add_generation_prompt=True, tokenize=False
        )
        batch = [[rng.randrange(100, vocab) for _ in range(100)] for _ in range(args.batch)]
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        offline = []
        for _ in range(args.runs):  # inline: the loop thread is not running yet
            engine.pool.clear_cache()  # else the runs after the first reuse the first's prompts
            t0 = time.perf_counter()
            engine.generate(batch, params)
            offline.append(64 * len(batch) / (time.perf_counter() - t0))
        engine.start()
        try:
            timed(engine, chat, args.chat_tokens)  # warm
            alone = statistics.median(timed(engine, chat, args.chat_tokens) for _ in range(3))
            line = f"target {target}: offline {statistics.median(offline):.1f} tok/s; chat alone {alone:.2f} s"
            print(line, flush=True)
            for n in args.long:

                def fresh(n=n, vocab=vocab) -> list[int]:  # new ids each time: no prefix-cache hits
                    return [rng.randrange(100, vocab) for _ in range(n)]

                long_alone = statistics.median(
                    timed(engine, fresh(), 1) for _ in range(max(1, args.runs - 1))
                )
                pairs = [
                    interference(engine, chat, fresh(), args.chat_tokens, args.delay)
                    for _ in range(args.runs)
                ]
                chat_behind = statistics.median(p[0] for p in pairs)
                long_with = statistics.median(p[1] for p in pairs)
                bound = 2 * alone + 0.3
                print(
                    f"  long {n}: alone {long_alone:.2f} s, with the chat {long_with:.2f} s "
                    f"(+{(long_with / long_alone - 1) * 100:.0f}%, bound 25%); chat behind it "
                    f"{chat_behind:.2f} s (bound {bound:.2f} s: "
                    f"{'met' if chat_behind <= bound else 'missed'})",
                    flush=True,
                )
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
