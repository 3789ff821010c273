"""One generation request as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trae_groups.engine.deadlines import Priority
from trae_groups.engine.protocol import TokenLogprob
from trae_groups.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """A snapshot sent to the caller after each step that produced tokens."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "deadline" | "error"
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    delta_logprobs: list[TokenLogprob] | None = None  # of delta_token_ids, when asked
    index: int = 0  # which of the prompt's sequences (SamplingParams.n) this is
    prompt_logprobs: list[TokenLogprob] | None = None  # once, when asked and complete


@dataclass(eq=False)  # identity: a request is itself, not its field values
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Callable[[RequestOutput], None]
    priority: Priority = field(default_factory=Priority)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in pages
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_published: int = 0  # full pages already offered to the prefix cache
    block_hashes: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: Any = None  # a constraint's matcher (engine/constraints.py), fed each output token
    adapter: str | None = None  # the LoRA adapter its rows run with (None: the base alone)
    cache_salt: int = 0  # keys its prefix-cache blocks apart from other adapters' (0: base)
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    stop_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    #: (logprob, top alternatives) of prompt tokens 1, 2, ... as their positions are
    #: computed (``params.prompt_logprobs``); a recomputation after preemption adds none
    prompt_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    index: int = 0  # which of the prompt's sequences (``params.n``/``best_of``) this is
    #: the prompt's other sequences, forked from this one once its prompt is computed
    #: (they share its full prompt pages); after the fork, ``forks`` keeps them all
    unforked: list[Sequence] = field(default_factory=list)
    forks: list[Sequence] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # when a step first took it (queue time ends)
    first_token_time: float | None = None
    last_token_time: float | None = None
    admitted_seq: int = 0  # admission order, for preempting the newest first
    preemptions: int = 0
    #: tokens proposed for the next step (engine/speculative.py); the scheduler takes them
    #: into its ``ScheduledSeq`` and they are never part of ``token_ids`` until verified
    draft: list[int] = field(default_factory=list)
    spec: Any = None  # its adaptive speculation state (engine/speculative.py SpecState)
    #: a text it is likely to copy, as token ids (``GenerateRequest.reference``, tokenized):
    #: method "follows" proposes from it; forks share it (it never changes)
    reference: Any = None
    final_only: bool = False  # GenerateRequest.final_only: only its final output is sent
    detok_prefix: int = 0
    detok_read: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_uncomputed == 1 and bool(self.output_token_ids)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token past the first has its logprob."""
        return len(self.prompt_logprobs) == len(self.prompt_token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
