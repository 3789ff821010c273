"""The ``draft`` proposer: a smaller causal LM on the same engine guesses the next tokens.

The draft model runs on a runner of its own over the engine's pool (its own typed view,
pages of its own under the owner ``<target>/draft``), with one shadow sequence per target
sequence holding the KV of the tokens it has seen. Each step, for the sequences that
speculate: one forward catches every shadow up to its target's tokens (what was verified
since, as a short chunk) and proposes the first guess; ``k - 1`` one-token forwards propose
the rest, all shadows batched. Guesses are the draft's argmax, a point mass, which the
target's verification takes as it takes prompt lookup's (engine/verify.py): greedy output
and sampled distributions stay exact.

After verification a shadow keeps the KV of the tokens its target kept (their longest common
prefix). A shadow that cannot get pages proposes nothing that step; its pages go back when
its sequence ends (``forget``) or is preempted (the next ``propose``).
"""

from __future__ import annotations

import torch

from trae_groups.engine.llm_runner import LLMRunner
from trae_groups.engine.memory_pool import KVView, MemoryPool
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.scheduler import ScheduledSeq, SchedulerOutput
from trae_groups.engine.sequence import Sequence, Status
from trae_groups.kernels import AttentionBackend

_GREEDY = SamplingParams()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftProposer:
    """Greedy guesses of a draft model, kept in step with each target sequence."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVView,
        pool: MemoryPool,
        backend: AttentionBackend,
        owner: str,
    ):
        """``kv``: the draft model's view of the pool (its own worker's)."""
        self.kv = kv
        self.runner = LLMRunner(model, self.kv, backend)
        self.page = self.kv.tokens_per_page
        self.pool = pool
        self.owner = owner
        self.zero = backend.needs_zeroed_pages
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.max_len = positions or 2048
        self._shadows: dict[Sequence, Sequence] = {}

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Up to ``k`` guesses for each (sequence, k) of ``wanted``."""
        for seq in [s for s in self._shadows if s.status is not Status.RUNNING]:
            self.forget(seq)  # preempted: it starts again from its tokens
        active = [(seq, k) for seq, k in wanted if self._ready(seq, k)]
        drafts: dict[Sequence, list[int]] = {seq: [] for seq, _ in active}
        for _ in range(max((k for _, k in active), default=0)):
            rows = [seq for seq, k in active if len(drafts[seq]) < k]
            sched = SchedulerOutput()
            for seq in rows:
                shadow = self._shadows[seq]
                num_new = shadow.num_tokens - shadow.num_computed
                item = ScheduledSeq(shadow, num_new, True)
                (sched.decodes if num_new == 1 else sched.prefills).append(item)
            guesses = self.runner.run(self.runner.prepare(sched)).argmax(-1).tolist()
            by_shadow = {id(self._shadows[seq]): seq for seq in rows}
            for item, guess in zip(sched.scheduled, guesses, strict=True):
                shadow = item.seq
                shadow.num_computed = shadow.num_tokens
                shadow.prompt_token_ids.append(guess)
                drafts[by_shadow[id(shadow)]].append(guess)
        return drafts

    def _ready(self, seq: Sequence, k: int) -> bool:
        """The shadow of ``seq`` synced to its tokens, with pages for ``k`` guesses."""
        tokens = seq.token_ids
        if len(tokens) + k > self.max_len:
            return False
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = Sequence(seq.request_id, [], _GREEDY, sink=lambda out: None)
            self._shadows[seq] = shadow
        known = shadow.prompt_token_ids[: shadow.num_computed]
        shadow.num_computed = min(_common_prefix(known, tokens), len(tokens) - 1)
        shadow.prompt_token_ids = list(tokens)
        # KV for the tokens and the first k - 1 guesses (the last guess needs none)
        need = -(-(len(tokens) + k - 1) // self.page) - len(shadow.pages)
        if need > 0:
            pages = self.pool.allocate(self.owner, need, zero=self.zero)
            if pages is None:
                return False
            shadow.pages.extend(pages)
        return True

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: its shadow's pages go back."""
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.pool.release(shadow.pages)
            shadow.pages = []


def same_vocabulary(tokenizer, other, vocab_size: int, other_size: int) -> bool:
    """Whether two models read and write the same token ids: equal tokenizer vocabularies
    (or, without tokenizers, equal vocabulary sizes)."""
    if tokenizer is None or other is None:
        return vocab_size == other_size and tokenizer is other
    return vocab_size == other_size and tokenizer.get_vocab() == other.get_vocab()
