"""Accuracy gate: a compressed model (int8, bf16) is served only if it scores within a bound of
its float32 weights on a small fixed probe set.

LLM: teacher-forced over the probe texts, the perplexity of the text and the greedy (top-1)
next-token accuracy against the text. It passes when perplexity rises by at most ``bound``
(relative) and greedy accuracy falls by at most ``bound`` (absolute). Greedy agreement with the
float model's own top-1 is reported too (it is what a user sees change), not gated: it is
below 100% even for bf16 whenever the float model is unsure.
Encoders: the agreement of decisions with float on the probe texts (labels for classify and
rerank, per-token labels for tag; cosine similarity for embed); passes when 1 - agreement is
at most ``bound``. A classifier given a held-out set (``eval_set`` in the graph: JSONL of text
and label) is gated on its accuracy there instead (drop at most ``bound``, absolute).

The probes are fixed, so a given model and hardware always get the same verdict.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_MAX_DROP = 0.02  # the seeds' "metrics may drop at most 2%"

PROBE_TEXTS = (
    "The history of the city begins in the early medieval period, when a small settlement "
    "grew up around a river crossing. Over the following centuries, merchants built warehouses "
    "along the banks, and the town became a centre of trade in wool and grain.",
    "To reset your password, open the settings page, choose security, and follow the link we "
    "send to your email address. If the link has expired, request a new one and try again.",
    "Water boils at a lower temperature at high altitude because the air pressure is lower. "
    "Cooking pasta in the mountains therefore takes longer than it does at sea level.",
    "I would like to book a table for four people on Friday evening, preferably near the "
    "window. One of us is vegetarian, so please let me know which dishes are suitable.",
)
_PROBE_TOKENS = 96  # per text, at most


@dataclass(frozen=True)
class GateResult:
    passed: bool
    drop: float  # the largest drop measured (what the bound is compared with)
    detail: str  # the figures, for logs and `trae model info`


# -- LLMs ------------------------------------------------------------------------------------
def check_llm(
    reference: nn.Module, candidate: nn.Module, tokenizer, bound: float = DEFAULT_MAX_DROP,
    max_length: int = _PROBE_TOKENS,
) -> GateResult:  # fmt: skip
    """Gate a causal LM against its float32 weights on the probe texts (each cut to
    ``max_length`` tokens, at most the model's)."""
    probes = _llm_probes(tokenizer, reference, min(max_length, _PROBE_TOKENS))
    ref = [_teacher_forced(reference, ids) for ids in probes]
    got = [_teacher_forced(candidate, ids) for ids in probes]
    texts = [ids[1:] for ids in probes]
    greedy = [lg.argmax(-1) for lg in ref]  # the float model's own choices
    ppl_ref, acc_ref = _perplexity_accuracy(ref, texts)
    ppl_got, acc_got = _perplexity_accuracy(got, texts)
    gppl_ref, _ = _perplexity_accuracy(ref, greedy)
    gppl_got, agree = _perplexity_accuracy(got, greedy)
    ppl_rise = ppl_got / ppl_ref - 1.0
    greedy_rise = gppl_got / gppl_ref - 1.0
    acc_drop = acc_ref - acc_got
    drop = max(ppl_rise, greedy_rise, acc_drop)
    detail = (
        f"perplexity {ppl_ref:.3f} -> {ppl_got:.3f} ({ppl_rise:+.2%}), perplexity of the float "
        f"model's greedy choices {gppl_ref:.3f} -> {gppl_got:.3f} ({greedy_rise:+.2%}), greedy "
        f"accuracy {acc_ref:.3f} -> {acc_got:.3f}, top-1 agreement with float {agree:.1%} over "
        f"{sum(t.numel() for t in texts)} positions"
    )
    return GateResult(bool(drop <= bound), drop, detail)


def _llm_probes(tokenizer, model: nn.Module, length: int) -> list[torch.Tensor]:
    if tokenizer is None:  # a token-id-only model: fixed random ids stand in for text
        vocab = model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (min(64, length),), generator=gen) for _ in PROBE_TEXTS]
    return [
        torch.tensor(tokenizer(text)["input_ids"][:length], dtype=torch.long)
        for text in PROBE_TEXTS
    ]


