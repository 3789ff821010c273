"""The HTTP server: one Starlette app serves every graph on one engine.

``create_app(graphs, config)`` validates the graphs at once (a bad file fails here,
before any model loads) and loads the models in a background thread when the app
starts, so ``/health`` answers while ``/ready`` says 503 until they are in. A client
that goes away cancels its run, which aborts its engine work and frees its pages.
Shutting down first answers 503 to new requests, lets the ones in flight finish
within a grace period, then stops the engine. docs/serving.md is the guide.

Routes live by concern: graph_api (runs, schemas), openai_api (OpenAI-compatible),
this module (operations: health, readiness, metrics, admin), dashboard (the live graph
page and its JSON) and openapi.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trae_groups.engine.passing_threads import in_passing_thread
from trae_groups.graphs import tracing
from trae_groups.graphs.loader import load_graph
from trae_groups.graphs.routing import RouteError, check_split, parse_split, with_weight
from trae_groups.graphs.spec import GraphSpec
from trae_groups.graphs.types import slug
from trae_groups.serving import dashboard, graph_api, openai_api
from trae_groups.serving.accept import Acceptor
from trae_groups.serving.app_state import AppState, ServerConfig
from trae_groups.serving.http_errors import (
    HTTPError,
    bad_request,
    error_response,
    is_openai_path,
    not_found,
)
from trae_groups.serving.http_io import end_with_grace, read_json
from trae_groups.serving.http_protocol import protocol_class
from trae_groups.serving.metrics import CONTENT_TYPE
from trae_groups.serving.openapi import openapi_document

log = logging.getLogger("trae_groups.server")  # unchanged by the move to serving/


async def health(request: Request) -> Response:
    """200 while the process serves; 503 with the reason while its engine process is
    down (it is being restarted)."""
    state: AppState = request.app.state.trae
    down = state.engine_down()
    if down is not None:
        body = {"status": "unavailable", "reason": down, "draining": state.draining}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok", "draining": state.draining})


async def ready(request: Request) -> Response:
    state: AppState = request.app.state.trae
    state.require_ready()
    return JSONResponse({"status": "ready", "graphs": sorted(state.graphs)})


#: /metrics renders on a thread of its own: sync python nodes fill anyio's shared pool
#: (45 sleeping ones made a scrape wait 18.6 s), and a scrape must still answer.
_METRICS_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trae-metrics")


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.trae
    loop = asyncio.get_running_loop()
    data = await loop.run_in_executor(_METRICS_THREAD, state.metrics.render)
    return Response(data, media_type=CONTENT_TYPE)


def check_admin(request: Request, state: AppState) -> None:
    """404 when admin is off (no token configured); 401 without the right bearer token."""
    if state.admin_token is None:
        raise not_found("admin routes are disabled: set TRAE_ADMIN_TOKEN to enable them")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    expected = state.admin_token.encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise HTTPError(401, "admin routes need 'Authorization: Bearer <token>'")


async def reload_graph(request: Request) -> Response:
    """Re-read the graph's file; on success new requests use it, in-flight ones finish
    on the old one; on failure the old graph stays and the issues come back (422).
    A split set through the admin API (or a version uploaded or unloaded) would be
    lost to the file's: the reload is refused (409, naming the models) unless the call
    says ``?discard_live_routes=true``."""
    state: AppState = request.app.state.trae
    check_admin(request, state)
    _one_front(state, request)
    served = state.graph(request.path_params["name"])
    if served.path is None:
        raise HTTPError(409, f"graph '{served.name}' was not loaded from a file")
    state.require_ready()
    async with served.reload_lock:
        spec = await anyio.to_thread.run_sync(load_graph, served.path)  # parsing: no torch
        if spec.name != served.name:
            message = f"the file now declares graph '{spec.name}', not '{served.name}'"
            raise HTTPError(422, message, field="name", type="GraphValidationError")
        changed = _live_routes(served, spec)
        if changed and request.query_params.get("discard_live_routes") != "true":
            raise HTTPError(
                409,
                f"model(s) {', '.join(changed)} route as set live, not as the file says; "
                "write the split into the file, or reload with ?discard_live_routes=true",
                type="LiveRoutes",
            )
        executor = await in_passing_thread(state.model_work, state.runtime.bind, spec)
        served.bind(executor, release=state.retire)
        await in_passing_thread(state.model_work, state.settle_heap)
    log.info("reloaded graph '%s' from %s", served.name, served.path)
    return JSONResponse({"graph": served.name, "reloaded": True, **graph_api.summary(served)})


def _live_routes(served: Any, spec: GraphSpec) -> list[str]:
    """Models whose served versions or split differ from what ``spec`` says."""
    changed = []
    for name, versioned in served.executor.models.items():
        model = spec.models.get(name)
        if model is None:
            continue
        live = {v: w for v, w in versioned.router.weights.items()}
        if set(live) != set(model.sources) or any(
            abs(live[v] - w) > 1e-9 for v, w in model.weights.items()
        ):
            changed.append(name)
    return changed


def _one_front(state: AppState, request: Request) -> None:
    """A change made through one of several front processes would hold in that one only."""
    if request.method != "GET" and state.config.api_workers > 1:
        raise HTTPError(
            409,
            "admin changes need one HTTP front process: this server runs "
            f"{state.config.api_workers} (--api-workers), each with its own routes",
            type="SeveralFronts",
        )


def _admin_model(request: Request):
    """An admin request's state, graph, model name and versioned model: the admin token and
    readiness checked first, then 404 for a model the graph does not have."""
    state: AppState = request.app.state.trae
    check_admin(request, state)
    _one_front(state, request)
    served = state.graph(request.path_params["name"])
    state.require_ready()
    model = request.path_params["model"]
    versioned = served.executor.models.get(model)
    if versioned is None:
        raise not_found(f"graph '{served.name}' has no model '{model}'", field="model")
    return state, served, model, versioned


async def route_model(request: Request) -> Response:
    """GET: a model's split between its versions; POST ``{"split": "v1:90%,v2:10%"}``
    (or ``{"split": {"v1": 90, "v2": 10}}``): change it for requests from now on.
    A reload then refuses to drop it (see ``reload_graph``)."""
    state, served, model, versioned = _admin_model(request)
    if request.method == "POST":
        body = await read_json(request, state.config.max_body_bytes)
        split = body.get("split") if isinstance(body, dict) else None
        version = body.get("version") if isinstance(body, dict) else None
        if split is None and isinstance(version, str):  # {"version": "v2", "weight": 100}
            weight = body.get("weight")
            if isinstance(weight, str):
                weight = weight.strip().rstrip("%")
            try:
                split = with_weight(versioned.router.weights, version, float(weight))
            except (TypeError, ValueError) as exc:
                if isinstance(exc, RouteError):
                    raise
                raise bad_request(
                    "weight must be a percentage, e.g. 100 or '100%'", "weight"
                ) from None
        if isinstance(split, str):
            split = parse_split(split)
        if not isinstance(split, dict):
            raise bad_request(
                'send {"split": "v1:90%,v2:10%"}, {"split": {"v1": 90}} or {"version": "v2", "weight": 100}',
                "split",
            )
        versioned.router.set_weights(check_split(split, list(versioned.clients)))
        log.info("graph '%s' model '%s' split: %s", served.name, model, versioned.router.weights)
    return JSONResponse({"graph": served.name, "model": model, "route": versioned.router.weights})


async def model_versions(request: Request) -> Response:
    """POST ``{"version": "v3", "path": "/models/intent-v3"}``: load a version (0% of
    traffic until a route gives it some); ``{"version": "v3", "adapter": "/loras/v3"}``:
    a version that is a LoRA adapter on the model's base. DELETE ``.../versions/{version}``: unload a
    version no route uses, freeing its memory. A missing or corrupt folder is refused
    (422) and the server keeps serving."""
    state, served, model, versioned = _admin_model(request)
    async with served.reload_lock:
        if request.method == "DELETE":
            version = request.path_params["version"]
            await in_passing_thread(
                state.model_work, state.runtime.remove_version, served.name, model, version
            )
            await in_passing_thread(state.model_work, state.settle_heap)
            log.info("graph '%s' model '%s': unloaded version %s", served.name, model, version)
        else:
            body = await read_json(request, state.config.max_body_bytes)
            body = body if isinstance(body, dict) else {}
            version = body.get("version")
            adapter = "adapter" in body  # a LoRA adapter folder on the model's base
            path = body.get("adapter" if adapter else "path")
            field = "adapter" if adapter else "path"
            usage = 'send {"version": "v3", "path": "/folder"} (or "adapter": "/lora-folder")'
            if not isinstance(version, str) or not version:
                raise bad_request(usage, "version")
            if not isinstance(path, str) or not path or ("path" in body and adapter):
                raise bad_request(usage, field)
            _check_upload(version, path, field)
            await in_passing_thread(
                state.model_work,
                state.runtime.add_version,
                served.name,
                model,
                version,
                path,
                adapter,
            )
            await in_passing_thread(state.model_work, state.settle_heap)
            log.info(
                "graph '%s' model '%s': loaded version %s from %s",
                served.name,
                model,
                version,
                path,
            )
    return JSONResponse(
        {"graph": served.name, "model": model, "versions": sorted(versioned.clients),
         "route": versioned.router.weights}
    )  # fmt: skip


def _check_upload(version: str, path: str, field: str = "path") -> None:
    """A version is named as in the graph file (the same slug rule); a path is text a
    file system can take."""
    try:
        slug(version)
    except ValueError as exc:
        raise HTTPError(422, f"version: {exc}", field="version") from None
    if "\x00" in path:
        raise HTTPError(422, f"{field}: contains a NUL character", field=field)


async def openapi(request: Request) -> Response:
    state: AppState = request.app.state.trae
    return JSONResponse(openapi_document(state))


# ---------------------------------------------------------------- the app


def create_app(
    graphs: Sequence[GraphSpec | str | Path],
    config: ServerConfig | None = None,
    runtime: Callable[[list[GraphSpec], Any], Any] | None = None,
) -> Starlette:
    """The app serving ``graphs`` (specs or YAML paths). Invalid graphs raise
    GraphValidationError here; models load when the app starts, through
    ``runtime(specs, engine_config)`` (default: a ModelRuntime in this process)."""
    config = config or ServerConfig()
    loaded = [
        (g, None) if isinstance(g, GraphSpec) else (load_graph(g), Path(g).resolve())
        for g in graphs
    ]
    state = AppState(loaded, config, runtime)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        app.state.grace_over = asyncio.Event()  # set when shutdown's grace runs out
        if not tracing.enabled():
            tracing.configure_from_env()
        loading = asyncio.get_running_loop().create_task(_load(state))
        try:
            yield
        finally:
            state.draining = True
            await state.wait_idle(config.shutdown_grace_s)
            with contextlib.suppress(Exception):
                await loading
            await in_passing_thread(state.model_work, state.close)
            tracing.flush()

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/stats", dashboard.stats),
        Route("/dashboard", dashboard.dashboard),
        Route("/openapi.json", openapi),
        Route("/v1/graphs", graph_api.list_graphs),
        Route("/v1/graphs/{name}", graph_api.get_graph, methods=["GET"]),
        Route("/v1/graphs/{name}", graph_api.run_graph, methods=["POST"]),
        Route("/admin/graphs/{name}/reload", reload_graph, methods=["POST"]),
        Route("/admin/graphs/{name}/models/{model}/route", route_model, methods=["GET", "POST"]),
        Route("/admin/graphs/{name}/models/{model}/versions", model_versions, methods=["POST"]),
        Route(
            "/admin/graphs/{name}/models/{model}/versions/{version}",
            model_versions,
            methods=["DELETE"],
        ),
        *openai_api.routes(),
    ]
    app = Starlette(
        routes=[_guarded(r) for r in routes],
        exception_handlers={HTTPException: _handle, HTTPError: _handle},
        lifespan=lifespan,
    )
    app.state.trae = state
    return app


async def _load(state: AppState) -> None:
    try:
        await in_passing_thread(state.model_work, state.load)
    except Exception:
        log.exception("the server cannot serve: models did not load")
        if state.on_load_failed is not None:
            state.on_load_failed()


def _guarded(route: Route) -> Route:
    """Every error a handler raises becomes the one error body (http_errors)."""
    endpoint = route.endpoint
    openai = is_openai_path(route.path)

    async def guarded(request: Request) -> Response:
        grace_over = getattr(request.app.state, "grace_over", None)
        if grace_over is not None:  # this request's task: its work ends with the grace
            end_with_grace(grace_over, request.app.state.trae.config.retry_after_s)
        try:
            return await endpoint(request)
        except Exception as exc:
            return error_response(exc, openai=openai)

    return Route(route.path, guarded, methods=route.methods, name=route.name)


async def _handle(request: Request, exc: Exception) -> Response:
    return error_response(exc)


# ---------------------------------------------------------------- running it


_ANSWER_S = 5.0  # after the grace: time for cancelled requests to write their 503


class TraeServer(uvicorn.Server):
    """uvicorn with a draining shutdown: the first SIGTERM/SIGINT (or ``stop()``) makes
    new requests 503 and waits up to the grace period for in-flight ones; those still
    running then have their work cancelled and answer 503 (JSON, or an SSE error
    event); then the sockets close and the engine stops. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: AppState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.on_exit: Callable[[], None] | None = None  # the first signal: tell the workers
        self.acceptors: list[Acceptor] = []

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start (the lifespan: models load), then our own accepting on the
        given sockets (serving/accept.py: all waiting connections each turn)."""
        await super().startup(None if sockets is None else [])
        if sockets is not None and not self.should_exit:
            config, loop = self.config, asyncio.get_running_loop()

            def protocol() -> asyncio.Protocol:  # what uvicorn's own server would make
                return config.http_protocol_class(  # type: ignore[call-arg]
                    config=config,
                    server_state=self.server_state,
                    app_state=self.lifespan.state,
                    _loop=loop,
                )

            self.acceptors = [Acceptor(loop, s, protocol, config.backlog) for s in sockets]
        log.info(
            "HTTP: event loop %s, parser %s",
            type(self._loop).__module__.partition(".")[0],
            getattr(self.config, "http_protocol_class", type(None)).__name__,
        )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in self.acceptors:
            acceptor.close()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._stopping:
            self.should_exit = self.force_exit = True
            return
        self._stopping = True
        self.state.draining = True
        if self.on_exit is not None:
            self.on_exit()
        log.info("draining: %d request(s) in flight", self.state.inflight)
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        if not await self.state.wait_idle(self.state.config.shutdown_grace_s):
            log.warning(
                "grace period over: answering 503 to %d request(s) in flight", self.state.inflight
            )
            grace_over = getattr(self.config.app.state, "grace_over", None)
            if grace_over is not None:
                grace_over.set()  # their work is cancelled; each answers 503 (or an SSE error)
                await self.state.wait_idle(_ANSWER_S)
        self.should_exit = True

    def stop(self) -> None:
        """From any thread: drain, then exit (what SIGTERM does)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.handle_exit, signal.SIGTERM, None)
        else:
            self.should_exit = True


