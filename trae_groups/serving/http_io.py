"""HTTP plumbing the routes share: bounded JSON bodies, the deadline header,
cancel-on-disconnect, and Server-Sent Events.

A request whose client goes away must stop costing anything: ``until_disconnect``
and ``EventStream`` watch the connection while the work runs and cancel it the
moment the client leaves (the executor then aborts its engine work).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from trae_groups.engine.memory import TrimSoon
from trae_groups.serving.http_errors import (
    HTTPError,
    bad_request,
    error_body,
    is_openai_path,
    too_large,
)

T = TypeVar("T")


#: An absolute deadline for the request: Unix time in seconds (``1764505800.25``); the
#: tightest of it, the body's ``timeout`` and the graph's ``timeout`` is the deadline.
DEADLINE_HEADER = "x-request-deadline"


def header_deadline(request: Request) -> float | None:
    """The ``X-Request-Deadline`` header's epoch seconds (400 naming it when malformed)."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise bad_request(
            f"X-Request-Deadline: must be Unix time in seconds, e.g. 1764505800.25, not {raw!r}",
            "X-Request-Deadline",
        )
    return value


class LargeBodies:
    """Bodies of at least ``threshold`` bytes: parsed on a worker thread so that the event
    loop keeps answering (``/health`` included) while megabytes are decoded, at most
    ``limit`` of them in flight (429 past it, ``Retry-After``), and the heap trimmed once
    a burst of them is over. Counted on the event loop only: no lock."""

    def __init__(self, threshold: int, limit: int, retry_after: int):
        self.threshold = threshold
        self.limit = limit
        self.retry_after = retry_after
        self.in_flight = 0
        self.refused = 0
        self.trim = TrimSoon()
        self._parser: anyio.CapacityLimiter | None = None

    @property
    def parser(self) -> anyio.CapacityLimiter:
        """One parsing thread for all of them: decoding JSON holds the GIL throughout, so
        parallel parses gain nothing and each one more is a wait more for the event loop
        (``/health`` waited up to ~190 ms behind eight at once). Made on first use, on the
        event loop (an anyio limiter needs its backend)."""
        if self._parser is None:
            self._parser = anyio.CapacityLimiter(1)
        return self._parser

    def admit(self) -> None:
        if self.in_flight >= self.limit:
            self.refused += 1
            raise HTTPError(
                429,
                f"{self.limit} request bodies of {self.threshold} bytes or more are already "
                "being read; retry later",
                type="TooManyLargeBodies",
                headers={"Retry-After": str(self.retry_after)},
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self.trim.request()


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past ``limit`` bytes (declared or streamed), 400 if not JSON.
    A large body (``LargeBodies``) is admitted against the server's limit and parsed off the
    event loop."""
    large: LargeBodies | None = getattr(
        getattr(request.app.state, "trae", None), "large_bodies", None
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("Content-Length is not a number")
        if int(declared) > limit:
            raise too_large(limit)
    admitted = False
    try:
        if large is not None and declared is not None and int(declared) >= large.threshold:
            large.admit()
            admitted = True
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            if large is not None and not admitted and size >= large.threshold:
                large.admit()  # no Content-Length: large once it has grown so
                admitted = True
            chunks.append(chunk)
        body = b"".join(chunks)
        del chunks
        if admitted:
            return await anyio.to_thread.run_sync(_parse_json, body, limiter=large.parser)
        return _parse_json(body)
    finally:
        if admitted:
            large.release()


def _parse_json(body: bytes) -> Any:
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8-sig")  # strict: JSON on the wire is UTF-8 (RFC 8259)
    except UnicodeDecodeError:
        raise bad_request("the body is not UTF-8 text") from None
    try:
        data = json.loads(text)
        if "\\u" in text:  # only an escape can smuggle in a lone surrogate ("\\ud800")
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the body holds text that is not valid Unicode") from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    return data


class GraceOver(HTTPError):
    """The server's shutdown grace ran out while this request was running."""


_grace: contextvars.ContextVar[tuple[asyncio.Event, int] | None] = contextvars.ContextVar(
    "trae_grace", default=None
)


def end_with_grace(grace_over: asyncio.Event, retry_after: int) -> None:
    """For the current request (task): when ``grace_over`` is set, its work is cancelled
    and it answers 503 (``until_disconnect`` raises ``GraceOver``; an event stream
    ends with an error event). The server calls this as each request starts."""
    _grace.set((grace_over, retry_after))


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
    """Run ``work()``; if the client disconnects first, cancel it. Returns (result, gone).
    If the server's shutdown grace runs out first (``end_with_grace``), cancel it and
    raise ``GraceOver``. The work runs in the calling task, not a new one: under load
    every extra task start waits a whole turn of a busy event loop."""
    outcome: dict[str, Any] = {"gone": False}
    grace = _grace.get()

    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            outcome["gone"] = True
            group.cancel_scope.cancel()

        async def watch_grace(grace_over: asyncio.Event) -> None:
            await grace_over.wait()
            outcome["grace_over"] = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        if grace is not None:
            group.start_soon(watch_grace, grace[0])
        try:
            outcome["result"] = await work()
        except Exception as exc:
            outcome["error"] = exc
        group.cancel_scope.cancel()
    if outcome.get("grace_over") and not outcome["gone"] and "result" not in outcome:
        raise GraceOver(
            503,
            "the server shut down before this request finished",
            type="ShuttingDown",
            headers={"Retry-After": str(grace[1])},
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result"), outcome["gone"]


Emit = Callable[[str], Awaitable[None]]


class EventStream(Response):
    """Server-Sent Events written by ``produce(emit)``; the client leaving cancels it.
    ``on_close`` runs however the stream ends (it releases the admission ticket)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        produce: Callable[[Emit], Awaitable[None]],
        on_close: Callable[[], None],
        headers: Mapping[str, str] | None = None,
    ):
        self._produce = produce
        self._on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

            async def emit(text: str) -> None:
                body = text.encode("utf-8")
                await send({"type": "http.response.body", "body": body, "more_body": True})

            try:
                _, gone = await until_disconnect(receive, lambda: self._produce(emit))
            except GraceOver as exc:  # the stream ends with the error, as the route's would
                for event in _error_events(exc, openai=is_openai_path(scope["path"])):
                    await emit(event)
                gone = False
            if not gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the socket went away while writing: same as a disconnect
            pass
        finally:
            self._on_close()


def _error_events(exc: HTTPError, openai: bool) -> list[str]:
    if openai:
        return [sse(None, error_body(exc, openai=True)), sse(None, "[DONE]")]
    return [sse("error", {**error_body(exc), "status": exc.status}), sse("done", {})]


class ResultResponse(JSONResponse):
    """JSON whose values may come from user code (python nodes): see ``dumps``."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def dumps(data: Any, *, indent: int | None = None) -> str:
    """Strict JSON (RFC 8259) of values that may come from user code: sets and tuples
    become lists, other non-JSON values their ``str()``, and the floats JSON cannot
    hold (NaN, Infinity, -Infinity) become ``null``."""
    try:
        return _dumps(data, indent)
    except ValueError:  # a non-finite float somewhere (rare): rewrite, then encode
        return _dumps(_finite(data), indent)


def _dumps(data: Any, indent: int | None) -> str:
    separators = (",", ":") if indent is None else (",", ": ")
    return json.dumps(
        data,
        ensure_ascii=False,
        separators=separators,
        indent=indent,
        allow_nan=False,
        default=_plain,
    )


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_finite_key(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_finite(v) for v in value]
    return value


def _finite_key(key: Any) -> Any:
    return key if not isinstance(key, float) or math.isfinite(key) else str(key)


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def sse(event: str | None, data: Any) -> str:
    """One SSE message; ``event`` None writes a data-only message (OpenAI style)."""
    payload = data if isinstance(data, str) else dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"
