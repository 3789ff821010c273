"""``EngineProcessRuntime``: the served graphs' models in a child engine process.

What the app's state holds instead of a ``ModelRuntime`` when ``trae serve`` splits
the engine off (the default there): graphs are compiled and bound here, in the front
(executor, templates, python nodes, routes between versions), and their models load
in the child, which runs today's ``ModelHost`` unchanged (child.py).

Life cycle. The child is started with the runtime and loads what ``bind`` asks;
every call that changes what it holds (init, bind, start, release, versions) is kept
in a journal. When the child dies, the channel closes: every call and stream in
flight fails at once with ``EngineLost`` (503 with the reason), ``unavailable()``
says why (``/health`` and ``/ready`` answer 503), and a new child is started with
backoff (``RESTART_BACKOFF_S``) and given the journal again, so the same clients
work again. ``shutdown`` asks the child to stop, then terminates and kills it if it
does not; a child whose front dies (even by SIGKILL) sees its channel close and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from trae_groups.engine.config import EngineConfig
from trae_groups.engine.errors import EngineStopped
from trae_groups.engine.protocol import EncodeRequest, EngineStats, GenerateRequest, GenerationChunk
from trae_groups.engine_process.client import EngineClient
from trae_groups.engine_process.wire import CHUNK, Channel
from trae_groups.graphs.compile import CompiledGraph, compile_graph, resolve_functions
from trae_groups.graphs.executor import GraphExecutor
from trae_groups.graphs.routing import RouteError, check_split
from trae_groups.graphs.runtime import find_versioned, versioned_models
from trae_groups.graphs.spec import GraphSpec

log = logging.getLogger("trae_groups.engine_process")

#: How long a new child may take to start its interpreter and say hello.
HELLO_TIMEOUT_S = 120.0
#: Waits before each restart of a dead child; one failed start after the other, then it
#: stays down (503 with the reason) until the server restarts.
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
#: An attached front's waits for the owner's restarted engine process (about two minutes).
ATTACH_BACKOFF_S = (0.5, 1.0, 2.0) + (4.0,) * 30
#: Restarts in one server's life; past them a crash loop stays down (503 with the reason).
MAX_RESTARTS = 10
#: How long shutdown waits for the child to stop by itself, then after SIGTERM.
STOP_TIMEOUT_S = 30.0
KILL_TIMEOUT_S = 5.0
#: How long a child whose channel closed is given to be reaped before the reason is told.
EXIT_WAIT_S = 3.0
#: A stats read (a metrics scrape) waits this long for the child, then reports none.
STATS_TIMEOUT_S = 10.0
#: The front asks a serving child every HEARTBEAT_S whether it runs; one that has not
#: answered within HUNG_AFTER_S (its event loop stuck) is killed, and so restarted.
HEARTBEAT_S = 5.0
HUNG_AFTER_S = 60.0


class EngineLost(EngineStopped):
    """The engine process died, or is being restarted (503: retry soon)."""


@dataclass(eq=False)
class Stream:
    """One generation's end in the front: chunks (or the error) land on ``queue``."""

    sid: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_id: str


