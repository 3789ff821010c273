"""The engine protocol over Ray Serve handles: what the ingress's executor holds.

``RemoteClient`` is a ``ModelClient`` (engine/protocol.py) for one (model, version)
of an engine group; the executor cannot tell it from a local one. Failures cross
the boundary as cleanly as in one process: an error the replica raised comes back
as itself (a RequestError stays a 422); a replica that dies fails its calls with
``ReplicaLost`` (503 with Retry-After): an ``encode`` is first tried once more on
another replica, a generation that already streamed is not (its tokens cannot be
taken back). Leaving a stream early cancels it, and the replica frees its pages. Each
call carries the caller's W3C trace context (graphs/tracing.py), so the replica's span
joins the caller's trace.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import ray.exceptions

from trae_groups.engine.errors import EngineStopped
from trae_groups.engine.memory_pool import PoolStats
from trae_groups.engine.protocol import (
    EncodeRequest,
    EngineStats,
    GenerateRequest,
    GenerationChunk,
    ModelStats,
    Window,
)
from trae_groups.graphs import tracing

#: What a call fails with when its replica died or cannot be reached.
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ReplicaLost(EngineStopped):
    """The engine replica serving a call went away (503: the request may be retried)."""


def unwrapped(exc: BaseException) -> BaseException:
    """The replica's own exception, where Ray wrapped it."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(exc, ray.exceptions.RayTaskError) and cause else exc


class RemoteClient:
    """One (model, version) of an engine group, over that group's handle."""

    def __init__(self, handle: Any, key: tuple[str, str], name: str, task: str, stats: Any):
        self._handle = handle
        self._stream = handle.options(stream=True)
        self._key = key
        self._live: dict[str, Any] = {}  # request id -> its response generator
        self._stats = stats  # () -> ModelStats summed over the group's replicas
        self.name = name
        self.task = task

    async def encode(self, request: EncodeRequest) -> dict[str, Any]:
        trace = tracing.carried()
        for attempt in (1, 2):
            try:
                return await self._handle.encode.remote(self._key, request, trace)
            except REPLICA_GONE as exc:
                if attempt == 2:
                    raise ReplicaLost(f"the engine replica of {self.name!r} went away") from exc
            except ray.exceptions.RayTaskError as exc:
                raise unwrapped(exc) from None
        raise AssertionError("unreachable")

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        handle = self._stream
        if request.session:  # one session, one replica: its prefix cache keeps hitting
            handle = handle.options(session_id=request.session)
        trace = tracing.carried()
        return self._chunks(
            request.request_id, lambda: handle.generate.remote(self._key, request, trace)
        )

    async def _chunks(
        self, request_id: str, start: Callable[[], Any]
    ) -> AsyncGenerator[GenerationChunk, None]:
        """A replica lost before the first chunk: tried once more (on another replica,
        as Serve routes around the dead one); lost after it: ReplicaLost."""
        streamed = False
        for attempt in (1, 2):
            response = start()
            self._live[request_id] = response
            finished = False
            try:
                async for chunk in response:
                    streamed, finished = True, chunk.finished
                    yield chunk
                return
            except REPLICA_GONE as exc:
                if streamed or attempt == 2:
                    raise ReplicaLost(f"the engine replica of {self.name!r} went away") from exc
            except ray.exceptions.RayTaskError as exc:
                raise unwrapped(exc) from None
            finally:
                self._live.pop(request_id, None)
                if not finished:
                    response.cancel()  # the replica's generator ends and frees the pages

    def abort(self, request_id: str) -> None:
        response = self._live.get(request_id)
        if response is not None:
            response.cancel()

    def stats(self) -> ModelStats:
        return self._stats()


def summed(stats: list[EngineStats]) -> EngineStats | None:
    """Several replicas' stats as one engine's (counts add up; windows concatenate)."""
    if not stats:
        return None
    first = stats[0]
    models: dict[str, ModelStats] = {}
    for s in stats:
        for name, m in s.models.items():
            models[name] = m if name not in models else _add(models[name], m)
    pools = [s.pool for s in stats]
    pool = PoolStats(
        num_pages=sum(p.num_pages for p in pools),
        page_bytes=first.pool.page_bytes,
        free_pages=sum(p.free_pages for p in pools),
        cached_pages=sum(p.cached_pages for p in pools),
        used_pages=sum(p.used_pages for p in pools),
        pages_by_owner=_add_counts([p.pages_by_owner for p in pools]),
        cached_by_owner=_add_counts([p.cached_by_owner for p in pools]),
        prefix_queries=sum(p.prefix_queries for p in pools),
        prefix_hits=sum(p.prefix_hits for p in pools),
        evictions=sum(p.evictions for p in pools),
    )
    return EngineStats(
        first.device, first.dtype, first.attention_backend,
        sum(s.steps for s in stats), sum(s.busy_seconds for s in stats), pool, models,
        first.kv_cache_dtype,
    )  # fmt: skip


def _add(a: ModelStats, b: ModelStats) -> ModelStats:
    windows = {
        k: Window(
            a.windows.get(k, Window()).recent + b.windows.get(k, Window()).recent,
            a.windows.get(k, Window()).count + b.windows.get(k, Window()).count,
        )
        for k in {*a.windows, *b.windows}
    }
    return ModelStats(
        a.name, a.kind, a.running + b.running, a.waiting + b.waiting,
        _add_counts([a.counters, b.counters]), windows,
        _add_counts([a.batch_sizes, b.batch_sizes]),
    )  # fmt: skip


def _add_counts(maps: list[dict]) -> dict:
    out: dict = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return out
