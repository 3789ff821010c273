"""Continuous batching: which sequences run this step, and how many tokens each.

Every step: running sequences first (oldest admission first; budget is kept for
every running decode, so decodes never stall behind a long prompt), then waiting ones
by rank (engine/deadlines.py: earliest deadline, then deeper in their DAG, then
older) while the token budget and ``max_num_seqs`` allow. Long prompts are split across steps (chunked prefill); while
others wait, a prompt chunk takes at most ``long_prefill_tokens`` so that the waiting
ones are admitted in the same step, and whatever budget admission leaves goes back to
those capped chunks. While sequences decode, the step's prompt tokens are held to what keeps
the step near ``step_target_s`` (the model's own measured step cost, engine/step_cost.py),
so a long prompt cannot make every running decode wait for a whole-budget chunk, but never
below what prompts that have waited ``ADMIT_WAIT`` targets still need. Out of pages, the most recently admitted sequence is preempted:
its pages go back (full ones stay in the prefix cache) and it is recomputed later from
its tokens, so its output does not change. A waiting sequence that cannot run yet (its
LoRA adapter has no slot, ``admissible``) is passed over, not waited on.

Speculative decoding (engine/speculative.py): a decoding sequence with proposed tokens
(``seq.draft``) runs as a short chunk of 1 + k tokens (its last token and the proposals)
that samples at every row; k is cut to what the budget leaves for the decodes behind it and
to the pages there are (no preemption for proposals). After verification ``settle`` gives
back the pages only rejected proposals used; the prefix cache only ever publishes pages of
verified tokens.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from trae_groups.engine.config import EngineConfig
from trae_groups.engine.deadlines import expired, rank
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.sequence import Sequence, Status
from trae_groups.engine.step_cost import StepCost

# prompt tokens a step beside decodes carries at least, however slow the step, plus one per
# decode (prompt_floor): a long prompt always moves on, by at least as many tokens as the
# streams beside it make
MIN_PROMPT_CHUNK = 8
# With nothing waiting, a step beside running decodes takes at most this many times their own
# step (and at most the target): a chat beside a long prompt streams at no less than half its
# speed alone. The target alone (100 ms) let a batch-1 decode step of 20 ms grow five-fold: an
# 8-token chat behind a 3,000-token prompt took 2.2 s against 0.18 s alone (Zen 4, bf16).
DECODE_SLOWDOWN = 2.0
# A prompt with nothing decoding beside it runs in steps of up to this many times the target
# (at least MIN_ALONE_CHUNK tokens), not whole budgets: whoever arrives waits for the step in
# flight, and a 512-token chunk deep in a long prompt is 1.2-1.8 s on 2 CPU cores. Smaller
# chunks cost the prompt little there (a 3,000-token prompt: 7.9 s in 512s, 7.1-7.5 s in
# 256s, 8.2-8.4 s in 128s, SmolLM2 bf16). At three times the target a chat arriving behind
# a 3,000-token prompt waited 0.51 s for its first token; at 1.5 times 0.28-0.31 s, the long
# prompt's own time within its noise (bench/long_prefill.py, Zen 5, bf16, 100 ms target).
ALONE_STRETCH = 1.5
MIN_ALONE_CHUNK = 128
# While prompts wait to be admitted, a step beside decodes may take the target, or this many
# times the decodes' own step where that is longer: a large batch's decode step alone can
# reach the target, and prompts held to the rest fall behind the finishing sequences until
# the batch drains (16 streams of the demo's model on 2 cores: ~25% of the throughput lost
# at a 100 ms target without it). With nothing waiting (a running long prompt beside a
# chat), the target holds as it is.
PROMPT_STRETCH = 3.0
# A held step admits about one short prompt: a burst of 16 128-token prompts, beside the
# streams of its first admitted, took 13 held steps, its last first token 1.8-2.7 s against
# ~1.4 s for its prefill alone (SmolLM2 bf16, Zen 4). So a step beside decodes carries at
# least what the prompts that have waited this many times the target still need. Served at
# 16 clients that met vLLM's p99 time to first token (1.24-1.46 s), where half budgets did
# not (1.47-1.84 s); the price is the streams' p99 inter-token latency (docs/engine.md).
ADMIT_WAIT = 3.0


def prompt_floor(decodes: int) -> int:
    """The fewest prompt tokens a held step beside ``decodes`` decodes carries."""
    return MIN_PROMPT_CHUNK + decodes


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens whose KV this step computes (proposed ones included)
    samples: bool  # the step reaches the sequence's last token: sample the next one
    draft: list[int] = field(default_factory=list)  # proposed tokens verified this step


@dataclass
class SchedulerOutput:
    """Decodes (one token each) first, then prefill chunks (verified proposals among them):
    the kernel's order."""

    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


