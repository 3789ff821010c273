"""Accept every waiting connection in one turn of the event loop, not one per turn.

libuv, uvloop's core, accepts one connection per turn of its loop (libuv/libuv#3696,
libuv 1.45). A turn that also reads a burst of large bodies takes a few milliseconds,
so a connection behind a queue of others waits that times the queue: under 60
concurrent 0.9 MB bodies a ``/health`` probe waited 50-240 ms to be accepted, while no
turn of the loop took over 20 ms. asyncio's own loop accepts a backlog's worth per turn
(its ``/health`` stayed under 40 ms under the same probe) but costs this server 3.5x
the latency of a request at one client, so uvloop stays and accepting is done here:
the listening socket is watched by the loop, and each time it is ready every waiting
connection (up to ``ACCEPT_PER_TURN``) is accepted and given to the loop as uvicorn's
own server would (``connect_accepted_socket`` with the same protocol).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("trae_groups.server")

#: Connections accepted in one turn at most (asyncio's own server takes its backlog).
ACCEPT_PER_TURN = 256
#: Out of file descriptors (EMFILE and its kin): stop accepting this long, then retry,
#: as asyncio does; the waiting connections stay in the kernel's queue.
RETRY_AFTER_S = 1.0
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Acceptor:
    """Accepts on one listening socket for as long as it is open."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        backlog: int,
    ):
        self.loop = loop
        self.sock = sock
        self.protocol_factory = protocol_factory
        self.accepted = 0
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        sock.listen(backlog)
        sock.setblocking(False)
        self._watch()

    def _watch(self) -> None:
        if not self._closed:
            self.loop.add_reader(self.sock.fileno(), self._ready)

    def _ready(self) -> None:
        for _ in range(ACCEPT_PER_TURN):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none left (or the client gave up before it was taken)
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                log.error("cannot accept connections (%s); retrying in %g s", exc, RETRY_AFTER_S)
                self.loop.remove_reader(self.sock.fileno())
                self.loop.call_later(RETRY_AFTER_S, self._watch)
                return
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.accepted += 1
            task = self.loop.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol_factory, conn)
        except OSError:  # the client is gone already
            conn.close()

    def close(self) -> None:
        """Stop accepting (the socket itself is closed by its owner)."""
        if not self._closed:
            self._closed = True
            self.loop.remove_reader(self.sock.fileno())
