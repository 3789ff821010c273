"""LLM -> LLM over a streamed edge: the downstream node's time to first token after the
upstream's last token, with ``follows`` (its prompt prefilled as the text arrives) and
without (the same graph, the same prompts), same run.

    .venv/bin/python bench/follow.py                       # the demo's SmolLM2, 5 rounds
    .venv/bin/python bench/follow.py --model-dir DIR --rounds 7 --draft-tokens 256

The graph: ``draft`` writes up to ``--draft-tokens`` tokens (greedy); ``summary``'s
chat message is an instruction followed by the draft. Rounds alternate the two graphs, each
with its own topic, so neither finds the other's prompts in the prefix cache. The gap is
measured on the executor's own event stream: the draft's node_finished event (right
after its last chunk) to the summary's first token event. Prints medians and the ratio; never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from trae_groups.engine import EngineConfig
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime

GRAPH = """
name: {name}
models:
  dialog: {{source: "{model}", task: generate}}
inputs: {{topic: str}}
nodes:
  draft:
    model: dialog
    messages: [{{role: user, content: "Write a long, detailed story about {{{{ inputs.topic }}}}."}}]
    params: {{max_tokens: {draft}}}
  summary:
    model: dialog
{follows}    messages: [{{role: user, content: "Summarize this story in one sentence.\\n\\n{{{{ draft.text }}}}"}}]
    params: {{max_tokens: 4}}
outputs: {{summary: summary.text}}
"""
TOPICS = ["a lighthouse", "a lost violin", "a desert town", "two rival bakers", "a glacier",
          "a night train", "an old map", "a robot gardener", "a storm at sea", "a chess club",
          "a quiet forest", "a city of bridges", "a broken clock", "a paper boat"]  # fmt: skip


async def gap(executor, topic: str) -> tuple[float, int, int]:
    """Seconds from the draft's end (its last chunk) to the summary's first token, the
    draft's tokens and the summary's prompt tokens."""
    draft_end = first_summary = None
    draft_tokens = prompt_tokens = 0
    async for event in executor.stream({"topic": topic}):
        node = event.data.get("node")
        if event.type == "node_finished" and node == "draft":
            draft_end, draft_tokens = time.perf_counter(), event.data["tokens"]
        elif node == "summary" and event.type in ("token", "node_finished"):
            first_summary = first_summary or time.perf_counter()
            prompt_tokens = event.data.get("prompt_tokens", prompt_tokens)
        elif event.type == "error":
            raise event.error
    return first_summary - draft_end, draft_tokens, prompt_tokens


def main() -> None:
    default = Path(os.environ.get("TRAE_DEMO_DIR", "~/.cache/trae-groups/demo")) / "dialog"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=default.expanduser())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draft-tokens", type=int, default=192)
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"no model at {args.model_dir}: run `trae demo` (or demo.prepare) first")
    texts = {
        name: GRAPH.format(
            name=name, model=args.model_dir, draft=args.draft_tokens,
            follows="    follows: {node: draft, tokens: 16}\n" if name == "followed" else "",
        )
        for name in ("followed", "plain")
    }  # fmt: skip
    specs = [load_graph_text(text, f"{name}.yaml") for name, text in texts.items()]
    runtime = ModelRuntime.for_specs(specs, EngineConfig(pool_bytes=512 << 20))
    executors = {spec.name: runtime.bind(spec) for spec in specs}
    runtime.start()
    gaps: dict[str, list[float]] = {"followed": [], "plain": []}
    prompts: list[int] = []
    try:
        topics = iter(TOPICS * 4)
        asyncio.run(gap(executors["plain"], "a warm-up"))
        for _ in range(args.rounds):
            for name in ("followed", "plain"):
                seconds, _, prompt_tokens = asyncio.run(gap(executors[name], next(topics)))
                gaps[name].append(seconds)
                prompts.append(prompt_tokens)
    finally:
        runtime.shutdown()
    followed, plain = (statistics.median(gaps[n]) for n in ("followed", "plain"))
    print(f"summary prompts: median {statistics.median(prompts):.0f} tokens "
          f"(drafts of up to {args.draft_tokens})")  # fmt: skip
    for name in ("plain", "followed"):
        runs = ", ".join(f"{g * 1000:.0f}" for g in gaps[name])
        print(f"  {name:9s} time to the summary's first token after the draft's last: "
              f"median {statistics.median(gaps[name]) * 1000:.0f} ms  ({runs})")  # fmt: skip
    print(f"  follows is {plain / followed:.1f}x faster")


if __name__ == "__main__":
    main()
