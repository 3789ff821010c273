"""One engine replica: an engine host (one loop, one paged pool, one weight store)
holding the models of one engine group of one graph, served through its methods.

Methods take the engine protocol's own request objects (engine/protocol.py) and a
(model, version) key. ``generate`` streams ``GenerationChunk`` deltas, grouped every
``chunk_interval_s`` after the first so that a process hop costs one message per
group of tokens, not one per token; a caller that goes away (client gone,
``cancel()``) ends the stream here and the engine frees the request's pages. With the
caller's W3C trace context (``trace``) and tracing on in the replica (the OTEL_* variables
in its environment), each call is a span ``engine <model>`` in the caller's trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from trae_groups.cluster.board import Poster
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.errors import RequestError
from trae_groups.engine.protocol import (
    EncodeRequest,
    EngineStats,
    GenerateRequest,
    GenerationChunk,
    ModelClient,
)
from trae_groups.graphs import tracing
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import host_for, load_clients, settle_heap

log = logging.getLogger("trae_groups.cluster")

CHUNK_INTERVAL_S = 0.025  # tokens that come within this window travel as one message
_DONE = object()


class EngineGroup:
    """The engine deployment's class (made a Serve deployment in cluster/app.py)."""

    def __init__(
        self,
        graph: tuple[str, str, str | None],
        group: str,
        engine: EngineConfig | None = None,
        app: str = "trae",
        chunk_interval_s: float = CHUNK_INTERVAL_S,
    ):
        text, filename, base_dir = graph
        spec = load_graph_text(text, filename, Path(base_dir) if base_dir else None)
        placed = spec.deploy.group_of(list(spec.models))
        names = [m for m, g in placed.items() if g == group]
        if not tracing.enabled():
            tracing.configure_from_env(service_name=tracing.ENGINE_SERVICE)
        self.group = group
        self.chunk_interval_s = chunk_interval_s
        self.host = host_for([spec], engine)
        self.clients: dict[tuple[str, str], ModelClient] = load_clients(self.host, spec, names)
        self.host.start()
        settle_heap()
        self.replica = _replica_id()
        self._busy_mark = (0.0, time.monotonic())
        self._poster = Poster(app, self.replica, group, self.host.stats)
        log.info("engine group %r: %s on replica %s", group, sorted(self.clients), self.replica)

    # -- what the ingress asks ---------------------------------------------------------
    def describe(self) -> dict[tuple[str, str], tuple[str, str]]:
        """(model, version) -> (its name on the engine, its task)."""
        return {key: (c.name, c.task) for key, c in self.clients.items()}

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> EngineStats:
        return self.host.stats()

    async def encode(
        self, key: tuple[str, str], request: EncodeRequest, trace: dict | None = None
    ) -> dict[str, Any]:
        client = self._client(key)
        with self._span(client, request, trace):
            return await client.encode(request)

    async def generate(
        self, key: tuple[str, str], request: GenerateRequest, trace: dict | None = None
    ) -> AsyncGenerator[GenerationChunk, None]:
        """The first chunk at once, then what came in each ``chunk_interval_s``."""
        client = self._client(key)
        with self._span(client, request, trace):
            async with contextlib.aclosing(self._grouped(client.generate(request))) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _grouped(self, stream: Any) -> AsyncGenerator[GenerationChunk, None]:
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait(chunk)
                queue.put_nowait(_DONE)
            except BaseException as exc:
                queue.put_nowait(exc)
                raise

        task = asyncio.ensure_future(pump())
        try:
            first = True
            carry: Any = None  # taken from the queue, not merged: handled on the next turn
            while True:
                item, carry = (await queue.get() if carry is None else carry), None
                deadline = time.monotonic() + (0 if first else self.chunk_interval_s)
                first = False
                while item is not _DONE and not isinstance(item, BaseException):
                    if item.finished:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        more = await asyncio.wait_for(queue.get(), left)
                    except TimeoutError:
                        break
                    if more is _DONE or isinstance(more, BaseException) or more.index != item.index:
                        carry = more  # the end, or another of the prompt's sequences (n > 1)
                        break
                    item = item.merge(more)
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item  # the stream ends at _DONE: after every sequence finished
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await stream.aclose()  # aborts the engine work unless it finished

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the autoscaling policy reads (cluster/autoscaling.py): pending work now,
        and the share of time the engine loop was busy since the previous call."""
        stats = self.host.stats()
        now = time.monotonic()
        busy, since = self._busy_mark
        self._busy_mark = (stats.busy_seconds, now)
        share = (stats.busy_seconds - busy) / (now - since) if now > since else 0.0
        return {"pending": float(stats.pending), "utilization": min(1.0, max(0.0, share))}

    def _span(self, client: ModelClient, request: Any, trace: dict | None) -> Any:
        """This replica's span of one call (graphs/tracing.py), in the caller's trace."""
        return tracing.served_span(
            f"engine {client.name}", trace,
            **{"trae.model": client.name, "trae.request_id": request.request_id,
               "trae.group": self.group, "trae.replica": self.replica},
        )  # fmt: skip

    def check_health(self) -> None:
        if not self.host.running:
            raise RuntimeError("the engine loop is not running")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._poster.stop()
            self.host.shutdown()

    def _client(self, key: tuple[str, str]) -> ModelClient:
        client = self.clients.get(tuple(key))
        if client is None:
            raise RequestError("model", f"group {self.group!r} holds no model {key!r}")
        return client


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (tests of the class itself)
        return f"pid-{os.getpid()}"
