"""The demo's shape with tiny models (intent and entities feed a reply), written to a
folder, for the observability tests: the live page, the shipped Prometheus files."""

from __future__ import annotations

from pathlib import Path

from conftest import build_encoder, build_llm

SUPPORT = """
name: support
models:
  intent: {{source: {root}/intent, task: classify}}
  ner: {{source: {root}/ner, task: tag}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  entities: {{model: ner, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    when: "inputs.text != 'buy cheap pills now'"
    prompt: "{{{{ intent.label }}}}: {{{{ entities.spans | map(attribute='text') | join(', ') }}}} {{{{ inputs.text }}}}"
    params: {{max_tokens: 4, temperature: 0}}
outputs: {{intent: intent.label, entities: entities.spans, reply: reply.text}}
{extra}"""
NODES = ("intent", "entities", "reply")
SPAM = "buy cheap pills now"  # the reply is skipped (the tiny classifier's labels are random)


def build_support(root: Path, extra: str = "") -> Path:
    """The models and the graph file; ``extra``: more top-level YAML (``monitoring:``)."""
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    build_encoder(root / "ner", "tag", ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"], seed=1)
    build_llm(root / "dialog", "llama")
    path = root / "support.yaml"
    path.write_text(SUPPORT.format(root=root, extra=extra))
    return path
