"""Connection deadlines uvicorn does not have, so slow clients cannot hold the server.

uvicorn closes a connection that idles between requests (keep-alive timeout), but a
client that opens a connection and sends nothing, or sends a request's headers or
body a byte at a time, holds its socket (and a slot of the connection cap) for as
long as it likes. The HTTP protocol here is uvicorn's own (httptools, or h11 without
it) with three bounds added:

- the headers of a request must arrive within ``header_timeout_s`` of its start (the
  connection, or the request's first byte on a kept-alive connection), and may not
  exceed ``MAX_HEADER_BYTES``;
- its body must arrive within ``body_timeout_s`` of its headers.

Past a deadline the server answers 408 (431 for oversized headers) with the usual
JSON error body, unless the app already started answering, and closes the connection;
the app sees a disconnect, so the request's work is cancelled as for any client that
leaves. ``ServerConfig`` holds the settings; ``protocol_class`` builds the class that
``uvicorn.Config(http=...)`` takes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from trae_groups.serving.http_errors import HTTPError, error_body
from trae_groups.serving.http_io import dumps

MAX_HEADER_BYTES = 64 << 10

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


def _answer(status: int, message: str) -> bytes:
    body = dumps(error_body(HTTPError(status, message))).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def protocol_class(header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the deadlines of the module doc."""

    class DeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._header_bytes = 0
            self._arm(header_timeout_s, None, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            # waiting for a request's headers: not while the body of one already answered
            # still arrives (a 413 goes out before the body it refuses is all in)
            waiting = before is None or (before.response_complete and not before.more_body)
            super().data_received(data)
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not before:  # a request's headers are complete
                self._header_bytes = 0
                if cycle.more_body:
                    self._arm(body_timeout_s, cycle, "body")
                else:
                    self._disarm()
            elif waiting:
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    message = f"the request's headers exceed {MAX_HEADER_BYTES} bytes"
                    self._refuse(431, message)
                elif self._deadline is None:
                    self._arm(header_timeout_s, cycle, "headers")

        def _arm(self, seconds: float, cycle: Any, part: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, cycle, part, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, cycle: Any, part: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.cycle is not cycle:
                return  # the awaited part came (a new request is under way)
            if part == "headers" and (cycle is None or cycle.response_complete):
                self._refuse(408, f"the request's headers did not arrive within {seconds:g} s")
            elif part == "body" and cycle.more_body:
                if cycle.response_started:  # the app answered already: just hang up
                    self.transport.close()
                else:
                    self._refuse(408, f"the request's body did not arrive within {seconds:g} s")

        def _refuse(self, status: int, message: str) -> None:
            self.logger.info("closing a connection from %s: %s", self.client, message)
            self.transport.write(_answer(status, message))
            self.transport.close()

    return DeadlineProtocol
