"""``EngineClient``: one (model, version) of the engine process, as a ``ModelClient``.

The executor cannot tell it from a local one. A generation's chunks arrive on an
asyncio queue that the runtime's reader fills, one hand-off per engine step for all
streams; leaving the stream early (client gone, deadline, cancel) sends an abort and
the engine frees the request's pages. Errors come back as themselves (a RequestError
keeps its field, so a 422 stays a 422); an engine process that dies fails the call
with ``EngineLost`` (503 with the reason).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from trae_groups.engine.errors import EngineStopped
from trae_groups.engine.protocol import EncodeRequest, GenerateRequest, GenerationChunk, ModelStats
from trae_groups.graphs import tracing

if TYPE_CHECKING:
    from trae_groups.engine_process.runtime import EngineProcessRuntime

#: How long a per-model stats read waits for the engine process.
STATS_TIMEOUT_S = 10.0


class EngineClient:
    """One (model, version) of one graph binding in the engine process."""

    def __init__(
        self,
        runtime: EngineProcessRuntime,
        binding: int,
        key: tuple[str, str],
        name: str,
        task: str,
    ):
        self._runtime = runtime
        self._binding = binding
        self._key = key
        self._live: dict[str, int] = {}  # request id -> its stream's id
        self.name = name
        self.task = task

    async def encode(self, request: EncodeRequest) -> dict[str, Any]:
        return await self._runtime.encode(self._binding, self._key, request, tracing.carried())

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Sent at the first step of the iteration (a stream never iterated costs the
        engine nothing); a RequestError comes from that step. The caller's trace context
        (graphs/tracing.py) goes with it."""
        return self._chunks(request, tracing.carried())

    async def _chunks(
        self, request: GenerateRequest, trace: dict[str, str] | None
    ) -> AsyncGenerator[GenerationChunk, None]:
        stream = self._runtime.open_stream(self._binding, self._key, request, trace)
        self._live[request.request_id] = stream.sid
        finished = False
        running = request.params.num_sequences  # each of them ends with a finished chunk
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine process ended it (an error, or it died)
                    raise item
                running -= item.finished
                finished = running == 0
                yield item
        finally:
            self._live.pop(request.request_id, None)
            self._runtime.close_stream(stream.sid, cancel=not finished)

    def abort(self, request_id: str) -> None:
        """The engine ends the request (its last chunk says "abort") and frees its pages."""
        sid = self._live.get(request_id)
        if sid is not None:
            self._runtime.abort_stream(sid)

    def stats(self) -> ModelStats:
        try:
            return self._runtime.call(
                "model_stats", self._binding, self._key, timeout=STATS_TIMEOUT_S
            )
        except (EngineStopped, TimeoutError):
            return ModelStats(self.name, "llm" if self.task == "generate" else "encoder")
