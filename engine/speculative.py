"""Speculative decoding: which tokens to propose for each decoding sequence, and how many.

A decode step reads every weight to compute one token per sequence. With speculation a
proposer guesses the next ``k`` tokens; the step then computes the KV of the last token and
the ``k`` guesses in one forward (a short chunk over the cached context, engine/scheduler.py)
and keeps the longest prefix the model agrees with plus one token of its own
(engine/verify.py). Greedy output is the same token for token; sampled output keeps the
model's distribution exactly (rejection sampling).

Proposers: ``ngram`` (prompt lookup): the tokens that followed the latest earlier occurrence
of the sequence's last few tokens, in its own prompt and output. It costs no model and wins
where a reply copies its input (extraction, rewriting, code edits). ``draft``: the greedy
guesses of a smaller model on the same engine and pool (engine/draft.py). ``follows``: for
a request that carries a reference text (``GenerateRequest.reference``: a graph node's prompt
reads another node's reply, which its own reply is likely to copy), the continuation of
where the sequence is in that text (``follow_propose``); prompt lookup where it is in none.

What decides ``k`` (``Speculator.propose``):

* per sequence, adaptive: a fully accepted proposal grows k by one (up to ``num_tokens``), a
  partly accepted one sets it to what was accepted plus one, a rejected one halves it; at 0
  the sequence rests ``REST_STEPS`` steps, then tries again with k = 1;
* per row, off with a reason: the request opted out (``SamplingParams.speculative``), or
  a constraint matcher drives its masks (each position's mask depends on the tokens before
  it, and a matcher cannot be rolled back), or the length limits leave no room;
* engine-wide, off while more than ``max_batch`` sequences decode: a large batch's step is
  compute-bound, and rows for guesses cost about what they may save.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from trae_groups.engine.sequence import Sequence
from trae_groups.engine.spec_config import SpeculativeConfig

# prompt lookup: the longest and shortest suffix searched for
NGRAM_MAX = 4
NGRAM_MIN = 2
REST_STEPS = 8  # steps a sequence whose proposals all failed goes without, then tries k=1
# follows: how far past where the copy was a single token may pick it up again
FOLLOW_WINDOW = 32


def ngram_propose(tokens: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (NGRAM_MAX down to NGRAM_MIN tokens) found; [] when none is."""
    n_tokens = len(tokens)
    if n_tokens <= NGRAM_MIN:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(NGRAM_MAX, n_tokens - 1), NGRAM_MIN - 1, -1):
        # windows starting at 0 .. n_tokens-n-1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return []


def follow_propose(
    tokens: list[int], reference: tuple[int, ...], k: int, state: SpecState
) -> list[int]:
    """Up to ``k`` tokens of ``reference`` that follow where ``tokens`` are in it.

    A rewrite copies its reference in order, with edits: when the tokens added since the
    last proposal are the reference's tokens from where that proposal started, the copy goes
    on from there (one token of overlap is enough). Otherwise the longest suffix of
    ``tokens`` (NGRAM_MAX down to NGRAM_MIN) is looked up in the reference, the first
    occurrence that ends at or past where the copy was; a single token only within
    FOLLOW_WINDOW past it. Nowhere in the reference: prompt lookup (``ngram_propose``)."""
    start = _continued(tokens, reference, state)
    if start is None:
        start = _found(tokens, reference, state.anchor)
    if start is None:
        state.base = -1
        return ngram_propose(tokens, k)
    state.anchor, state.base = start, len(tokens)
    return list(reference[start : start + k])


def _continued(tokens: list[int], reference: tuple[int, ...], state: SpecState) -> int | None:
    """Where the copy goes on, if every token since the last proposal followed it."""
    if state.base < 0 or state.base >= len(tokens):
        return None
    grown = tokens[state.base :]
    end = state.anchor + len(grown)
    if end < len(reference) and list(reference[state.anchor : end]) == grown:
        return end
    return None


def _found(tokens: list[int], reference: tuple[int, ...], anchor: int) -> int | None:
    """Where in ``reference`` the tokens after the longest found suffix of ``tokens`` start."""
    if len(reference) < 2 or not tokens:
        return None
    arr = np.asarray(reference, dtype=np.int64)[:-1]  # a match needs a token after it
    tail = np.asarray(tokens[-NGRAM_MAX:], dtype=np.int64)
    for n in range(min(NGRAM_MAX, len(tokens), len(arr)), 0, -1):
        hits = np.flatnonzero(
            (np.lib.stride_tricks.sliding_window_view(arr, n) == tail[-n:]).all(1)
        )
        if n < NGRAM_MIN:
            hits = hits[(hits >= anchor) & (hits < anchor + FOLLOW_WINDOW)]
        if hits.size:
            ahead = hits[hits + n >= anchor]
            return int(ahead[0] if ahead.size else hits[-1]) + n
    return None


