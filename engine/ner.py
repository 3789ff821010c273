"""Token labels → entity spans with character offsets.

Pure functions over (labels, scores, offsets, text[, word_ids]) so every case can be
tested on a crafted sequence. The rules:

* BIO/IOB2 (``B-X``, ``I-X``, ``O``), IOB1-tolerant (an ``I-X`` that follows ``O`` or
  another type starts an entity), BIOES/BILOU (``S-``/``U-`` begin, ``E-``/``L-``
  continue) and plain labels (``PER``): consecutive words of one plain label merge.
* A word's first token decides its label; its continuation pieces (same word id)
  join the word's entity whatever their own labels say.
* A span runs from its first token's start to its last token's end; its score is the
  mean of the scores of all its tokens (continuation pieces included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

_BEGIN = {"B", "S", "U"}
_INSIDE = {"I", "E", "L"}


@dataclass(frozen=True)
class Span:
    entity: str
    text: str
    start: int
    end: int
    score: float

    def as_dict(self) -> dict:
        return asdict(self)


def split_label(label: str) -> tuple[str, str | None]:
    """("B", type) | ("I", type) | ("O", None). A label with no prefix is inside."""
    if label in ("O", "o", ""):
        return "O", None
    prefix, sep, rest = label.partition("-")
    if sep and rest and len(prefix) == 1 and prefix.upper() in _BEGIN | _INSIDE:
        return ("B" if prefix.upper() in _BEGIN else "I"), rest
    return "I", label


def word_groups(
    offsets: Sequence[tuple[int, int]], word_ids: Sequence[int | None] | None = None
) -> list[list[int]]:
    """Token indices per word, special tokens left out. Without word ids every token
    with a non-empty offset is a word of its own."""
    groups: list[list[int]] = []
    last_word: int | None = None
    for i, (start, end) in enumerate(offsets):
        if word_ids is None:
            if end > start:
                groups.append([i])
            continue
        word = word_ids[i]
        if word is None:
            last_word = None
            continue
        if word == last_word and groups:
            groups[-1].append(i)
        else:
            groups.append([i])
        last_word = word
    return groups


def aggregate(
    labels: Sequence[str],
    scores: Sequence[float],
    offsets: Sequence[tuple[int, int]],
    text: str,
    word_ids: Sequence[int | None] | None = None,
) -> list[Span]:
    """Entity spans of one sequence, in order."""
    spans: list[Span] = []
    current: tuple[str, list[int]] | None = None  # (entity, token indices)

    def close() -> None:
        if current is not None:
            spans.append(_span(current[0], current[1], scores, offsets, text))

    for tokens in word_groups(offsets, word_ids):
        prefix, entity = split_label(labels[tokens[0]])
        if entity is None:
            close()
            current = None
        elif prefix == "B" or current is None or current[0] != entity:
            close()
            current = (entity, list(tokens))
        else:
            current[1].extend(tokens)
    close()
    return spans


def _span(
    entity: str,
    tokens: list[int],
    scores: Sequence[float],
    offsets: Sequence[tuple[int, int]],
    text: str,
) -> Span:
    start, end = offsets[tokens[0]][0], offsets[tokens[-1]][1]
    score = sum(float(scores[i]) for i in tokens) / len(tokens)
    return Span(entity=entity, text=text[start:end], start=start, end=end, score=score)
