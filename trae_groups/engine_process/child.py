"""The engine process: today's ``ModelHost`` (models, pool, loop, scheduler) driven by
messages from the front.

``python -m trae_groups.engine_process.child FD [LOG_LEVEL [LISTEN]]``, started by the
front's ``EngineProcessRuntime`` with its end of a socket pair as FD (LISTEN: a Unix
socket path more fronts attach to, ``trae serve --api-workers``). Messages
(tuples; ``wire.py`` frames them):

front → engine                                      engine → front
("call", cid, op, args)  admin and reads            ("hello", pid)
("gen", sid, binding, key, GenerateRequest, trace)  ("reply", cid, ok, value or exception)
("abort", sid)  end it, its last chunk follows      ("out", [(sid, kind, payload), ...])
("close", sid)  the front stopped waiting            kind: CHUNK (GenerationChunk fields),
("enc", sid, binding, key, EncodeRequest, trace)           RESULT (an encoder's), ERROR

``trace``: the caller's W3C trace context (graphs/tracing.py) or None. With tracing on in
this process too (the front's OTEL_* variables, which it inherits), each generation and
encoder item is a span ``engine <model>`` there, a child of the node's span.

A generation runs as the model's own client's ``generate`` (residency, adapters,
prefix caching and long-prompt tokenizing behave as in one process); every chunk
(and encoder result) that comes while the event loop handles one engine step's
outputs goes out in one "out" message. Admin calls run in order on one thread, reads on another, so a model
load never stalls a stream. When the front goes away (its end closes: exit, crash,
SIGKILL) this process stops its engine and exits; SIGINT is ignored (a Ctrl-C
reaches the whole process group, and the front drains first, then says stop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from trae_groups.engine.errors import RequestError
from trae_groups.engine.host import ModelHost
from trae_groups.engine.memory import LARGE_PIECE_BYTES, TrimSoon
from trae_groups.engine.passing_threads import PassingThreads
from trae_groups.engine.protocol import ModelClient
from trae_groups.engine_process.wire import CHUNK, ERROR, RESULT, Channel, chunk_fields, pack_error
from trae_groups.graphs import tracing
from trae_groups.graphs.routing import RouteError
from trae_groups.graphs.runtime import engine_name, host_for, load_clients, model_load, settle_heap
from trae_groups.graphs.spec import GraphSpec

log = logging.getLogger("trae_groups.engine_process")

#: After the front is gone, the engine gets this long to stop before the process exits anyway.
EXIT_GRACE_S = 10.0
#: How often the process checks that its parent is still the one that started it.
PARENT_CHECK_S = 1.0


@dataclass
class Binding:
    """One graph as the front bound it: its spec and the clients of its (model, version)s."""

    spec: GraphSpec
    clients: dict[tuple[str, str], ModelClient] = field(default_factory=dict)


@dataclass
class Live:
    """A generation in flight: the task that pumps its chunks, how to abort it, and the
    front it answers."""

    task: asyncio.Task
    client: ModelClient
    request_id: str
    front: Channel


class EngineServer:
    """What runs in the engine process: the host, the bindings, the live streams.

    The front that started the process owns it (its channel closing stops the
    process); with ``listen``, more fronts (``trae serve --api-workers``) attach over a
    Unix socket at that path, and one of them leaving only ends its own work. Ids of
    bindings, streams and calls are unique across fronts (each front mints its own).
    """

    def __init__(self, conn: Connection, listen: str | None = None):
        self.host: ModelHost | None = None
        self.bindings: dict[int, Binding] = {}
        self.binders: dict[int, Channel] = {}  # binding -> the front that bound it
        self.streams: dict[int, Live] = {}  # sid -> the task pumping it
        self.encodes: dict[int, tuple[asyncio.Task, Channel]] = {}  # sid -> its task
        self.outbox: dict[Channel, list[tuple]] = {}
        self.sent = [0, 0]  # chunks, "out" messages: how well the batching does
        # loads and reads off the engine thread: on threads that end, so that no second
        # OpenMP team stays to throttle the engine's (engine/passing_threads.py)
        self.admin = PassingThreads("trae-engine-admin")
        self.reads = PassingThreads("trae-engine-reads")
        self.trim = TrimSoon()
        self.channel = self._front(conn, "trae-engine")
        self.listen = listen
        self.parent = os.getppid()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.done: asyncio.Event | None = None

    def _front(self, conn: Connection, name: str) -> Channel:
        channel: Channel | None = None

        def received(messages: list[tuple]) -> None:
            with suppress(RuntimeError):  # the loop is closing
                self.loop.call_soon_threadsafe(self._dispatch, channel, messages)

        def closed(reason: str) -> None:
            self._closed(channel, reason)

        channel = Channel(conn, received, closed, name)
        return channel

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        self.channel.start()
        self.channel.send(("hello", os.getpid()))
        threading.Thread(target=self._watch_parent, name="trae-engine-parent", daemon=True).start()
        await self.done.wait()
        log.info("engine process: %d chunks sent in %d messages", *self.sent)
        for task in [*(s.task for s in self.streams.values())] + [
            t for t, _ in self.encodes.values()
        ]:
            task.cancel()
        await asyncio.sleep(0)
        if self.host is not None:
            await self.loop.run_in_executor(self.reads, self.host.shutdown)
        if self.listen:  # the socket and its private folder (trae serve --api-workers)
            with suppress(OSError):
                os.unlink(self.listen)
                os.rmdir(os.path.dirname(self.listen))
        self.channel.close(wait_s=5.0)

    # -- from the reader threads --------------------------------------------------------
    def _closed(self, front: Channel, reason: str) -> None:
        """The owner gone: stop, and exit whatever happens within EXIT_GRACE_S. Another
        front gone: its work ends, its bindings are released."""
        if front is not self.channel:
            log.info("engine process: an attached front went away (%s)", reason)
            with suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._detach, front)
            return
        log.info("engine process: the front went away (%s); stopping", reason)
        _exit_after(EXIT_GRACE_S)
        with suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.done.set)

    def _watch_parent(self) -> None:
        """A front killed while something else still held its end of the channel would
        not close it: a new parent (the process was re-parented) stops this one too."""
        while not self.channel.closed:
            if os.getppid() != self.parent:
                self._closed(self.channel, "its process exited")
                return
            threading.Event().wait(PARENT_CHECK_S)

    def _accept(self) -> None:
        """More fronts, on the Unix socket at ``listen`` (its folder is private to the user)."""
        from multiprocessing.connection import Listener

        with suppress(FileNotFoundError):
            os.unlink(self.listen)  # the socket of an engine process that died
        with Listener(self.listen, family="AF_UNIX") as listener:
            while not self.channel.closed:
                try:
                    conn = listener.accept()
                except OSError:
                    return
                front = self._front(conn, "trae-engine-attached")
                front.start()
                front.send(("hello", os.getpid()))

    # -- on the event loop --------------------------------------------------------------
    def _dispatch(self, front: Channel, messages: list[tuple]) -> None:
        for message in messages:
            kind = message[0]
            if kind == "gen":
                self._generate(front, *message[1:])
            elif kind == "abort":
                live = self.streams.get(message[1])
                if live is not None:  # the engine finishes it as "abort"; that chunk follows
                    live.client.abort(live.request_id)
            elif kind == "close":
                live = self.streams.pop(message[1], None)
                if live is not None:
                    live.task.cancel()  # closing the stream aborts the engine work
                running = self.encodes.pop(message[1], None)
                if running is not None:
                    running[0].cancel()  # the batch skips a cancelled item
            elif kind == "enc":
                sid = message[1]
                task = self.loop.create_task(self._encode(front, *message[1:]))
                self.encodes[sid] = (task, front)
            elif kind == "call":
                self.loop.create_task(self._call(front, *message[1:]))

    def _detach(self, front: Channel) -> None:
        """An attached front left: cancel its work, release what it bound."""
        for sid, live in list(self.streams.items()):
            if live.front is front:
                self.streams.pop(sid, None)
                live.task.cancel()
        for cid, (task, owner) in list(self.encodes.items()):
            if owner is front:
                self.encodes.pop(cid, None)
                task.cancel()
        self.outbox.pop(front, None)
        for binding in [b for b, f in self.binders.items() if f is front]:
            del self.binders[binding]
            self.loop.run_in_executor(self.admin, self.op_release, binding)

    def _out(self, front: Channel, sid: int, kind: int, payload: Any) -> None:
        """Queue one stream's chunk, result or error; everything queued before the loop
        gets back to its scheduled callbacks leaves as one message per front."""
        if kind == CHUNK:
            payload = chunk_fields(payload)
        elif kind == ERROR:
            payload = pack_error(payload)
        if not self.outbox:
            self.loop.call_soon(self._flush)
        self.outbox.setdefault(front, []).append((sid, kind, payload))

    def _flush(self) -> None:
        batches, self.outbox = self.outbox, {}
        for front, batch in batches.items():
            front.send(("out", batch))
            self.sent[0] += len(batch)
            self.sent[1] += 1

    def _generate(
        self, front: Channel, sid: int, binding: int, key: tuple, request: Any, trace: Any
    ) -> None:
        try:
            client = self._client(binding, key)
            stream = client.generate(request)
        except Exception as exc:  # RequestError, EngineStopped, ...: before any work
            self._out(front, sid, ERROR, exc)
            return
        span = _span(client, request, trace)
        task = self.loop.create_task(self._pump(front, sid, stream, _is_large(request), span))
        self.streams[sid] = Live(task, client, request.request_id, front)

    async def _pump(self, front: Channel, sid: int, stream: Any, large: bool, span: Any) -> None:
        try:
            with span:
                async with aclosing(stream):
                    async for chunk in stream:
                        self._out(front, sid, CHUNK, chunk)
        except asyncio.CancelledError:
            pass  # aborted by the front: aclosing closed the stream, which aborted the work
        except Exception as exc:
            self._out(front, sid, ERROR, exc)
        finally:
            self.streams.pop(sid, None)
            if large:  # what tokenizing it took stays in glibc's arenas until trimmed
                self.trim.request()

    async def _encode(
        self, front: Channel, sid: int, binding: int, key: tuple, request: Any, trace: Any
    ) -> None:
        try:
            client = self._client(binding, key)
            with _span(client, request, trace):
                result = await client.encode(request)
            self._out(front, sid, RESULT, result)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            self._out(front, sid, ERROR, exc)
        finally:
            self.encodes.pop(sid, None)

    async def _call(self, front: Channel, cid: int, op: str, args: tuple) -> None:
        method = getattr(self, f"op_{op}", None)
        pool = self.reads if op in ("stats", "model_stats", "running") else self.admin
        try:
            if method is None:
                raise RequestError("op", f"the engine process has no operation {op!r}")
            if op in ("init", "start", "shutdown") and front is not self.channel:
                raise RequestError("op", f"only the front that started the engine may {op} it")
            value = await self.loop.run_in_executor(pool, method, *args)
            if op == "bind":
                self.binders[args[0]] = front
            front.send(("reply", cid, True, value))
        except Exception as exc:
            front.send(("reply", cid, False, pack_error(exc)))
        if op == "shutdown":
            self.done.set()

    def _client(self, binding: int, key: tuple) -> ModelClient:
        held = self.bindings.get(binding)
        client = held.clients.get(tuple(key)) if held is not None else None
        if client is None:
            raise RequestError("model", f"the engine process holds no model {key!r}")
        return client

    # -- operations (admin thread; reads on their own) ----------------------------------
    def op_init(self, specs: list[GraphSpec], config: Any) -> None:
        """The host, sized for every graph's models; then other fronts may attach."""
        self.host = host_for(specs, config)
        if self.listen:
            threading.Thread(target=self._accept, name="trae-engine-accept", daemon=True).start()

    def op_bind(self, binding: int, spec: GraphSpec) -> dict[tuple, tuple[str, str]]:
        """Load a graph's models (those loaded already are shared); (model, version) ->
        (its name on the engine, its task)."""
        clients = load_clients(self.host, spec)
        self.bindings[binding] = Binding(spec, dict(clients))
        return {key: (c.name, c.task) for key, c in clients.items()}

    def op_start(self) -> None:
        self.host.start()
        settle_heap()

    def op_release(self, binding: int) -> None:
        self.binders.pop(binding, None)
        held = self.bindings.pop(binding, None)
        if held is not None:
            for client in held.clients.values():
                self.host.release(client)
            settle_heap(refreeze=True)

    def op_add_version(
        self, binding: int, model: str, version: str, path: str, adapter: bool
    ) -> tuple[str, str]:
        """A model folder as a new version, or a LoRA adapter on the model's base (the
        front checked the names); (its name on the engine, its task)."""
        held = self.bindings[binding]
        if adapter:
            base = next(
                (c for (m, _), c in held.clients.items() if m == model and self.host.adaptable(c)),
                None,
            )
            if base is None:
                raise RouteError(f"model {model!r} is not a generate model: adapters need one")
            client = self.host.adapter_version(base, version, Path(path))
        else:
            load = model_load(held.spec, model, version, folder=Path(path))
            client = self.host.acquire(engine_name(model, version), load)
        held.clients[(model, version)] = client
        settle_heap(refreeze=True)
        return client.name, client.task

    def op_remove_version(self, binding: int, model: str, version: str) -> None:
        held = self.bindings[binding]
        client = held.clients[(model, version)]
        busy = self.host.adapter_users(client)
        if busy:
            raise RouteError(f"version {version!r} still serves {busy} request(s)")
        del held.clients[(model, version)]
        self.host.release(client)
        self.host.drop_adapter(client)
        settle_heap(refreeze=True)

    def op_stats(self) -> Any:
        return self.host.stats() if self.host is not None else None

    def op_model_stats(self, binding: int, key: tuple) -> Any:
        return self._client(binding, key).stats()

    def op_running(self) -> bool:
        return self.host is not None and self.host.running

    def op_shutdown(self) -> None:
        if self.host is not None:
            self.host.shutdown()


def _exit_after(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, args=(0,))
    timer.daemon = True
    timer.start()


def _span(client: ModelClient, request: Any, trace: dict | None) -> Any:
    """This process's span of one request (graphs/tracing.py), in the caller's trace."""
    return tracing.served_span(
        f"engine {client.name}",
        trace,
        **{"trae.model": client.name, "trae.request_id": request.request_id},
    )


def _is_large(request: Any) -> bool:
    """A prompt or chat of at least LARGE_PIECE_BYTES characters."""
    if isinstance(request.prompt, str):
        return len(request.prompt) >= LARGE_PIECE_BYTES
    texts = request.messages or ()
    return sum(len(str(m.get("content", ""))) for m in texts) >= LARGE_PIECE_BYTES


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = argv[2].upper() if len(argv) > 2 else "INFO"
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    conn = Connection(int(argv[1]))
    listen = argv[3] if len(argv) > 3 and argv[3] != "-" else None
    tracing.configure_from_env(service_name=tracing.ENGINE_SERVICE)
    asyncio.run(EngineServer(conn, listen).serve())
    tracing.shutdown()  # the spans still batched go out
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # engine threads are stopped; do not wait on anything else


if __name__ == "__main__":
    sys.exit(main(sys.argv))