def _uvicorn_config(
    app: Starlette, config: ServerConfig, log_level: str | None = None
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level or config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=max(1, math.ceil(config.shutdown_grace_s)),
        lifespan="on",
        http=protocol_class(config.header_timeout_s, config.body_timeout_s),
        timeout_keep_alive=config.keep_alive_s,
        limit_concurrency=config.max_connections,
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (OSError if the address is taken), so a taken
    port fails before any model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(graphs: Sequence[GraphSpec | str | Path], config: ServerConfig | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the exit status: 1 when the port cannot be bound
    (checked before any model loads) or the models failed to load."""
    config = config or ServerConfig()
    workers = None
    if config.api_workers > 1:  # more fronts on one engine process (serving/api_workers.py)
        from trae_groups.serving.api_workers import Workers

        workers = Workers(config.api_workers, config.shutdown_grace_s)
    # validates the graphs; models load once serving
    app = create_app(graphs, config, runtime=workers.runtime if workers else None)
    try:
        sock = listen_socket(config.host, config.port)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", config.host, config.port, exc.strerror or exc)
        return 1
    state: AppState = app.state.trae
    server = TraeServer(_uvicorn_config(app, config), state)
    state.on_load_failed = server.stop
    if workers is not None:
        sock.listen(2048)  # before the workers share it
        workers.start(sock, graphs, config)
        server.on_exit = workers.signal
    try:
        server.run(sockets=[sock])
    finally:
        if workers is not None:
            workers.stop()  # no-op once the engine's shutdown did it
    return 1 if state.load_error else 0


class ServerThread:
    """A real uvicorn server on a background thread (tests, notebooks, embedding)."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.state: AppState = app.state.trae
        self._socket = listen_socket(host, port)
        self.host, self.port = self._socket.getsockname()[:2]
        config = _uvicorn_config(app, self.state.config, log_level="warning")
        self.server = TraeServer(config, self.state)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0) -> ServerThread:
        """Start, and wait until models are loaded (raises if they fail or time runs out)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.load_error or not self.thread.is_alive():
                break
            if self.state.ready and self.server.started:
                break
            time.sleep(0.02)
        if not (self.state.ready and self.server.started):
            self.stop()
            raise RuntimeError(f"server did not get ready: {self.state.load_error or 'timeout'}")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Drain and stop; returns once the server thread is gone (or timeout)."""
        self.server.stop()
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = [
    "AppState",
    "ServerConfig",
    "ServerThread",
    "TraeServer",
    "create_app",
    "serve",
]