class EngineProcessRuntime:
    """Every model of every served graph, on one engine in a child process."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        log_level: str | None = None,
        restart_backoff_s: tuple[float, ...] = RESTART_BACKOFF_S,
        listen: str | None = None,
        attach: str | None = None,
    ):
        """``restart_backoff_s``: the wait before each try to restart a dead child;
        ``listen``: a Unix socket path the child opens for more fronts; ``attach``: be
        such a front, on the engine process another front started (``trae serve
        --api-workers``): connect, never start, stop or restart it."""
        self.config = config or EngineConfig()
        self.restart_backoff_s = restart_backoff_s if attach is None else ATTACH_BACKOFF_S
        self.listen = listen
        self.attach_path = attach
        self.log_level = log_level or logging.getLevelName(log.getEffectiveLevel())
        self.graphs: dict[str, GraphExecutor] = {}
        self.restarts = 0  # children started after the first
        self._bindings: dict[GraphExecutor, int] = {}
        self._ids = itertools.count(os.getpid() * 1_000_000_000 + 1)  # unique across fronts
        self._lock = threading.Lock()  # the channel, the calls and the streams in flight
        self._admin = threading.RLock()  # one change of what the child holds at a time
        self._journal: list[tuple[str, tuple, int | None]] = []  # (op, args, binding)
        self._calls: dict[int, Future] = {}
        self._streams: dict[int, Stream] = {}
        self._channel: Channel | None = None
        self._proc: subprocess.Popen | None = None
        self._hello = threading.Event()
        self._down: str | None = "the engine process is starting"
        self._closing = False
        self.before_shutdown: Callable[[], None] | None = None

    @classmethod
    def for_specs(
        cls, specs: list[GraphSpec], config: EngineConfig | None = None, **kwargs: Any
    ) -> EngineProcessRuntime:
        """A child started for the graphs (its host sized for all their models)."""
        runtime = cls(config, **kwargs)
        runtime._spawn()
        if runtime.attach_path is not None:
            return runtime  # the owner sized the host
        try:
            runtime._journaled("init", (list(specs), runtime.config))
        except BaseException:
            runtime.shutdown()  # nobody else holds it yet to stop it
            raise
        return runtime

    # -- the child process ----------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def unavailable(self) -> str | None:
        """Why the engine cannot take work now (None: it can)."""
        return self._down

    def _spawn(self) -> None:
        """A new child (or, attached, a connection to the owner's), once it says hello."""
        if self.attach_path is not None:
            self._connect()
            return
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        path = [p for p in sys.path if p] + env.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trae_groups.engine_process.child",
                 str(theirs.fileno()), self.log_level, self.listen or "-"],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
        channel = self._open(Connection(ours.detach()), proc)
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while not self._hello.wait(0.1):
            if channel.closed or time.monotonic() > deadline:
                _stop(proc, 0)
                raise EngineLost(f"the engine process did not start ({_exit_text(proc)})")
        log.info("engine process %d started", proc.pid)

    def _open(self, conn: Connection, proc: subprocess.Popen | None) -> Channel:
        channel: Channel | None = None

        def received(messages: list) -> None:
            self._received(channel, messages)

        def closed(reason: str) -> None:
            self._lost(channel, reason)

        channel = Channel(conn, received, closed, "trae-front")
        with self._lock:
            self._hello.clear()
            self._proc, self._channel = proc, channel
        channel.start()
        return channel

    def _connect(self) -> None:
        """Attach to the engine process listening at ``attach_path`` (tried until it is
        there: the owner may still be starting it)."""
        from multiprocessing.connection import Client

        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while True:
            try:
                conn = Client(self.attach_path, family="AF_UNIX")
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise EngineLost(f"no engine process at {self.attach_path}: {exc}") from None
                time.sleep(0.2)
        channel = self._open(conn, None)
        while not self._hello.wait(0.1):
            if channel.closed or time.monotonic() > deadline:
                raise EngineLost("the engine process did not answer")
        log.info("attached to the engine process at %s", self.attach_path)

    def _received(self, channel: Channel, messages: list) -> None:
        """Reader thread: replies resolve their calls; each "out" is one hand-off per
        event loop for every stream it carries."""
        for message in messages:
            kind = message[0]
            if kind == "out":
                self._fan_out(message[1])
            elif kind == "reply":
                _, cid, ok, value = message
                with self._lock:
                    future = self._calls.pop(cid, None)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
            elif kind == "hello":
                self._hello.set()

    def _fan_out(self, entries: list) -> None:
        items = []
        with self._lock:
            for sid, kind, payload in entries:
                stream = self._streams.get(sid)
                if stream is not None:  # else closed by the front already
                    items.append((stream, GenerationChunk(*payload) if kind == CHUNK else payload))
        _hand_off(items)

    def _lost(self, channel: Channel, reason: str) -> None:
        """The channel closed: fail everything in flight now, then restart (unless this
        is the shutdown)."""
        with self._lock:
            if channel is not self._channel:
                return
            self._channel = None
            calls, self._calls = self._calls, {}
            streams, self._streams = self._streams, {}
            proc, closing = self._proc, self._closing
            serving = self._down is None  # else a start or a restart in progress handles it
        if closing or not serving:
            lost = EngineLost(self._down or "the server is shutting down")
        else:
            if proc is None:  # attached: the owner restarts it
                self._down = "the engine process went away; waiting for it to restart"
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(EXIT_WAIT_S)  # for its exit status: the reason says how
                self._down = f"the engine process exited ({_exit_text(proc)}); restarting it"
            log.error("%s (%s)", self._down, reason)
            lost = EngineLost(self._down)
        for future in calls.values():
            if not future.done():
                future.set_exception(lost)
        _hand_off([(stream, lost) for stream in streams.values()])
        if closing or not serving:
            return
        if self.restarts >= MAX_RESTARTS:
            self._down = f"the engine process died {self.restarts + 1} times; not restarting it"
            log.error(self._down)
        else:
            threading.Thread(target=self._restart, name="trae-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        """A new child, given the journal again; bounded tries with backoff."""
        with self._lock:
            dead = self._proc
        _stop(dead, KILL_TIMEOUT_S)  # it closed its end: it is exiting, or is made to
        error = ""
        for wait in self.restart_backoff_s:
            time.sleep(wait)
            if self._closing:
                return
            try:
                with self._admin:
                    self._spawn()
                    for op, args, _ in list(self._journal):
                        self.call(op, *args)
                if self._closing:  # shut down meanwhile: this child is not wanted
                    raise EngineLost("the server is shutting down")
                self.restarts += 1
                self._down = None
                if self.attach_path is None:
                    log.info("engine process restarted (pid %d)", self.pid)
                else:
                    log.info("attached again to the restarted engine process")
                return
            except Exception as exc:
                with self._lock:
                    proc, channel = self._proc, self._channel
                _stop(proc, 0)  # a child that started but could not load: SIGTERM it
                if channel is not None:
                    channel.close()
                if self._closing:
                    return
                error = f"{type(exc).__name__}: {exc}"
                log.error("restarting the engine process failed: %s", error)
        self._down = f"the engine process died and could not be restarted ({error})"

    # -- calls ------------------------------------------------------------------------
    def _register(self, message: Any) -> tuple[int, Future]:
        """A call's future, registered and its message sent; EngineLost while down."""
        future: Future = Future()
        with self._lock:
            channel = self._channel
            if channel is None or channel.closed:
                raise EngineLost(self._down or "the engine process is not running")
            cid = next(self._ids)
            self._calls[cid] = future
            channel.send(message(cid))
        return cid, future

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """One operation in the child, waited for (blocking: off the event loop). It
        fails with EngineLost when the child dies first, TimeoutError past ``timeout``."""
        cid, future = self._register(lambda cid: ("call", cid, op, args))
        try:
            return future.result(timeout)
        except TimeoutError:
            with self._lock:
                self._calls.pop(cid, None)
            raise

    def _journaled(self, op: str, args: tuple, binding: int | None = None) -> Any:
        """A call that changes what the child holds: done, then kept for a restart."""
        with self._admin:
            value = self.call(op, *args)
            self._journal.append((op, args, binding))
            return value

    async def encode(
        self, binding: int, key: tuple, request: EncodeRequest, trace: dict | None = None
    ) -> dict[str, Any]:
        """One encoder item: its result comes back on a stream of one, with the step's
        other outputs; leaving early cancels it (the batch skips it). ``trace``: the
        caller's W3C trace context, which the engine process's span joins."""
        stream = self._open_stream("enc", binding, key, request, trace)
        finished = False
        try:
            item = await stream.queue.get()
            finished = True
        finally:
            self.close_stream(stream.sid, cancel=not finished)
        if isinstance(item, BaseException):
            raise item
        return item

    def open_stream(
        self, binding: int, key: tuple, request: GenerateRequest, trace: dict | None = None
    ) -> Stream:
        """From the event loop: the generation sent, its chunks to come on the stream."""
        return self._open_stream("gen", binding, key, request, trace)

    def _open_stream(
        self, kind: str, binding: int, key: tuple, request: Any, trace: dict | None
    ) -> Stream:
        stream = Stream(0, asyncio.get_running_loop(), asyncio.Queue(), request.request_id)
        with self._lock:
            channel = self._channel
            if channel is None or channel.closed:
                raise EngineLost(self._down or "the engine process is not running")
            stream.sid = next(self._ids)
            self._streams[stream.sid] = stream
            channel.send((kind, stream.sid, binding, key, request, trace))
        return stream

    def abort_stream(self, sid: int) -> None:
        with self._lock:
            if sid in self._streams and self._channel is not None:
                self._channel.send(("abort", sid))

    def close_stream(self, sid: int, cancel: bool) -> None:
        """The front stopped reading: ``cancel`` frees the engine's work unless it ended."""
        with self._lock:
            if self._streams.pop(sid, None) is not None and cancel and self._channel is not None:
                self._channel.send(("close", sid))

    # -- the Runtime protocol -------------------------------------------------------------
    def start(self) -> None:
        if self.attach_path is None:
            self._journaled("start", ())
        self._down = None
        threading.Thread(target=self._heartbeat, name="trae-engine-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """A child that is alive but stuck would hang every request: kill it instead."""
        while not self._closing:
            time.sleep(HEARTBEAT_S)
            if self._down is not None or self._closing:
                continue
            with self._lock:
                proc = self._proc
            try:
                self.call("running", timeout=HUNG_AFTER_S)
            except TimeoutError:
                if not self._closing and proc is not None and proc.poll() is None:
                    log.error(
                        "the engine process did not answer for %.0f s: killing it", HUNG_AFTER_S
                    )
                    proc.kill()  # its channel closes: the death path restarts it
            except EngineStopped:
                pass  # died meanwhile: the death path has it

    def shutdown(self) -> None:
        """Ask the child to stop; SIGTERM, then SIGKILL, if it does not in time."""
        self._closing = True
        with self._lock:
            proc, channel = self._proc, self._channel
        if self.before_shutdown is not None:
            self.before_shutdown()  # other fronts on this engine drain first
        if self.attach_path is not None:  # not ours to stop: leave it
            self._down = "this front is stopped"
            if channel is not None:
                channel.close()
            return
        if channel is not None and not channel.closed:
            try:
                self.call("shutdown", timeout=STOP_TIMEOUT_S)
            except Exception as exc:
                log.warning("the engine process did not stop cleanly: %s", exc)
        _stop(proc, STOP_TIMEOUT_S)
        self._down = "the engine process is stopped"
        if channel is not None:
            channel.close()

    def bind(self, spec: GraphSpec | CompiledGraph) -> GraphExecutor:
        """An executor here, for the graph's models loaded (once) in the child."""
        graph = spec if isinstance(spec, CompiledGraph) else compile_graph(spec)
        functions = resolve_functions(graph.spec)
        with self._admin:
            binding = next(self._ids)
            described = self._journaled("bind", (binding, graph.spec), binding)
        clients = {
            tuple(key): EngineClient(self, binding, tuple(key), name, task)
            for key, (name, task) in described.items()
        }
        executor = GraphExecutor(graph, versioned_models(graph.spec, clients), functions)
        self._bindings[executor] = binding
        self.graphs[graph.spec.name] = executor
        return executor

    def release(self, executor: GraphExecutor) -> None:
        binding = self._bindings.pop(executor, None)
        if binding is None:
            return
        with self._admin:
            self._journal = [j for j in self._journal if j[2] != binding]
            if self._down is None:
                self.call("release", binding)

    def set_route(self, graph: str, model: str, weights: dict[str, float]) -> dict[str, float]:
        versioned = find_versioned(self.graphs, graph, model)
        versioned.router.set_weights(check_split(weights, list(versioned.clients)))
        return versioned.router.weights

    def add_version(
        self, graph: str, model: str, version: str, path: str | Path, adapter: bool = False
    ) -> None:
        versioned = find_versioned(self.graphs, graph, model)
        if version in versioned.clients:
            raise RouteError(f"model {model!r} already has a version {version!r}")
        executor = self.graphs[graph]
        named = executor.graph.spec.models[model].adapters
        if adapter and named and version in named:
            raise RouteError(f"model {model!r} has an adapter named {version!r}; rename one")
        binding = self._bindings[executor]
        args = (binding, model, version, str(path), adapter)
        name, task = self._journaled("add_version", args, binding)
        client = EngineClient(self, binding, (model, version), name, task)
        versioned.add(version, client, str(path))

    def remove_version(self, graph: str, model: str, version: str) -> None:
        versioned = find_versioned(self.graphs, graph, model)
        if version not in versioned.clients:
            raise RouteError(f"model {model!r} has no version {version!r}")
        if len(versioned.clients) == 1:
            raise RouteError(f"{version!r} is the only version of {model!r}")
        binding = self._bindings[self.graphs[graph]]
        source = versioned.sources.get(version)
        client = versioned.remove(version)  # refuses while a route still sends it traffic
        try:
            self._journaled("remove_version", (binding, model, version), binding)
        except Exception:  # an adapter version still serving requests: it stays (at 0%)
            versioned.add(version, client, source)
            raise

    def stats(self) -> EngineStats | None:
        """The child's stats; None while it is down (or too slow to answer a scrape)."""
        if self._down is not None:
            return None
        try:
            return self.call("stats", timeout=STATS_TIMEOUT_S)
        except (EngineStopped, TimeoutError):
            return None

    def replica_stats(self) -> dict[str, EngineStats]:
        stats = self.stats()
        return {"local": stats} if stats is not None else {}


def _hand_off(items: list[tuple[Stream, Any]]) -> None:
    """Items onto their streams' queues: one call into each event loop for them all."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, queued in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed
            loop.call_soon_threadsafe(_deliver, queued)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _stop(proc: subprocess.Popen | None, timeout: float) -> None:
    """Wait for the process up to ``timeout``, then SIGTERM, then SIGKILL."""
    if proc is None:
        return
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout if sig is None else KILL_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _exit_text(proc: subprocess.Popen | None) -> str:
    code = proc.poll() if proc is not None else None
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


__all__ = ["EngineLost", "EngineProcessRuntime"]
