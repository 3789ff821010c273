"""Scores of a prompt's own tokens (``SamplingParams.prompt_logprobs``, OpenAI's ``echo``
with ``logprobs``): the logits of the prefill that runs anyway, kept at every position of
a chunk of a request that asks, not only at the row that samples.

A cached prefix has no logits, so a request that scores its prompt computes all of it
(the scheduler does not match it against the prefix cache; engine/scheduler.py). Chunked
prefill scores chunk by chunk; a recomputation after preemption scores nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trae_groups.engine.sampling import score_tokens
from trae_groups.engine.sequence import Sequence


@dataclass(frozen=True)
class PromptSpan:
    """Positions ``first .. first + count - 1`` of ``seq`` (each predicts the prompt token
    after it), at logits rows ``row .. row + count - 1`` of the step."""

    seq: Sequence
    first: int
    row: int
    count: int


def positions_to_score(seq: Sequence, lo: int, hi: int) -> tuple[int, int]:
    """Of the positions ``lo .. hi - 1`` a step computes: the first one whose logits
    score a prompt token not scored yet, and how many (0: none)."""
    if seq.params.prompt_logprobs is None:
        return lo, 0
    first = max(lo, len(seq.prompt_logprobs))
    end = min(hi, len(seq.prompt_token_ids) - 1)
    return first, max(0, end - first)


def record(spans: list[PromptSpan], logits: torch.Tensor) -> None:
    """Append each span's scores to its sequence (the step's logits, all kept rows)."""
    for span in spans:
        seq = span.seq
        targets = seq.prompt_token_ids[span.first + 1 : span.first + 1 + span.count]
        rows = logits[span.row : span.row + span.count]
        seq.prompt_logprobs.extend(score_tokens(rows, targets, seq.params.prompt_logprobs))
