"""The narrow, typed surface through which anything above the engine reaches a model.

The graph executor, the OpenAI routes and the metrics see a model only as a
``ModelClient``: encode a text (or a text pair), generate a stream of chunks, abort
a request, read its stats. Local workers implement it in this process
(``engine/clients.py``); a remote client implements the same methods across a
process boundary, so the layers above never learn which one they hold.

Everything that crosses it is a plain frozen dataclass of plain values, so it
pickles, and generation streams carry only what is new since the previous chunk.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from trae_groups.engine.deadlines import Priority
from trae_groups.engine.errors import RequestError
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.spec_config import Reference

if TYPE_CHECKING:  # the pool module imports torch; the protocol's users (graphs) need none
    from trae_groups.engine.memory_pool import PoolStats


def new_request_id(prefix: str = "req") -> str:
    """The one way request ids are made: minted once, where a request enters, and
    carried by every piece of its work (engine items, aborts, responses, logs)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


Pooling = Literal["mean", "cls"]
POOLINGS: tuple[str, ...] = ("mean", "cls")


@dataclass(frozen=True)
class EncodeOptions:
    """Per-item options of an encoder call (embed heads read them; others ignore them).
    The defaults here are the defaults of an embed node."""

    pooling: Pooling = "mean"
    normalize: bool = False

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise RequestError("pooling", f"must be one of {POOLINGS}, not {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise RequestError("normalize", f"must be true or false, not {self.normalize!r}")


@dataclass(frozen=True)
class EncodeRequest:
    """One text (or a (query, document) pair for a cross-encoder) for an encoder."""

    text: str | tuple[str, str]
    request_id: str
    options: EncodeOptions = EncodeOptions()
    priority: Priority = field(default_factory=Priority)


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: a prompt (text or token ids), or chat messages that the model's
    own chat template turns into one."""

    request_id: str
    params: SamplingParams
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    priority: Priority = field(default_factory=Priority)
    session: str | None = None  # requests of one session go to one replica (prefix cache)
    tools: tuple[dict, ...] | None = None  # function tools the chat template shows
    #: The prompt is the beginning of a later request's prompt (a streamed edge's text so
    #: far): compute and cache the KV of its tokens that cannot change as the text grows,
    #: and produce no text. One final chunk says how many tokens were cached.
    prefix_only: bool = False
    adapter: str | None = None  # a LoRA adapter on the model (None: the base model)
    #: (start, end) character spans of a text prompt that request values supplied (a graph's
    #: prompt template inlined them): a special token's text inside them is tokenized as
    #: plain characters (engine/chat.prompt_token_ids)
    inlined: tuple[tuple[int, int], ...] | None = None
    #: A text the generation is likely to copy (an upstream node's reply that this one
    #: rewrites): speculative decoding proposes from it (engine/speculative.py, "follows")
    reference: Reference | None = None
    #: Send only the final output (offline ``generate``, which reads nothing earlier): no
    #: RequestOutput is built for the steps in between (0.2 ms of a 32-row decode step)
    final_only: bool = False

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("prompt", "give exactly one of a prompt or messages")


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a generation or of a scored prompt: its id and text, its logprob
    (None for a prompt's first token, which nothing predicts), and the most likely
    tokens at its position as (id, text, logprob), most likely first."""

    token_id: int
    text: str
    logprob: float | None
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class EnginePhases:
    """When the engine took one generation through its phases, in epoch seconds (so they
    compare across processes): it received the request, a step first took it (the queue
    ends, prefill starts), its first token, its last one. Traces draw them."""

    received: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None


@dataclass(frozen=True)
class GenerationChunk:
    """What one generation produced since the previous chunk. ``completion_tokens``
    counts every token so far; the last chunk has ``finished`` set. ``logprobs``: one
    per token of ``token_ids`` when the request asked (``SamplingParams.logprobs``);
    ``prompt_logprobs``: every prompt token, once, when it asked for them."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    #: "stop" | "length" | "abort" | "deadline" | "error" | "prefix" (a prefix_only request)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    index: int = 0  # which of the prompt's sequences (SamplingParams.n, best_of)
    phases: EnginePhases | None = None  # on the last chunk of an engine's generation

    def merge(self, later: GenerationChunk) -> GenerationChunk:
        """This chunk followed by ``later``, as one (for grouping across a boundary)."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = (logprobs or ()) + later.logprobs
        return GenerationChunk(
            self.request_id,
            self.text + later.text,
            self.token_ids + later.token_ids,
            later.finished,
            later.finish_reason,
            later.prompt_tokens or self.prompt_tokens,
            later.completion_tokens,
            later.cached_tokens or self.cached_tokens,
            later.error,
            logprobs,
            self.prompt_logprobs or later.prompt_logprobs,
            later.index,
            later.phases or self.phases,
        )


@dataclass(frozen=True)
class Window:
    """Recent values of a per-item measure and how many there have been in all, so a
    reader that keeps its own count can take only the new ones."""

    recent: tuple[float, ...] = ()
    count: int = 0


@dataclass(frozen=True)
class ModelStats:
    """One model's counters, as the engine keeps them (metrics read these).

    ``name`` is the model's name on its engine (the ``model`` label of metrics);
    ``running + waiting`` is its pending work (what autoscaling reads).
    """

    name: str
    kind: Literal["llm", "encoder"]
    running: int = 0
    waiting: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    windows: dict[str, Window] = field(default_factory=dict)
    batch_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class ResidencyStats:
    """One on-demand model. ``bytes``: what it held when last loaded (its estimate
    before the first load)."""

    resident: bool
    bytes: int
    active: int
    waiting: int
    loads: int
    evictions: int
    load_seconds: float


@dataclass(frozen=True)
class WeightStats:
    """What one loaded model's weights hold (``ModelReport`` of engine/weights.py):
    every distinct tensor, packed and quantized ones included; ``shared_bytes`` are
    also used by another model, ``private_bytes`` are copies only it can use."""

    parameters: int
    bytes: int
    shared_bytes: int
    private_bytes: int

    @classmethod
    def of(cls, report: Any) -> WeightStats:
        return cls(report.parameters, report.bytes, report.shared_bytes, report.private_bytes)


@dataclass(frozen=True)
class EngineStats:
    """One engine (one process's loop, pool and models) as metrics and autoscaling see it."""

    device: str
    dtype: str
    attention_backend: str
    steps: int
    busy_seconds: float  # time the loop spent stepping: the utilisation measure
    pool: PoolStats
    models: dict[str, ModelStats] = field(default_factory=dict)
    weights: dict[str, WeightStats] = field(default_factory=dict)  # by loaded model's name
    residency: dict[str, ResidencyStats] = field(default_factory=dict)  # on-demand models
    weight_budget: int | None = None
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: what the KV pages hold

    @property
    def pending(self) -> int:
        return sum(m.pending for m in self.models.values())


@runtime_checkable
class ModelClient(Protocol):
    """How the layers above the engine reach one model, local or remote."""

    name: str  # the model's name on its engine
    task: str  # classify | tag | embed | rerank | generate

    async def encode(self, request: EncodeRequest) -> dict[str, Any]:
        """The head's result for one item; RequestError for bad input."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Chunks as they come; RequestError is raised by this call or by the first
        step of the iteration, before any work. Closing it early aborts the request."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop the request's work on this model and free its memory (idempotent)."""
        ...

    def stats(self) -> ModelStats: ...
