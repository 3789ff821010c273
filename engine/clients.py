"""The engine's own ``ModelClient``s: one model on this process's engine.

A client holds the worker it submits to; nothing is looked up by name per request,
and an abort goes straight to that worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from trae_groups.engine import chat
from trae_groups.engine.encoder_worker import EncoderWorker
from trae_groups.engine.errors import EngineStopped, RequestError
from trae_groups.engine.llm_worker import LLMWorker
from trae_groups.engine.loop_post import wrap_future
from trae_groups.engine.outputs import OutputStream
from trae_groups.engine.protocol import (
    EncodeRequest,
    EnginePhases,
    GenerateRequest,
    GenerationChunk,
    ModelStats,
)
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.sequence import RequestOutput


class LocalEncoder:
    """One head of an encoder worker (classify, tag, embed or rerank)."""

    def __init__(self, worker: EncoderWorker, head: str, task: str):
        self.worker = worker
        self.head = head
        self.task = task
        self.name = worker.name

    async def encode(self, request: EncodeRequest) -> dict[str, Any]:
        future = self.worker.submit(
            request.text,
            head=self.head,
            request_id=request.request_id,
            priority=request.priority,
            options=request.options,
        )
        return await wrap_future(future)  # one wake-up of the loop per batch

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        raise RequestError("model", f"{self.name!r} is a {self.task} model: it cannot generate")

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def stats(self) -> ModelStats:
        return self.worker.model_stats()


#: Prompts longer than this (characters) are tokenized off the event loop.
OFFLOAD_CHARS = 16_384
#: Tokens at the end of a prefix that are not cached: a word cut by the stream's edge may
#: tokenize differently once the rest of it arrives.
PREFIX_HOLDBACK = 4
_PREFIX_PARAMS = SamplingParams(max_tokens=1)


def _with_prompt(request: GenerateRequest, tokens: list[int] | str) -> GenerateRequest:
    """The request with its prompt already made (token ids; text the model will refuse)."""
    prompt = tokens if isinstance(tokens, str) else tuple(tokens)
    return dataclasses.replace(request, prompt=prompt, messages=None, tools=None)


def _chars(request: GenerateRequest) -> int:
    if request.messages is not None:
        return sum(len(m.get("content") or "") for m in request.messages)
    return len(request.prompt) if isinstance(request.prompt, str) else 0


class LocalLLM:
    """A causal LM on this process's engine."""

    task = "generate"

    def __init__(self, worker: LLMWorker, running: Callable[[], bool]):
        self.worker = worker
        self.name = worker.name
        self._running = running  # the engine loop is stepping

    async def encode(self, request: EncodeRequest) -> dict[str, Any]:
        raise RequestError("model", f"{self.name!r} is a generate model: it cannot encode")

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Validates and queues now (RequestError before any work), streams later. A
        prompt over OFFLOAD_CHARS is tokenized on a worker thread instead, at the first
        step of the iteration, so that one huge request never holds the event loop
        that serves everyone else (and its RequestError comes from that step)."""
        if not self._running():
            raise EngineStopped("the engine is not running")
        if request.prefix_only:
            return self._prefix(request)
        if _chars(request) <= OFFLOAD_CHARS:
            return chunks(self.stream(request))
        return self._tokenized_off_the_loop(request)

    async def _tokenized_off_the_loop(
        self, request: GenerateRequest
    ) -> AsyncGenerator[GenerationChunk, None]:
        tokens = await asyncio.to_thread(self.worker.prompt_tokens, request)
        async with aclosing(chunks(self.stream(_with_prompt(request, tokens)))) as stream:
            async for chunk in stream:
                yield chunk

    async def _prefix(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Cache the KV of a prompt's stable beginning (``GenerateRequest.prefix_only``):
        its ids less the last PREFIX_HOLDBACK (the last word may merge with text still to
        come), run as a one-token request whose sampled token is dropped. The prefix cache
        publishes its full pages, and the later request's admission finds them. A prompt
        the engine refuses caches nothing: the later request reports the error."""
        tokens = await asyncio.to_thread(self._prefix_tokens, request)
        keep = len(tokens) - PREFIX_HOLDBACK
        cached = 0
        if keep > self.worker.kv.tokens_per_page:
            warm = dataclasses.replace(request, params=_PREFIX_PARAMS, prefix_only=False)
            try:
                async with aclosing(
                    chunks(self.stream(_with_prompt(warm, tokens[:keep])))
                ) as stream:
                    async for chunk in stream:
                        cached = keep if not chunk.error else 0
            except RequestError:
                pass
        yield GenerationChunk(
            request.request_id, "", (), True, "prefix", len(tokens), 0, cached_tokens=cached
        )

    def _prefix_tokens(self, request: GenerateRequest) -> list[int]:
        tokenizer = self.worker.tokenizer
        if tokenizer is None:
            return list(request.prompt) if isinstance(request.prompt, tuple) else []
        if request.messages is not None:
            tools = list(request.tools) if request.tools else None
            return chat.prefix_token_ids(tokenizer, list(request.messages), tools)
        return self.worker.encode(request.prompt)

    def submit(self, request: GenerateRequest, sink: Callable[[RequestOutput], None]) -> None:
        """The one way a generation enters the engine: validated and queued now
        (RequestError before any work); ``sink`` gets each ``RequestOutput`` on the engine
        thread (``LLMEngine``'s offline API and ``generate`` both come through here)."""
        self.worker.submit(request, sink)

    def submit_all(self, items: list[tuple[GenerateRequest, Callable[[RequestOutput], None]]]):
        """``submit`` for a batch that joins the same step (all validated, then all queued)."""
        self.worker.submit_all(items)

    def stream(self, request: GenerateRequest) -> OutputStream:
        """From a running asyncio loop: queued now, its outputs streamed later; closing
        the stream early aborts the request."""
        sequences = request.params.num_sequences
        stream = OutputStream(self.worker.abort, asyncio.get_running_loop(), sequences)
        stream.request_id = request.request_id
        self.submit(request, stream.put)
        return stream

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def stats(self) -> ModelStats:
        return self.worker.model_stats()


