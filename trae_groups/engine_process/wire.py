"""The channel between the front and its engine process: one socket pair, framed
pickled messages, a writer thread and a reader thread on each side.

Both processes are ours and run the same code, so pickle (protocol 5) is the codec:
the engine protocol's frozen dataclasses and its exceptions cross as themselves.
A writer thread drains its queue into one frame per wake-up, so messages produced
together (one engine step's chunks, a burst of requests) cost one system call and
one unpickle; nobody on an event loop ever blocks on a full socket. The reader hands
each frame's messages, in order, to ``on_messages``; a closed peer (it exited or
was killed) calls ``on_closed`` once.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import pickle
import queue
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from trae_groups.engine.protocol import GenerationChunk

log = logging.getLogger("trae_groups.engine_process")

_STOP = object()
#: What an "out" entry (sid, kind, payload) carries: a generation's chunk (its fields),
#: an encoder's result, or the exception that ended the call.
CHUNK, RESULT, ERROR = 0, 1, 2


class Channel:
    """One end of the socket pair."""

    def __init__(
        self,
        conn: Connection,
        on_messages: Callable[[list[Any]], None],
        on_closed: Callable[[str], None],
        name: str,
    ):
        self._conn = conn
        self._on_messages = on_messages
        self._on_closed = on_closed
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._writer = threading.Thread(target=self._write, name=f"{name}-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)

    def start(self) -> Channel:
        self._writer.start()
        self._reader.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, message: Any) -> None:
        """Queue one message (any thread; never blocks)."""
        self._out.put(message)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop writing (what is queued goes first, for up to ``wait_s``) and shut the
        socket down."""
        self._out.put(_STOP)
        if wait_s and threading.current_thread() is not self._writer:
            self._writer.join(wait_s)

    def _write(self) -> None:
        try:
            while True:
                batch = [self._out.get()]
                while True:
                    try:
                        batch.append(self._out.get_nowait())
                    except queue.Empty:
                        break
                stop = any(m is _STOP for m in batch)
                batch = [m for m in batch if m is not _STOP]
                if batch:
                    self._conn.send_bytes(pickle.dumps(batch, protocol=5))
                if stop:
                    break
        except (OSError, EOFError, ValueError):
            pass  # the peer is gone: the reader reports it
        finally:
            self._shut()

    def _read(self) -> None:
        reason = "the peer closed the channel"
        try:
            while True:
                data = self._conn.recv_bytes()
                self._on_messages(pickle.loads(data))
        except (EOFError, OSError, ValueError) as exc:
            if not isinstance(exc, EOFError):
                reason = f"the channel failed: {exc}"
        except Exception:
            log.exception("reading the channel failed")
            reason = "a message could not be read"
        finally:
            self._shut()
            self._on_closed(reason)

    def _shut(self) -> None:
        """Once: shut the socket down, which wakes this end's other thread (a blocked
        read returns EOF) and tells the peer."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            sock = socket.socket(fileno=self._conn.fileno())
        except OSError:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()  # the Connection owns the descriptor


def pack_error(exc: BaseException) -> BaseException:
    """The exception as it can cross: itself when it pickles (RequestError keeps its
    field), else an EngineError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=5))
        return exc
    except Exception:
        from trae_groups.engine.errors import EngineError

        return EngineError(f"{type(exc).__name__}: {exc}")


def chunk_fields(chunk: Any) -> tuple:
    """A GenerationChunk as a plain tuple (``GenerationChunk(*fields)`` makes it back):
    cheaper to pickle than the dataclass, and the chunks of a step are many."""
    return _CHUNK_FIELDS(chunk)


#: Every field of GenerationChunk, in order: a field added there crosses too.
_CHUNK_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(GenerationChunk)))
