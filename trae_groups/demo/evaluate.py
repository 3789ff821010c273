"""Score the saved demo heads on the held-out split, loading them as users will.

Evaluating the saved folders (not the in-memory training objects) also proves they
round-trip: config labels, safetensors and tokenizer all have to be right. Entities
are decoded with the engine's own aggregation, so the F1 is what serving will see.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from trae_groups.demo.data import Example
from trae_groups.engine.ner import aggregate


@torch.no_grad()
def _predict(folder: Path, texts: list[str], kind: str, chunk: int = 64):
    from transformers import (
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    auto = (
        AutoModelForSequenceClassification
        if kind == "classify"
        else AutoModelForTokenClassification
    )
    model = auto.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for start in range(0, len(texts), chunk):
        part = texts[start : start + chunk]
        batch = tokenizer(part, padding=True, return_offsets_mapping=True, return_tensors="pt")
        offsets = batch.pop("offset_mapping").tolist()
        probs = model(**batch).logits.softmax(-1)
        for row in range(len(part)):
            yield model.config, probs[row], offsets[row], batch.word_ids(row)


def intent_accuracy(folder: Path, test: Sequence[Example]) -> float:
    texts = [e.text for e in test]
    hits = 0
    for example, (config, probs, _, _) in zip(
        test, _predict(folder, texts, "classify"), strict=True
    ):
        hits += config.id2label[int(probs.argmax())] == example.intent
    return hits / len(test)


def entity_f1(folder: Path, test: Sequence[Example]) -> dict[str, float]:
    """Exact-match span F1 (type, start, end), micro-averaged."""
    texts = [e.text for e in test]
    tp = fp = fn = 0
    for example, (config, probs, offsets, word_ids) in zip(
        test, _predict(folder, texts, "tag"), strict=True
    ):
        best, index = probs.max(-1)
        labels = [config.id2label[int(i)] for i in index]
        spans = aggregate(labels, best.tolist(), offsets, example.text, word_ids)
        predicted = {(s.start, s.end, s.entity) for s in spans}
        gold = set(example.spans)
        tp += len(predicted & gold)
        fp += len(predicted - gold)
        fn += len(gold - predicted)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def shared_tensors(a: Path, b: Path) -> tuple[int, int]:
    """(byte-identical tensors with the same name, tensors in b): the dedupe that
    freezing the backbone buys."""
    same = 0
    with (
        safe_open(a / "model.safetensors", "pt") as fa,
        safe_open(b / "model.safetensors", "pt") as fb,
    ):
        names = set(fb.keys())
        for name in names & set(fa.keys()):
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            same += x.shape == y.shape and _bytes(x) == _bytes(y)
    return same, len(names)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().flatten().view(torch.uint8).numpy().tobytes()