@dataclass
class SpecState:
    """One sequence's adaptive speculation: its current k (at most ``limit``), steps left
    to rest, and for ``follows`` where its last proposal started in the reference
    (``anchor``) and how many tokens the sequence had then (``base``; -1: none)."""

    k: int
    limit: int
    rest: int = 0
    anchor: int = 0
    base: int = -1


@dataclass
class SpecCounters:
    """What metrics and ``trae model info`` show (one model's, since start)."""

    proposed: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, kept
    verify_steps: int = 0  # sequence-steps that verified a proposal
    drafting_s: float = 0.0  # time spent proposing
    off_steps: int = 0  # steps with speculation off because the batch was large
    off_rows: dict[str, int] = field(default_factory=dict)  # sequence-steps off, by reason
    # of proposed and accepted: the tokens that came from a reference (method "follows")
    reference_proposed: int = 0
    reference_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class Speculator:
    """One model's proposer and adaptive k (module docstring); ``drafter``: the draft
    model's proposer (engine/draft.py) for method "draft". Whatever the method, a sequence
    with a reference proposes from it (``follow_propose``); with method "follows" only
    those speculate."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter=None):
        if (config.method == "draft") != (drafter is not None):
            raise ValueError("speculative: method 'draft' needs its draft model's proposer")
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.counters = SpecCounters()

    def propose(self, running: list[Sequence]) -> None:
        """Set ``seq.draft`` for each decoding sequence of ``running`` (the scheduler
        takes what its budget and pages allow)."""
        started = time.perf_counter()
        decoding = [s for s in running if s.is_decode]
        for seq in running:
            seq.draft = []
        if len(decoding) > self.config.max_batch:
            self.counters.off_steps += 1
            return
        wanted = [(seq, k) for seq in decoding if (k := self._k(seq))]
        for seq, k in wanted:
            if seq.reference is not None:
                seq.draft = follow_propose(seq.token_ids, seq.reference.text, k, seq.spec)
        wanted = [(seq, k) for seq, k in wanted if seq.reference is None]
        if self.drafter is not None:
            for seq, draft in self.drafter.propose(wanted).items():
                seq.draft = draft
        else:
            for seq, k in wanted:
                seq.draft = ngram_propose(seq.token_ids, k)
        self.counters.drafting_s += time.perf_counter() - started

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: whatever its proposer kept for it goes."""
        if self.drafter is not None:
            self.drafter.forget(seq)

    def _k(self, seq: Sequence) -> int:
        """How many tokens to propose for ``seq`` this step (0: none)."""
        if seq.reference is None and self.config.method == "follows":
            return 0  # this model speculates for requests with a reference only
        reason = off_reason(seq)
        if reason is not None:
            self.counters.off_rows[reason] = self.counters.off_rows.get(reason, 0) + 1
            return 0
        state = seq.spec
        if state is None:
            limit = self.config.num_tokens if seq.reference is None else seq.reference.num_tokens
            state = seq.spec = SpecState(limit, limit)
        if state.rest:
            state.rest -= 1
            if state.rest:
                return 0
            state.k = 1
        # the step yields up to k + 1 tokens: never past max_tokens or the context
        room = min(
            seq.params.max_tokens - len(seq.output_token_ids),
            self.max_model_len - seq.num_tokens,
        )
        return max(0, min(state.k, room - 1))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verified proposal's outcome: counters, and the sequence's next k."""
        c = self.counters
        c.proposed += proposed
        c.accepted += accepted
        c.verify_steps += 1
        state = seq.spec
        if state is None:
            return
        if state.base >= 0:  # this proposal followed the reference
            c.reference_proposed += proposed
            c.reference_accepted += accepted
        if accepted == proposed:
            state.k = min(state.limit, state.k + 1)
        elif accepted:
            state.k = accepted + 1
        else:
            state.k //= 2
            if state.k == 0:
                state.rest = REST_STEPS

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "spec_num_tokens": float(self.config.num_tokens),
            "spec_proposed_tokens": float(c.proposed),
            "spec_accepted_tokens": float(c.accepted),
            "spec_acceptance_rate": c.acceptance_rate,
            "spec_verify_steps": float(c.verify_steps),
            "spec_drafting_seconds": c.drafting_s,
            "spec_off_steps": float(c.off_steps),
            "spec_reference_proposed_tokens": float(c.reference_proposed),
            "spec_reference_accepted_tokens": float(c.reference_accepted),
        }


def off_reason(seq: Sequence) -> str | None:
    """Why ``seq`` does not speculate at all (None: it may)."""
    if not seq.params.speculative:
        return "opted_out"
    if seq.matcher is not None:
        return "constrained"
    return None
