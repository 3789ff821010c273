"""Build, deploy and describe the Ray Serve application of some graph files.

``build(graph_paths, ...)`` gives the Serve application: per graph and engine group
one ``EngineGroup`` deployment (named ``<graph>-<group>``), and one ``Ingress``.
``serve_config(...)`` writes the equivalent Serve config for ``serve deploy``
(whose ``import_path`` is ``app_builder`` below). ``run(...)`` is what
``trae serve --ray`` does: connect to (or start) a cluster, deploy, wait for SIGTERM.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from trae_groups.cluster.engine_group import CHUNK_INTERVAL_S, EngineGroup
from trae_groups.cluster.ingress import GraphSource, Ingress
from trae_groups.engine.config import EngineConfig
from trae_groups.graphs.deploy import GroupSpec
from trae_groups.graphs.functions import ENV_VAR as ALLOWED_ENV
from trae_groups.graphs.loader import load_graph
from trae_groups.graphs.spec import GraphSpec
from trae_groups.serving.app_state import ServerConfig

log = logging.getLogger("trae_groups.cluster")

APP_NAME = "trae"
POLICY = "trae_groups.cluster.policy:PendingWorkPolicy"
ROUTER = "trae_groups.cluster.policy:SessionAffinityRouter"


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    """Knobs of a deployment that are not the graph's (tests shorten the delays)."""

    app: str = APP_NAME
    chunk_interval_s: float = CHUNK_INTERVAL_S
    graceful_shutdown_timeout_s: float = 5.0
    graceful_shutdown_wait_loop_s: float = 0.5
    health_check_period_s: float = 2.0
    autoscaling_look_back_s: float | None = None  # None: Serve's default


def graph_source(path: str | Path) -> tuple[GraphSpec, GraphSource]:
    path = Path(path).resolve()
    return load_graph(path), (path.read_text(encoding="utf-8"), str(path), str(path.parent))


def _env() -> dict[str, Any]:
    """What replicas must see of this process's environment: the operator's allow list
    of python-node functions (graphs/functions.py), read when a graph is checked, and the
    OTEL_* variables that turn traces on (graphs/tracing.py; ``--otlp-endpoint`` sets one)."""
    env = {name: value for name, value in os.environ.items() if name.startswith("OTEL_")}
    allowed = os.environ.get(ALLOWED_ENV)
    if allowed is not None:
        env[ALLOWED_ENV] = allowed
    return {"runtime_env": {"env_vars": env}} if env else {}


def group_options(group: GroupSpec, options: ClusterOptions) -> dict[str, Any]:
    """Serve deployment options of one engine group, from the graph's deploy section."""
    actor: dict[str, Any] = {"num_cpus": group.num_cpus, **_env()}
    if group.num_gpus:
        actor["num_gpus"] = group.num_gpus
    if group.memory:
        actor["memory"] = group.memory
    out: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": group.max_ongoing_requests,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": options.graceful_shutdown_wait_loop_s,
        "health_check_period_s": options.health_check_period_s,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER),
    }
    scaling = group.autoscaling
    if scaling is None:
        out["num_replicas"] = group.replicas or 1
        return out
    config: dict[str, Any] = {
        "min_replicas": scaling.min,
        "max_replicas": scaling.max,
        "initial_replicas": max(scaling.min, 1),
        "target_ongoing_requests": scaling.target_pending,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
        "policy": {
            "policy_function": POLICY,
            "policy_kwargs": {"target_utilization": scaling.target_utilization},
        },
    }
    if options.autoscaling_look_back_s is not None:
        config["look_back_period_s"] = options.autoscaling_look_back_s
    out["autoscaling_config"] = AutoscalingConfig(**config)
    return out


def build(
    graph_paths: Sequence[str | Path],
    engine: EngineConfig | None = None,
    server: ServerConfig | None = None,
    options: ClusterOptions = ClusterOptions(),
) -> Any:
    """The Serve application for these graph files."""
    sources = [graph_source(p) for p in graph_paths]
    handles: dict[str, dict[str, Any]] = {}
    for spec, source in sources:
        groups = sorted(set(spec.deploy.group_of(list(spec.models)).values()))
        handles[spec.name] = {
            group: serve.deployment(EngineGroup)
            .options(
                name=f"{spec.name}-{group}", **group_options(spec.deploy.group(group), options)
            )
            .bind(source, group, engine, options.app, options.chunk_interval_s)
            for group in groups
        }
    ingress = sources[0][0].deploy.ingress
    server = server or ServerConfig()
    # our own admission (max_inflight per graph, then 429) is the limit; Serve's default
    # of 5 calls per replica would queue requests in the proxy behind it, with backoff
    limit = sum(server.limit_for(spec.name) for spec, _ in sources) + 16
    front = serve.deployment(Ingress).options(
        name="ingress",
        num_replicas=ingress.replicas,
        max_ongoing_requests=limit,
        ray_actor_options={"num_cpus": ingress.num_cpus, **_env()},
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=options.graceful_shutdown_wait_loop_s,
    )
    return front.bind([s for _, s in sources], handles, server, options.app)


def app_builder(args: dict[str, Any]) -> Any:
    """The Serve config's ``import_path`` target: ``args: {graphs: [path, ...]}``,
    optionally ``engine:`` (EngineConfig fields) and ``server:`` (ServerConfig fields)."""
    engine = EngineConfig(**args["engine"]) if args.get("engine") else None
    server = ServerConfig(**args["server"]) if args.get("server") else None
    return build(args["graphs"], engine, server)


def serve_config(graph_paths: Sequence[str | Path], host: str, port: int) -> dict[str, Any]:
    """A Serve config (``serve deploy``) equivalent to ``trae serve --ray``; its
    ``deployments`` list shows each one's replicas and resources, to override there."""
    deployments = []
    for path in graph_paths:
        spec = load_graph(path)
        for group in sorted(set(spec.deploy.group_of(list(spec.models)).values())):
            g = spec.deploy.group(group)
            entry: dict[str, Any] = {
                "name": f"{spec.name}-{group}",
                "ray_actor_options": {"num_cpus": g.num_cpus, "num_gpus": g.num_gpus},
            }
            if g.autoscaling is None:
                entry["num_replicas"] = g.replicas or 1
            deployments.append(entry)
    return {
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": "trae_groups.cluster.app:app_builder",
                "args": {"graphs": [str(Path(p).resolve()) for p in graph_paths]},
                "deployments": deployments,
            }
        ],
    }


def run(
    graph_paths: Sequence[str | Path],
    *,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine: EngineConfig | None = None,
    server: ServerConfig | None = None,
    num_cpus: float | None = None,
) -> int:
    """``trae serve --ray [ADDRESS]``: deploy and serve until SIGTERM/SIGINT."""
    import ray

    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(graph_paths, engine, server), name=APP_NAME, route_prefix="/")
    log.info("serving on Ray at http://%s:%d", host, port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(APP_NAME)
    serve.shutdown()
    return 0