@torch.inference_mode()
def _teacher_forced(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [len - 1, vocab] predicting tokens 1.. of ``ids``."""
    with _plain_attention(model):
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
    return logits.float()


@contextlib.contextmanager
def _plain_attention(model: nn.Module):
    """Run a model loaded for paged attention through transformers' SDPA for a plain forward
    (the paged function needs an engine step), then put it back."""
    current = model.config._attn_implementation
    if current in ("sdpa", "eager"):
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def _perplexity_accuracy(logits: list[torch.Tensor], targets: list[torch.Tensor]):
    """Perplexity of ``targets`` under ``logits`` and how often the top-1 is the target."""
    nll = n = correct = 0
    for lg, target in zip(logits, targets, strict=True):
        nll += float(nn.functional.cross_entropy(lg, target, reduction="sum"))
        correct += int((lg.argmax(-1) == target).sum())
        n += target.numel()
    return math.exp(nll / n), correct / n


# -- encoders --------------------------------------------------------------------------------
def check_encoder(
    reference: nn.Module, candidate: nn.Module, tokenizer, task: str,
    bound: float = DEFAULT_MAX_DROP, max_length: int = 128,
) -> GateResult:  # fmt: skip
    """Gate an encoder against its float32 weights: agreement of its decisions on the probes
    (each cut to ``max_length`` tokens, at most the model's)."""
    batch = tokenizer(list(PROBE_TEXTS), padding=True, truncation=True,
                      max_length=min(max_length, 128), return_tensors="pt")  # fmt: skip
    with torch.inference_mode():
        ref, got = (_encoder_output(m, batch, task) for m in (reference, candidate))
    if task == "embed":
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pool = [(h * mask).sum(1) / mask.sum(1) for h in (ref, got)]
        agreement = float(nn.functional.cosine_similarity(*pool, dim=-1).min())
        what = "lowest cosine similarity of pooled embeddings"
    elif task == "tag":
        real = batch["attention_mask"].bool()
        agreement = float((ref.argmax(-1) == got.argmax(-1))[real].float().mean())
        what = f"token label agreement over {int(real.sum())} tokens"
    elif ref.shape[-1] == 1:  # a single relevance logit: its order over the probes
        agreement = float((ref.squeeze(-1).argsort() == got.squeeze(-1).argsort()).float().mean())
        what = "rank agreement"
    else:
        agreement = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
        what = f"label agreement over {ref.shape[0]} texts"
    drop = 1.0 - agreement
    return GateResult(bool(drop <= bound), drop, f"{what} with float: {agreement:.1%}")


def check_classifier(
    reference: nn.Module, candidate: nn.Module, tokenizer, examples: list[tuple[str, str]],
    bound: float = DEFAULT_MAX_DROP, max_length: int = 128,
) -> GateResult:  # fmt: skip
    """Gate a classifier on a held-out set of (text, label): accuracy may drop by at most
    ``bound`` (absolute)."""
    accuracy = [_accuracy(m, tokenizer, examples, max_length) for m in (reference, candidate)]
    drop = accuracy[0] - accuracy[1]
    detail = (
        f"held-out accuracy {accuracy[0]:.4f} -> {accuracy[1]:.4f} ({-drop:+.2%} points) "
        f"on {len(examples)} examples"
    )
    return GateResult(bool(drop <= bound), max(drop, 0.0), detail)


@torch.inference_mode()
def _accuracy(model: nn.Module, tokenizer, examples, max_length: int, chunk: int = 64) -> float:
    id2label = model.config.id2label
    hits = 0
    for start in range(0, len(examples), chunk):
        part = examples[start : start + chunk]
        batch = tokenizer([t for t, _ in part], padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt")  # fmt: skip
        predicted = model(**batch).logits.argmax(-1).tolist()
        hits += sum(id2label[p] == label for p, (_, label) in zip(predicted, part, strict=True))
    return hits / len(examples)


def read_eval_set(path) -> list[tuple[str, str]]:
    """A JSONL file of ``{"text": ..., "label": ...}`` lines; ValueError names the line."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text, label = row["text"], row["label"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f'line {number}: expected {{"text", "label"}}: {exc}') from None
            if not isinstance(text, str) or not isinstance(label, str):
                raise ValueError(f"line {number}: text and label must be strings")
            examples.append((text, label))
    if not examples:
        raise ValueError("no examples")
    return examples


def _encoder_output(model: nn.Module, batch, task: str) -> torch.Tensor:
    out = model(**batch)
    return (out.last_hidden_state if task == "embed" else out.logits).float()
