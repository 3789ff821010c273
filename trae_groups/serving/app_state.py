"""What the routes of one app share: the served graphs, the models, readiness, and
the count of requests in flight (what draining waits for).

Admission is the backpressure: each graph runs at most ``max_inflight`` requests at
once and turns the next away (429 with Retry-After) instead of queueing it, so no
backlog grows without bound. While models load, and once draining starts, every
request gets 503. One request's admission, outcome and release are its ``RunScope``
(trae_groups/serving/run_scope.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from trae_groups.engine.chat import TOOL_CALL_FORMATS
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.memory import LARGE_PIECE_BYTES
from trae_groups.engine.passing_threads import PassingThreads
from trae_groups.graphs.compile import CompiledGraph, compile_graph
from trae_groups.graphs.executor import GraphExecutor
from trae_groups.graphs.spec import GraphSpec, PythonNode
from trae_groups.serving.admission import NodeTimes, ServiceRate
from trae_groups.serving.buckets import histogram_buckets
from trae_groups.serving.http_errors import not_found, unavailable
from trae_groups.serving.http_io import LargeBodies
from trae_groups.serving.metrics import Metrics, NodeInfo

if TYPE_CHECKING:
    from trae_groups.graphs.runtime import Runtime

log = logging.getLogger("trae_groups.server")  # unchanged by the move to serving/


@dataclass(frozen=True)
class ServerConfig:
    """How the server runs. ``admin_token`` None reads ``TRAE_ADMIN_TOKEN``; neither
    set disables the admin routes (they answer 404)."""

    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig | None = None  # None: the runtime's defaults
    max_inflight: int = 256
    graph_limits: Mapping[str, int] = field(default_factory=dict)
    max_body_bytes: int = 1 << 20
    # bodies this large or larger are parsed off the event loop, at most max_large_bodies
    # at once (429 past it), and the heap is trimmed after them (serving/http_io.LargeBodies)
    large_body_bytes: int = LARGE_PIECE_BYTES
    max_large_bodies: int = 8
    retry_after_s: int = 1
    shutdown_grace_s: float = 30.0
    admin_token: str | None = None
    # refuse at once (429) what the requests in flight would keep waiting longer than
    # this, for graphs without a timeout of their own (trae_groups/serving/admission.py)
    max_queue_wait_s: float = 30.0
    # refuse at once (503) a request whose graph drops late work when the estimate says
    # it cannot make its deadline (trae_groups/serving/admission.py); False admits it to miss
    deadline_admission: bool = True
    # an OpenAI request (queue, prompt, generation) ends with 504 past this; a graph's
    # requests have the graph's timeout
    openai_timeout_s: float = 300.0
    # how replies write tool calls on the OpenAI routes, for models whose graph does not
    # say (a model's ``tool_call_parser``); None: read from each model's chat template
    tool_call_parser: str | None = None
    log_level: str = "info"
    access_log: bool = True  # uvicorn's line per request, at log_level info
    freeze_gc: bool = True  # models loaded: gc.freeze() the heap (graphs.runtime.settle_heap)
    # slow clients (trae_groups/serving/http_protocol.py): 408 past these, 503 past the cap
    header_timeout_s: float = 10.0  # a request's headers, from its first byte
    body_timeout_s: float = 30.0  # its body, from its headers
    keep_alive_s: float = 5.0  # an idle connection between requests
    max_connections: int | None = 1024  # open connections (and requests) at once
    # a MemoryProfiler timeline (trae_groups/monitor.py) written here, one JSON line per
    # sample every memory_profile_interval_s, from before the models load to shutdown
    memory_profile: str | None = None
    memory_profile_interval_s: float = 1.0
    # the engine (models, pool, loop, scheduler) in a child process of its own
    # (trae_groups/engine_process/); `trae serve` turns it on, embedded apps keep one process
    engine_process: bool = False
    # HTTP front processes sharing that engine process (trae_groups/serving/api_workers.py)
    api_workers: int = 1

    def __post_init__(self):
        limits = [self.max_inflight, *self.graph_limits.values()]
        if any(not isinstance(n, int) or n < 1 for n in limits):
            raise ValueError("max_inflight: every limit must be an integer >= 1")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes: must be >= 1")
        if self.large_body_bytes < 1 or self.max_large_bodies < 1:
            raise ValueError("large_body_bytes and max_large_bodies: must be >= 1")
        if self.retry_after_s < 0 or self.shutdown_grace_s < 0:
            raise ValueError("retry_after_s and shutdown_grace_s: must be >= 0")
        if self.max_queue_wait_s <= 0 or self.openai_timeout_s <= 0:
            raise ValueError("max_queue_wait_s and openai_timeout_s: must be > 0")
        if min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_s) <= 0:
            raise ValueError("header_timeout_s, body_timeout_s and keep_alive_s: must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections: must be >= 1 (or None for no cap)")
        if self.memory_profile_interval_s <= 0:
            raise ValueError("memory_profile_interval_s: must be > 0")
        if self.tool_call_parser not in (None, *TOOL_CALL_FORMATS):
            raise ValueError(f"tool_call_parser: one of {', '.join(TOOL_CALL_FORMATS)}")
        if self.api_workers < 1 or (self.api_workers > 1 and not self.engine_process):
            raise ValueError("api_workers: must be >= 1, and more than 1 needs engine_process")

    def limit_for(self, graph: str) -> int:
        return self.graph_limits.get(graph, self.max_inflight)

    def token(self) -> str | None:
        token = (
            self.admin_token if self.admin_token is not None else os.environ.get("TRAE_ADMIN_TOKEN")
        )
        return token or None


@dataclass(eq=False)
class ServedGraph:
    """One graph as served: its spec, its executor once loaded, and its admissions.

    A reload swaps the executor; requests admitted before keep the one they started
    on, which is released (its models' references dropped) once the last one ends.
    """

    name: str
    graph: CompiledGraph
    path: Path | None
    limit: int
    executor: GraphExecutor | None = None
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    inflight: int = 0
    rate: ServiceRate = field(default_factory=ServiceRate)  # completions per busy second
    node_times: NodeTimes = field(default_factory=NodeTimes)  # each node's recent run time
    reload_lock: anyio.Lock = field(default_factory=anyio.Lock)
    _users: dict[GraphExecutor, int] = field(default_factory=dict)
    _retired: dict[GraphExecutor, Callable[[GraphExecutor], None]] = field(default_factory=dict)

    @property
    def spec(self) -> GraphSpec:
        return self.graph.spec

    def bind(
        self, executor: GraphExecutor, release: Callable[[GraphExecutor], None] | None = None
    ) -> None:
        """Swap in an executor for requests admitted from now on; ``release(old)``
        runs when the old one has no request left."""
        old, self.executor = self.executor, executor
        self.graph = executor.graph
        self.nodes = node_infos(executor)
        if old is not None and release is not None:
            if self._users.get(old, 0):
                self._retired[old] = release
            else:
                release(old)

    def enter(self) -> GraphExecutor:
        self.inflight += 1
        self.rate.started()
        self._users[self.executor] = self._users.get(self.executor, 0) + 1
        return self.executor

    def leave(self, executor: GraphExecutor) -> None:
        self.inflight -= 1
        self.rate.ended()
        self._users[executor] -= 1
        if self._users[executor] == 0:
            del self._users[executor]
            release = self._retired.pop(executor, None)
            if release is not None:
                release(executor)


def node_infos(executor: GraphExecutor) -> dict[str, NodeInfo]:
    infos = {}
    for name, node in executor.graph.spec.nodes.items():
        if isinstance(node, PythonNode):
            infos[name] = NodeInfo("python", "")
            continue
        infos[name] = NodeInfo(node.kind, executor.clients[node.model].name)
    return infos


class AppState:
    """Everything the routes share: graphs, models, readiness, in-flight count, metrics."""

    def __init__(
        self,
        graphs: list[tuple[GraphSpec, Path | None]],
        config: ServerConfig,
        runtime: Callable[[list[GraphSpec], EngineConfig], Runtime] | None = None,
    ):
        """``runtime(specs, engine_config)`` makes what holds the models: by default a
        ModelRuntime in this process; on Ray, the cluster's engine groups."""
        self.config = config
        self._make_runtime = runtime
        self.metrics = Metrics(histogram_buckets(spec for spec, _path in graphs))
        # loads, unloads and reloads: on threads that end (engine/passing_threads.py)
        self.model_work = PassingThreads("trae-models")
        self.large_bodies = LargeBodies(
            config.large_body_bytes, config.max_large_bodies, config.retry_after_s
        )
        self.graphs: dict[str, ServedGraph] = {}
        for spec, path in graphs:
            if spec.name in self.graphs:
                raise ValueError(f"two graphs are named '{spec.name}'")
            self.graphs[spec.name] = ServedGraph(
                spec.name, compile_graph(spec), path, config.limit_for(spec.name)
            )
        self.runtime: Runtime | None = None
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.inflight = 0
        self._idle: list[anyio.Event] = []  # waiters for "no request in flight"
        self.admin_token = config.token()
        self.created = int(time.time())
        self.on_load_failed: Callable[[], None] | None = None  # serve() stops the process
        self.metrics.watch_engine(
            lambda: self.runtime.replica_stats() if self.runtime is not None else {},
            lambda: {g.name: g.nodes for g in self.graphs.values()},
            lambda: self.ready and not self.draining and self.engine_down() is None,
        )
        self.profiler = None
        if config.memory_profile:
            from trae_groups.monitor import MemoryProfiler

            self.profiler = MemoryProfiler(
                config.memory_profile_interval_s,
                config.memory_profile,
                stats=lambda: self.runtime.replica_stats().values() if self.runtime else (),
            ).start()

    # -- models --------------------------------------------------------------------
    def load(self) -> None:
        """Load every model and start the engine (blocking: run it in a thread)."""
        try:
            engine_config = self.config.engine or EngineConfig()
            specs = [g.spec for g in self.graphs.values()]
            runtime = (self._make_runtime or self._default_runtime())(specs, engine_config)
            self.runtime = runtime
            for served in self.graphs.values():
                served.bind(runtime.bind(served.graph))
            runtime.start()
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self.settle_heap(refreeze=False)
        stats = runtime.stats()
        if stats is None:  # engines elsewhere that have not posted stats yet
            log.info("ready: %d graph(s)", len(self.graphs))
        else:
            log.info(
                "ready: %d graph(s) on device %s, attention backend %s, pool %d pages x %d bytes",
                len(self.graphs),
                stats.device,
                stats.attention_backend,
                stats.pool.num_pages,
                stats.pool.page_bytes,
            )
        self.ready = True

    def _default_runtime(self) -> Callable[[list[GraphSpec], EngineConfig], Runtime]:
        if self.config.engine_process:
            from trae_groups.engine_process import EngineProcessRuntime

            return EngineProcessRuntime.for_specs
        from trae_groups.graphs.runtime import ModelRuntime

        return ModelRuntime.for_specs

    def engine_down(self) -> str | None:
        """Why the engine cannot take work although the models loaded (its process died
        and is being restarted), or None."""
        if self.runtime is None or not self.ready:
            return None
        unavailable = getattr(self.runtime, "unavailable", None)  # a runtime of before
        return unavailable() if unavailable is not None else None

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if self.runtime is not None:
            self.runtime.shutdown()
        if self.config.freeze_gc:
            gc.unfreeze()  # let interpreter shutdown collect (and finalize) everything

    def settle_heap(self, refreeze: bool = True) -> None:
        """After models load or unload: keep them out of the garbage collector's full
        passes (``ServerConfig.freeze_gc``). Blocking: a collection takes ~0.1-0.3 s."""
        if self.config.freeze_gc:
            from trae_groups.graphs.runtime import settle_heap

            frozen = settle_heap(refreeze)
            log.info("%d long-lived objects moved out of the garbage collector's way", frozen)

    def retire(self, executor: GraphExecutor) -> None:
        """Release a replaced executor's models, off the event loop (it waits for the
        engine thread between two steps)."""

        def release() -> None:
            try:
                self.runtime.release(executor)
            except Exception:
                log.exception("releasing the models of a replaced graph failed")
            self.settle_heap()

        asyncio.get_running_loop().run_in_executor(self.model_work, release)

    # -- admission -------------------------------------------------------------------
    def graph(self, name: str) -> ServedGraph:
        served = self.graphs.get(name)
        if served is None:
            known = ", ".join(sorted(self.graphs)) or "none"
            raise not_found(f"unknown graph '{name}'; served: {known}")
        return served

    def require_ready(self, graph: str | None = None) -> None:
        retry = self.config.retry_after_s
        if self.draining:
            if graph:
                self.metrics.observe_rejected(graph, "draining")
            raise unavailable("the server is shutting down", retry, type="ShuttingDown")
        if not self.ready:
            if graph:
                self.metrics.observe_rejected(graph, "not_ready")
            message = f"models failed to load: {self.load_error}" if self.load_error else None
            raise unavailable(message or "models are loading", retry, type="NotReady")
        down = self.engine_down()
        if down is not None:
            if graph:
                self.metrics.observe_rejected(graph, "engine_down")
            raise unavailable(down, retry, type="EngineUnavailable")

    def entered(self, served: ServedGraph) -> None:
        """One more request in flight (admitted by its RunScope, trae_groups/serving/run_scope.py)."""
        self.inflight += 1
        self.metrics.inflight.labels(served.name).inc()

    def released(self, served: ServedGraph) -> None:
        self.inflight -= 1
        self.metrics.inflight.labels(served.name).dec()
        if self.inflight == 0:
            for event in self._idle:
                event.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` ran out first.
        Called while draining, when nothing new is admitted."""
        idle = anyio.Event()
        self._idle.append(idle)
        try:
            with anyio.move_on_after(timeout):
                if self.inflight:
                    await idle.wait()
                return True
            return False
        finally:
            self._idle.remove(idle)