@dataclass(frozen=True)
class SchedulerSettings:
    """What one model's scheduler is told once (``from_config``: the engine's settings)."""

    tokens_per_page: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cache_key: Hashable | None = None  # None disables the prefix cache
    policy: str = "deadline"
    zero_pages: bool = True  # what the attention backend needs of new pages
    long_prefill_tokens: int | None = None  # None: a chunk may take the whole budget
    step_target_s: float | None = None  # None: prompt chunks beside decodes are not held

    @classmethod
    def from_config(
        cls, config: EngineConfig, tokens_per_page: int, cache_key: Hashable, zero_pages: bool
    ) -> SchedulerSettings:
        return cls(
            tokens_per_page=tokens_per_page,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            cache_key=cache_key if config.enable_prefix_cache else None,
            policy=config.scheduling,
            zero_pages=zero_pages,
            long_prefill_tokens=config.long_prefill_tokens,
            step_target_s=config.step_target_s,
        )


class Scheduler:
    def __init__(
        self,
        pool: MemoryPool,
        owner: str,
        settings: SchedulerSettings,
        admissible: Callable[[Sequence], bool] | None = None,  # None: every sequence can run
    ):
        self.settings = settings
        self.admissible = admissible
        self.policy = settings.policy
        self.long_prefill_tokens = settings.long_prefill_tokens
        self.zero_pages = settings.zero_pages
        self.pool = pool
        self.owner = owner
        self.page = settings.tokens_per_page
        self.max_num_seqs = settings.max_num_seqs
        self.max_num_batched_tokens = settings.max_num_batched_tokens
        self.cache_key = settings.cache_key
        self.step_target_s = settings.step_target_s
        self.hold_prompts = True  # offline generate() turns it off (engine.py)
        self.cost = StepCost()  # the worker reports every step's size and time
        self.waiting: list[Sequence] = []  # sorted by _rank
        self.running: list[Sequence] = []  # admission order
        self._admissions = 0
        self.num_preemptions = 0

    # -- queues ----------------------------------------------------------------
    def _rank(self, seq: Sequence) -> tuple:
        return (*rank(seq.priority, self.policy), seq.arrival)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self._rank)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page)

    # -- the step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        capped: list[ScheduledSeq] = []  # prompt chunks cut short to let others in
        budget = self.max_num_batched_tokens
        decodes_left = sum(1 for s in self.running if s.is_decode)
        # only prompt chunks read the cap: a step of decodes alone skips the step-cost fit
        # (~0.3 ms of every batch-32 decode step)
        prompts = bool(self.waiting) or decodes_left < len(self.running)
        cap = self._prompt_cap(decodes_left) if prompts else None
        prompt_left = budget if cap is None else cap
        partial = self._partial_cap(decodes_left)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            draft: list[int] = []
            if seq.is_decode:
                decodes_left -= 1
                draft = self._take_draft(seq, budget - decodes_left - 1, decodes_left)
                num_new = 1 + len(draft)
            else:  # a prompt chunk leaves room for the decodes behind it
                room = min(budget - decodes_left, prompt_left)
                if cap is not None and self.waiting:  # held: share it with the waiting
                    room = min(room, max(prompt_left // 2, 1))
                elif self.waiting and self._holding():  # a burst arrives beside it: the
                    room = min(room, prompt_floor(0))  # floor, topped up after admission
                num_new = self._chunk(seq, room, bool(self.waiting))
                if num_new == 0:
                    continue
                prompt_left -= num_new
            if not self._reserve_or_preempt(seq, num_new, out):
                continue
            self._add_to(out, seq, num_new, capped, draft)
            budget -= num_new
        while (
            self.waiting and budget > 0 and prompt_left > 0
            and len(self.running) < self.max_num_seqs
        ):  # fmt: skip
            if out.preempted:  # memory is tight: let the running ones finish first
                break
            seq = self._next_admissible()
            if seq is None:
                break
            if seq.num_computed == 0:
                self._match_prefix(seq)
            num_new = self._chunk(seq, min(budget, prompt_left), len(self.waiting) > 1)
            if partial is not None and num_new < seq.num_uncomputed:
                num_new = min(num_new, partial)
            if not self._reserve(seq, seq.num_computed + num_new):
                self._release(seq)  # don't sit on prefix pages while waiting
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self._admissions += 1
            seq.admitted_seq = self._admissions
            self.running.append(seq)
            self._add_to(out, seq, num_new, capped)
            budget -= num_new
            prompt_left -= num_new
        self._top_up(out, capped, min(budget, prompt_left, self._sampling_cap(out)), partial)
        return out

    def _sampling_cap(self, out: SchedulerOutput) -> int:
        """Prompt tokens the step may still take when a prompt in it completes (its first
        token is someone's time to first token): what the target allows beside the step's
        decodes and sampling rows, less the prompt tokens already in; else no limit. A
        prompt whose last token alone was left (the rest from the prefix cache) sits with the
        decodes (and is priced as one), and its first token counts as much as a longer
        prompt's."""
        prompts = [item for item in out.prefills if not item.draft]
        sampling = sum(1 for item in prompts if item.samples)
        lasts = sum(1 for item in out.decodes if item.samples and not item.seq.is_decode)
        verifying = len(out.prefills) - len(prompts)
        cap = None
        if sampling or lasts:
            cap = self._prompt_cap(len(out.decodes) + verifying + sampling)
        if cap is None:
            return self.max_num_batched_tokens
        return max(0, cap - sum(item.num_new for item in prompts))

    def _holding(self) -> bool:
        """Whether prompt chunks are held to the step target (it is set, the engine's loop
        runs, and the step cost is known)."""
        return (
            self.step_target_s is not None and self.hold_prompts
            and self.cost.known()
        )  # fmt: skip

    def _prompt_cap(self, decodes: int) -> int | None:
        """Prompt tokens this step may carry beside ``decodes`` running decodes (None: as
        many as the budget allows: no target, no estimate yet, or prompts waiting and none
        decoding). A prompt running alone takes steps of ALONE_STRETCH times the target, at
        least MIN_ALONE_CHUNK tokens: a request that arrives meanwhile waits for the step in
        flight."""
        if not self._holding():
            return None
        if not decodes:
            if self.waiting:  # a burst: admitting it fast is what its first tokens need
                return None
            return self._alone_budget()
        if self.waiting:  # stretched only to keep admitting prompts
            return self._with_overdue(self.cost.prompt_budget(
                decodes, self.step_target_s, prompt_floor(decodes), self.max_num_batched_tokens,
                stretch=PROMPT_STRETCH,
            ))  # fmt: skip
        return self.cost.prompt_budget(
            decodes, self.step_target_s, prompt_floor(decodes), self.max_num_batched_tokens,
            slowdown=DECODE_SLOWDOWN,
        )  # fmt: skip

    def _with_overdue(self, cap: int | None) -> int | None:
        """``cap``, raised to what the prompts that have waited ADMIT_WAIT times the target
        still need, while they can be admitted."""
        if cap is None or len(self.running) >= self.max_num_seqs:
            return cap
        since = time.monotonic() - ADMIT_WAIT * self.step_target_s
        overdue = sum(seq.num_uncomputed for seq in self.waiting if seq.arrival < since)
        return max(cap, min(overdue, self.max_num_batched_tokens))

    def _partial_cap(self, decodes: int) -> int | None:
        """Tokens a chunk that leaves its prompt unfinished may take in a step with nothing
        decoding, when prompts are held: a burst's prompts that finish in the step take what
        they need (their first tokens come out of it), but the chunk of a long one that
        cannot finish gains nothing from a longer step, and whoever arrives next waits for it
        (a lone 3,000-token prompt's first 512-token step: 2.2 s on an AVX2 EPYC, float32).
        So it takes the steps of a prompt running alone (ALONE_STRETCH)."""
        if decodes or not self._holding():
            return None
        return self._alone_budget()

    def _alone_budget(self) -> int | None:
        """Prompt tokens of a step with nothing decoding: ALONE_STRETCH times the target, at
        least MIN_ALONE_CHUNK."""
        return self.cost.prompt_budget(
            0, ALONE_STRETCH * self.step_target_s, MIN_ALONE_CHUNK, self.max_num_batched_tokens
        )

    def _take_draft(self, seq: Sequence, room: int, decodes_behind: int) -> list[int]:
        """The proposals ``seq`` verifies this step: as many as ``room`` tokens of budget
        and the free pages allow, leaving a page for each decode behind it (proposals never
        cause a preemption)."""
        draft, seq.draft = seq.draft[: max(room, 0)], []
        if not draft:
            return draft
        need = self.pages_needed(seq.num_computed + 1 + len(draft)) - len(seq.pages)
        short = self.pool.num_free - need < decodes_behind  # a decode behind would preempt
        if need > 0 and (short or not self._reserve(seq, seq.num_computed + 1 + len(draft))):
            held = len(seq.pages) * self.page - seq.num_computed - 1  # its own pages' room
            draft = draft[: max(held, 0)]
        return draft

    def settle(self, seq: Sequence) -> None:
        """After a verification: pages past the sequence's tokens (rejected proposals'
        KV) go back to the pool."""
        keep = self.pages_needed(seq.num_tokens)
        if len(seq.pages) > keep:
            self.pool.release(seq.pages[keep:])
            del seq.pages[keep:]

    def _next_admissible(self) -> Sequence | None:
        if self.admissible is None:
            return self.waiting[0]
        return next((s for s in self.waiting if self.admissible(s)), None)

    def _chunk(self, seq: Sequence, budget: int, others_wait: bool) -> int:
        num_new = min(seq.num_uncomputed, max(budget, 0))
        if others_wait and self.long_prefill_tokens is not None:
            num_new = min(num_new, self.long_prefill_tokens)
        return num_new

    def _top_up(
        self, out: SchedulerOutput, capped: list[ScheduledSeq], budget: int, partial: int | None
    ) -> None:
        """Budget that admission left goes back to the prompt chunks capped for it (a chunk
        that still leaves its prompt unfinished up to ``partial`` tokens, where set)."""
        for item in capped:
            seq = item.seq
            extra = min(seq.num_uncomputed - item.num_new, budget)
            if partial is not None and item.num_new + extra < seq.num_uncomputed:
                extra = min(extra, partial - item.num_new)
            if extra <= 0 or not self._reserve(seq, seq.num_computed + item.num_new + extra):
                continue
            if item.num_new == 1:  # a one-token chunk sat with the decodes
                out.decodes.remove(item)
                out.prefills.append(item)
            item.num_new += extra
            item.samples = seq.num_computed + item.num_new == seq.num_tokens
            budget -= extra

    def _add_to(
        self,
        out: SchedulerOutput,
        seq: Sequence,
        num_new: int,
        capped: list[ScheduledSeq],
        draft: list[int] | None = None,
    ) -> None:
        draft = draft or []
        reaches_end = seq.num_computed + num_new - len(draft) == seq.num_tokens
        item = ScheduledSeq(seq, num_new, reaches_end, draft)
        (out.decodes if num_new == 1 else out.prefills).append(item)
        if num_new < seq.num_uncomputed:
            capped.append(item)

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        while not self._reserve(seq, seq.num_computed + num_new):
            victim = self.running[-1]  # newest admission; not yet scheduled this step
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.pages_needed(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.pool.allocate(self.owner, need, zero=self.zero_pages)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    # -- prefix cache ----------------------------------------------------------
    def _block_key(self, seq: Sequence, index: int) -> Hashable:
        """Key of full block ``index``: the model plus a hash chain over its tokens, salted
        by the sequence's adapter (KV computed with one adapter is never another's)."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[i - 1] if i else seq.cache_salt
            block = tuple(seq.token_ids[i * self.page : (i + 1) * self.page])
            seq.block_hashes.append(hash((parent, block)))
        parent = seq.block_hashes[index - 1] if index else seq.cache_salt
        block = tuple(seq.token_ids[index * self.page : (index + 1) * self.page])
        return (self.cache_key, parent, block)

    def _match_prefix(self, seq: Sequence) -> None:
        if self.cache_key is None or seq.params.prompt_logprobs is not None:
            return  # a prompt that is scored needs every position's logits: no cached KV
        # at least the last token must be computed, to have logits to sample from
        full_blocks = (seq.num_tokens - 1) // self.page
        for index in range(full_blocks):
            page = self.pool.lookup(self._block_key(seq, index))
            if page is None:
                break
            seq.pages.append(page)
            seq.num_computed += self.page
        seq.num_published = len(seq.pages)
        if seq.preemptions == 0:
            seq.num_cached_tokens = seq.num_computed

    def publish_full_pages(self, seq: Sequence) -> None:
        if self.cache_key is None:
            return
        full = seq.num_computed // self.page
        for index in range(seq.num_published, full):
            self.pool.publish(seq.pages[index], self._block_key(seq, index))
        seq.num_published = max(seq.num_published, full)

    # -- leaving -----------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.num_published = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft = []
        self._release(seq)
        seq.preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def expired(self, now: float) -> list[Sequence]:
        """Sequences (running or waiting) whose deadline passed with ``drop`` set;
        ``now`` is wall-clock time. The caller finishes them."""
        return [s for s in self.running + self.waiting if expired(s.priority, now)]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished or aborted: free its pages wherever it is."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.stop_reason = seq.stop_reason or reason