class AdapterClient:
    """A LoRA adapter on a base LLM's client, as a model of its own (a version that is an
    adapter): every request it generates runs with ``adapter`` unless it names one."""

    task = "generate"

    def __init__(self, base: LocalLLM, adapter: str):
        self.base = base
        self.adapter = adapter
        self.name = base.name  # the engine's model (metrics count the base's work)

    async def encode(self, request: EncodeRequest) -> dict[str, Any]:
        return await self.base.encode(request)

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        if request.adapter is None:
            request = dataclasses.replace(request, adapter=self.adapter)
        return self.base.generate(request)

    def abort(self, request_id: str) -> None:
        self.base.abort(request_id)

    def stats(self) -> ModelStats:
        return self.base.stats()


async def chunks(stream: OutputStream) -> AsyncGenerator[GenerationChunk, None]:
    """The engine's per-step outputs as chunks of what is new; leaving early aborts."""
    try:
        async for out in stream:
            yield as_chunk(out)
    finally:
        stream.abort()


def as_chunk(out: RequestOutput) -> GenerationChunk:
    return GenerationChunk(
        out.request_id,
        out.delta_text,
        tuple(out.delta_token_ids),
        out.finished,
        out.finish_reason if out.finished else None,
        len(out.prompt_token_ids),
        len(out.token_ids),
        out.num_cached_tokens,
        out.error,
        None if out.delta_logprobs is None else tuple(out.delta_logprobs),
        None if out.prompt_logprobs is None else tuple(out.prompt_logprobs),
        out.index,
        phases_of(out) if out.finished else None,
    )


def phases_of(out: RequestOutput) -> EnginePhases | None:
    """The output's monotonic phase times (engine/outputs.py) on the wall clock, read in
    the process that took them."""
    m = out.metrics or {}
    if m.get("arrival") is None:
        return None
    offset = time.time() - time.monotonic()
    wall = lambda t: None if t is None else t + offset  # noqa: E731
    return EnginePhases(
        wall(m["arrival"]),
        wall(m.get("first_scheduled")),
        wall(m.get("first_token_time")),
        wall(m.get("last_token_time")),
    )
