"""Verification of proposed tokens: which of them a step keeps, and the token after them.

A sequence that verifies ``k`` proposals ``d1..dk`` has ``k + 1`` sampling rows: row ``j`` holds
the model's logits after its tokens and ``d1..dj``. Each row is adjusted exactly as the
sampler adjusts a plain row (repetition penalty over the tokens before it, ``logit_bias``),
then:

* greedy: ``t_j`` is row j's argmax; ``d_{j+1}`` is kept while it equals ``t_j``; the first
  difference (or row k) gives the last token. Every kept token is the one plain decoding
  would have produced, so output is identical.
* sampled: rejection sampling over the filtered distribution ``p_j`` (temperature, top-k,
  top-p, min-p). A proposal from prompt lookup is a point mass, so ``d`` is kept with
  probability ``p_j(d)``; if it is not, the token is drawn from ``p_j`` with ``d`` removed and
  renormalised. Then ``P(t) = p(d)[t = d] + (1 - p(d)) p(t)[t != d] / (1 - p(d)) = p(t)``:
  the model's distribution, exactly. After k kept proposals row k is sampled as usual.

Rows without proposals go through the same adjustments and draws as the plain sampler, so a
step that mixes both samples those rows exactly as one without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from trae_groups.engine.sampling import (
    Sampler,
    SampleResult,
    SamplingParams,
    add_logprobs,
    filter_probs,
)
from trae_groups.engine.scheduler import ScheduledSeq
from trae_groups.kernels import cpu_native


@dataclass
class Verdict:
    """One sampling sequence's tokens from a step (kept proposals, then one of the
    model's own), with their logprobs and top alternatives where asked."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def verdicts_of(result: SampleResult) -> list[Verdict]:
    """A plain step's samples (one token per row) as verdicts."""
    n = len(result.token_ids)
    logprobs = result.logprobs or [None] * n
    tops = result.top_logprobs or [None] * n
    return [
        Verdict([t], [lp], [top])
        for t, lp, top in zip(result.token_ids, logprobs, tops, strict=True)
    ]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    items: Seq[ScheduledSeq],
    masks: tuple[list[int], torch.Tensor] | None = None,
) -> list[Verdict]:
    """Verdicts for the step's sampling ``items`` (in order); ``logits`` has ``1 + len(draft)``
    rows per item. ``masks``: constraint bitmasks of items without proposals (item index)."""
    params: list[SamplingParams] = []
    seen: list[list[int]] = []
    first: list[int] = []  # each item's first row
    for item in items:
        first.append(len(params))
        tokens = item.seq.token_ids
        for j in range(len(item.draft) + 1):
            params.append(item.seq.params)
            seen.append(tokens + item.draft[:j])
    if masks is not None:
        rows, bits = masks
        masks = ([first[i] for i in rows], bits)
    scored, adjusted = sampler.adjust(logits, params, seen, masks)
    chosen = cpu_native.argmax(adjusted)  # greedy rows; others are overwritten below
    tokens_of: list[list[int]] = []
    plain = [i for i, item in enumerate(items) if not item.draft and not item.seq.params.greedy]
    if plain:  # exactly the plain sampler's draw for these rows
        idx = torch.tensor([first[i] for i in plain])
        probs = filter_probs(adjusted[idx], [params[r] for r in idx.tolist()])
        chosen[idx] = sampler.draw(probs, [items[i].seq.generator for i in plain])
    for i, item in enumerate(items):
        start, k = first[i], len(item.draft)
        if not item.draft:
            tokens_of.append([int(chosen[start])])
        elif item.seq.params.greedy:
            tokens_of.append(_greedy(chosen[start : start + k + 1].tolist(), item.draft))
        else:
            probs = filter_probs(adjusted[start : start + k + 1], params[start : start + k + 1])
            tokens_of.append(_rejection(sampler, probs, item.draft, item.seq.generator))
        rows = torch.arange(start, start + len(tokens_of[-1]))
        chosen[rows] = torch.tensor(tokens_of[-1], dtype=chosen.dtype)
    return _with_logprobs(tokens_of, first, scored, chosen, params)


def _greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """Kept proposals while they equal the model's argmax, then the model's token."""
    out = []
    for proposed, token in zip(draft, argmax, strict=False):
        out.append(token)
        if token != proposed:
            return out
    out.append(argmax[len(draft)])
    return out


def _rejection(
    sampler: Sampler, probs: torch.Tensor, draft: list[int], generator: torch.Generator | None
) -> list[int]:
    """Rejection sampling of point-mass proposals (module docstring); ``probs`` [k+1, V]."""
    out = []
    for j, proposed in enumerate(draft):
        if sampler.uniform(generator) < float(probs[j, proposed]):
            out.append(proposed)
            continue
        residual = probs[j].clone()
        residual[proposed] = 0.0
        out.append(int(sampler.draw((residual / residual.sum())[None], [generator])[0]))
        return out
    out.append(int(sampler.draw(probs[len(draft)][None], [generator])[0]))
    return out


def _with_logprobs(
    tokens_of: list[list[int]],
    first: list[int],
    scored: torch.Tensor,
    chosen: torch.Tensor,
    params: list[SamplingParams],
) -> list[Verdict]:
    """Verdicts with each kept token's logprob from its own row (rows that ask)."""
    asked = [
        first[i] + j
        for i, tokens in enumerate(tokens_of)
        for j in range(len(tokens))
        if params[first[i]].logprobs is not None
    ]
    result = SampleResult(chosen.tolist())
    if asked:
        add_logprobs(result, scored, chosen, params, asked)
    verdicts = []
    for i, tokens in enumerate(tokens_of):
        rows = range(first[i], first[i] + len(tokens))
        logprobs = [result.logprobs[r] for r in rows] if result.logprobs else [None] * len(tokens)
        tops = (
            [result.top_logprobs[r] for r in rows] if result.top_logprobs else [None] * len(tokens)
        )
        verdicts.append(Verdict(tokens, logprobs, tops))
    return verdicts
