"""The one place that maps errors to HTTP statuses and the error body.

Every error response, on every route, has the body
``{"error": {"type", "message", "node"?, "field"?}}`` (OpenAI routes add ``param``
and ``code`` so stock clients read it too). Handlers raise; they never pick a
status themselves.

| status | when |
|---|---|
| 400 | the body is not JSON, not an object, or an envelope field has the wrong type |
| 401 | admin route without the right bearer token |
| 404 | unknown graph, model or route; admin routes when no token is configured |
| 405 | method not allowed |
| 408 | a request's headers or body did not arrive in time (http_protocol) |
| 409 | reload of a graph that was not loaded from a file |
| 413 | body larger than ``max_body_bytes`` |
| 422 | inputs or sampling parameters invalid (``field`` names which); a node's engine
        refused what the request made it render (``node`` and ``field``); a graph
        reload that does not validate (``issues``); a version split that cannot apply |
| 429 | the graph already has ``max_inflight`` requests, or ``max_large_bodies`` large
        bodies are being read (``Retry-After``) |
| 431 | a request's headers are larger than 64 KiB (http_protocol) |
| 500 | a node failed (``node``), or a server bug (no details leak) |
| 503 | models still loading, an on-demand model not resident in time, or the server is
        shutting down (``Retry-After``); a request that cannot make its deadline
        (``DeadlineUnreachable``: ``reason``, ``Retry-After``) |
| 504 | the graph's or a node's timeout ran out (``node`` when a node's), or the
        request's deadline passed and its work was dropped |
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from trae_groups.engine.errors import (
    DeadlineExceeded,
    EngineStopped,
    ModelLoadError,
    ModelUnavailable,
    RequestError,
)
from trae_groups.graphs.errors import GraphError, GraphTimeout, GraphValidationError, NodeError
from trae_groups.graphs.executor import InputError
from trae_groups.graphs.routing import RouteError
from trae_groups.serving.admission import Refusal

log = logging.getLogger("trae_groups.server")  # unchanged by the move to serving/

_PHRASES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    409: "Conflict",
    413: "PayloadTooLarge",
    415: "UnsupportedMediaType",
    422: "UnprocessableEntity",
    429: "QueueFull",
    431: "HeadersTooLarge",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class HTTPError(Exception):
    """An error the HTTP layer itself decides (bad body, unknown graph, full queue...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.type = type or _PHRASES.get(status, "Error")
        self.message = message
        self.field = field
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})


def bad_request(message: str, field: str | None = None) -> HTTPError:
    return HTTPError(400, message, field=field)


def not_found(message: str, field: str | None = None) -> HTTPError:
    return HTTPError(404, message, field=field)


def too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the request body is larger than {limit} bytes")


def queue_full(graph: str, limit: int, retry_after: int) -> HTTPError:
    return HTTPError(
        429,
        f"graph '{graph}' already has {limit} requests in flight; retry later",
        headers={"Retry-After": str(retry_after)},
    )


def overloaded_error(graph: str, limit_s: float, retry_after: int) -> HTTPError:
    return HTTPError(
        429,
        f"graph '{graph}' is overloaded: the requests in flight would keep a new one "
        f"waiting past its {limit_s:g} s limit; retry later",
        type="Overloaded",
        headers={"Retry-After": str(retry_after)},
    )


def deadline_unreachable(graph: str, refusal: Refusal) -> HTTPError:
    return HTTPError(
        503,
        f"graph '{graph}' cannot answer this request within its deadline: {refusal.reason}",
        type="DeadlineUnreachable",
        headers={"Retry-After": str(refusal.retry_after)},
        extra={"reason": refusal.reason, "estimate_s": round(refusal.estimate, 3),
               "deadline_in_s": round(refusal.left, 3)},
    )  # fmt: skip


def unavailable(message: str, retry_after: int, type: str = "ServiceUnavailable") -> HTTPError:
    return HTTPError(503, message, type=type, headers={"Retry-After": str(retry_after)})


