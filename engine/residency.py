"""Models resident on demand: loaded at their first request, evicted least recently
used when idle and the weight budget needs their room.

A model marked on demand is registered with a loader (what puts it on the engine and
returns its client) and is not loaded. A request for it waits, bounded, while it loads;
loads run one at a time on a thread of their own, so the engine keeps serving the
resident models meanwhile. A load first makes room: the weight store's held bytes plus
what the model will hold must fit the budget, so idle on-demand models are evicted,
least recently used first; while every candidate is busy the load waits for one to go
idle. A request whose model is not resident within ``wait_s`` gets ``ModelUnavailable``
(503 with Retry-After), never a failure of its own.

Evicting takes the model's worker off the engine loop (between two steps), returns its
cached KV pages to the pool and drops its weights from the store (``Loaded.unload``).
A model is never evicted while a request uses it or waits for it. Requests reach an
on-demand model through ``OnDemandLLM``, a ``ModelClient`` that acquires it around
each generation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from trae_groups.engine.errors import ModelUnavailable, RequestError
from trae_groups.engine.protocol import (
    EncodeRequest,
    GenerateRequest,
    GenerationChunk,
    ModelStats,
    ResidencyStats,
)

log = logging.getLogger("trae_groups.engine")


@dataclass(frozen=True)
class Loaded:
    """A model made resident: the client requests go to, and how to evict it."""

    client: Any
    unload: Callable[[], None]


@dataclass(eq=False)
class _Entry:
    name: str
    load: Callable[[], Loaded]
    bytes: int
    resident: Loaded | None = None
    active: int = 0  # requests using it now
    waiting: int = 0  # requests waiting for it to load
    last_used: float = 0.0
    loading: Future | None = None
    loads: int = 0
    evictions: int = 0
    load_seconds: float = 0.0


class Residency:
    """The on-demand models of one engine, within a budget of weight bytes."""

    def __init__(self, held_bytes: Callable[[], int], budget: int | None, wait_s: float):
        self._held = held_bytes  # every weight byte the store holds now
        self.budget = budget
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="trae-model-loader")

    def add(self, name: str, load: Callable[[], Loaded], estimate: int) -> None:
        """Register an on-demand model (not loaded); ``estimate``: bytes it will hold."""
        if self.budget is not None and estimate > self.budget:
            raise ValueError(
                f"model {name!r} needs about {estimate / 2**20:.0f} MiB of weights; the "
                f"weight budget is {self.budget / 2**20:.0f} MiB"
            )
        with self._cond:
            if name in self._entries:
                raise ValueError(f"an on-demand model named {name!r} is already registered")
            self._entries[name] = _Entry(name, load, estimate)

    def remove(self, name: str) -> None:
        """Forget a model (its graph is gone); evicted first if resident."""
        with self._cond:
            entry = self._entries.pop(name)
            loaded, entry.resident = entry.resident, None
        if loaded is not None:
            loaded.unload()

    def client(self, name: str) -> Any | None:
        """The model's client while resident."""
        entry = self._entries.get(name)
        resident = entry.resident if entry is not None else None
        return resident.client if resident is not None else None

    # -- requests (event loop) ----------------------------------------------------------
    async def acquire(self, name: str) -> Any:
        """The model's client, loading it first if needed; pair with ``release``."""
        entry = self._entries[name]
        with self._cond:
            if entry.resident is not None:
                return self._use(entry)
            entry.waiting += 1
        deadline = time.monotonic() + self.wait_s
        try:
            while True:
                with self._cond:
                    if entry.resident is not None:
                        return self._use(entry)
                    if self._entries.get(name) is not entry:  # its graph went away meanwhile
                        raise self._unavailable(entry, "no longer served here")
                    if entry.loading is None:
                        entry.loading = self._loader.submit(self._load, entry, deadline)
                    future = entry.loading
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._unavailable(entry, f"not resident within {self.wait_s:g} s")
                try:  # shielded: one waiter giving up must not cancel everyone's load
                    await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), remaining)
                except TimeoutError:
                    raise self._unavailable(
                        entry, f"still loading after {self.wait_s:g} s"
                    ) from None
                except ModelUnavailable:
                    if time.monotonic() >= deadline:
                        raise  # else: the load gave up on an earlier waiter's deadline
        finally:
            with self._cond:
                entry.waiting -= 1
                self._cond.notify_all()

    def release(self, name: str) -> None:
        """A request is done with the model: it may be evicted once idle."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is not None:
                entry.active -= 1
                entry.last_used = time.monotonic()
            self._cond.notify_all()

    def _use(self, entry: _Entry) -> Any:
        entry.active += 1
        entry.last_used = time.monotonic()
        return entry.resident.client

    def _unavailable(self, entry: _Entry, why: str) -> ModelUnavailable:
        retry = max(1, round(entry.load_seconds or 1.0))
        return ModelUnavailable(entry.name, why, retry_after=retry)

    # -- loading and evicting (loader thread) -----------------------------------------------
    def _load(self, entry: _Entry, deadline: float) -> None:
        try:
            self._make_room(entry, deadline)
            started = time.perf_counter()
            before = self._held()
            loaded = entry.load()
            seconds = time.perf_counter() - started
            added = self._held() - before
            with self._cond:
                removed = self._entries.get(entry.name) is not entry  # its graph went away
                if not removed:
                    entry.resident = loaded
                entry.bytes = added if added > 0 else entry.bytes
                entry.loads += 1
                entry.load_seconds = seconds
                entry.last_used = time.monotonic()
            if removed:
                loaded.unload()
                return
            log.info(
                "loaded on-demand model '%s' in %.2f s (%.1f MB)", entry.name, seconds, added / 1e6
            )
        finally:
            with self._cond:
                entry.loading = None
                self._cond.notify_all()

    def _make_room(self, entry: _Entry, deadline: float) -> None:
        """Evict idle models, least recently used first, until ``entry`` fits the budget;
        wait for one to go idle while none is; ModelUnavailable past ``deadline``."""
        if self.budget is None:
            return
        while True:
            held = self._held()  # outside the lock: a load elsewhere may hold the store
            with self._cond:
                if held + entry.bytes <= self.budget:
                    return
                victim = self._victim(entry)
                if victim is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._unavailable(
                            entry, "no room in the weight budget: every resident model is busy"
                        )
                    self._cond.wait(min(remaining, 0.1))
                    continue
                loaded, victim.resident = victim.resident, None  # no new request reaches it
            started = time.perf_counter()
            loaded.unload()
            with self._cond:
                victim.evictions += 1
            log.info(
                "evicted on-demand model '%s' for '%s' in %.2f s",
                victim.name, entry.name, time.perf_counter() - started,
            )  # fmt: skip

    def _victim(self, entry: _Entry) -> _Entry | None:
        idle = [
            e
            for e in self._entries.values()
            if e is not entry and e.resident is not None and e.active == 0 and e.waiting == 0
        ]
        return min(idle, key=lambda e: e.last_used, default=None)

    # -- reading -----------------------------------------------------------------------------
    def stats(self) -> dict[str, ResidencyStats]:
        with self._cond:
            return {e.name: _stats(e) for e in self._entries.values()}

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


def _stats(e: _Entry) -> ResidencyStats:
    resident = e.resident is not None
    return ResidencyStats(
        resident, e.bytes, e.active, e.waiting, e.loads, e.evictions, e.load_seconds
    )


class OnDemandLLM:
    """A causal LM resident on demand (the ``Residency`` above): each generation first
    makes it resident, waiting while it loads, and keeps it from eviction until the
    generation ends; ``ModelUnavailable`` when it is not resident in time."""

    task = "generate"

    def __init__(self, residency: Residency, name: str):
        self.residency = residency
        self.name = name

    async def encode(self, request: EncodeRequest) -> dict[str, Any]:
        raise RequestError("model", f"{self.name!r} is a generate model: it cannot encode")

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        client = await self.residency.acquire(self.name)
        try:
            async with aclosing(client.generate(request)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.residency.release(self.name)

    def abort(self, request_id: str) -> None:
        client = self.residency.client(self.name)
        if client is not None:
            client.abort(request_id)

    def stats(self) -> ModelStats:
        client = self.residency.client(self.name)
        return client.stats() if client is not None else ModelStats(self.name, "llm")