def is_openai_path(path: str) -> bool:
    """Routes whose errors take OpenAI's shape (``param``, ``code``)."""
    if path in ("/tokenize", "/detokenize"):
        return True
    return path.startswith("/v1/") and not path.startswith("/v1/graphs")


def status_of(exc: BaseException) -> int:
    """The HTTP status for an error (first matching rule of the table above)."""
    if isinstance(exc, HTTPError):
        return exc.status
    if isinstance(exc, HTTPException):
        return exc.status_code
    if isinstance(exc, ClientDisconnect):
        return 499  # nobody reads it; metrics and logs say the client left
    if isinstance(exc, InputError | RequestError | GraphValidationError | ModelLoadError):
        return 422
    if isinstance(exc, RouteError):
        return 422
    if isinstance(exc, GraphTimeout | DeadlineExceeded):
        return 504
    if isinstance(exc, NodeError):
        if isinstance(exc.cause, RequestError):
            return 422  # the request made the node render something its model refuses
        if isinstance(exc.cause, EngineStopped | ModelUnavailable):
            return 503
        return 500
    if isinstance(exc, EngineStopped | ModelUnavailable):
        return 503
    return 500


#: Errors whose class name and message are safe to show as they are.
_NAMED = (
    GraphError, RequestError, EngineStopped, ModelLoadError, ModelUnavailable, RouteError,
    DeadlineExceeded,
)  # fmt: skip


def error_body(exc: BaseException, *, openai: bool = False) -> dict:
    """``{"error": {...}}`` for any error; server bugs keep their details in the log."""
    status = status_of(exc)
    error: dict[str, Any]
    if isinstance(exc, HTTPError):
        error = {"type": exc.type, "message": exc.message, **exc.extra}
        field = exc.field
    elif isinstance(exc, HTTPException):
        error = {"type": _PHRASES.get(status, "Error"), "message": str(exc.detail)}
        field = None
    elif isinstance(exc, ClientDisconnect):
        error = {"type": "ClientGone", "message": "the client left before sending its body"}
        field = None
    elif isinstance(exc, _NAMED):
        error = {"type": type(exc).__name__, "message": str(exc)}
        field = _field_of(exc)
    else:
        error = {"type": "InternalError", "message": "internal server error"}
        field = None
    node = getattr(exc, "node", None)
    if node:
        error["node"] = node
    if field:
        error["field"] = field
    if isinstance(exc, GraphValidationError):
        error["issues"] = [
            {"file": i.file, "line": i.line, "node": i.node, "message": i.message}
            for i in exc.issues
        ]
    if openai:
        error.setdefault("param", field)
        error.setdefault("code", error["type"])
    return {"error": error}


def _field_of(exc: BaseException) -> str | None:
    if isinstance(exc, InputError):
        return exc.field if exc.field == "outputs" else f"inputs.{exc.field}"
    if isinstance(exc, RequestError):
        return exc.field
    if isinstance(exc, NodeError) and isinstance(exc.cause, RequestError):
        return exc.cause.field
    if isinstance(exc, ModelLoadError):
        return exc.field or "models"
    if isinstance(exc, RouteError):
        return "split"
    return None


def error_response(exc: BaseException, *, openai: bool = False) -> JSONResponse:
    """The response for an error; logs server-side failures with their traceback."""
    status = status_of(exc)
    if status == 500 and not isinstance(exc, NodeError | HTTPError):
        log.error("unhandled error", exc_info=exc)
    headers = dict(getattr(exc, "headers", None) or {})
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    unavailable = getattr(exc, "cause", exc)
    if isinstance(unavailable, ModelUnavailable):  # about as long as its last load took
        headers.setdefault("Retry-After", str(unavailable.retry_after))
    if status == 503:  # not ready, draining, or an engine replica lost: try again soon
        headers.setdefault("Retry-After", "1")
    return JSONResponse(error_body(exc, openai=openai), status_code=status, headers=headers)
