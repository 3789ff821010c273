"""The ingress deployment: our Starlette app, with the models on engine groups.

``RemoteRuntime`` is what the app's state holds instead of a ModelRuntime: binding a
graph asks each of its engine groups which models it holds and makes one
``RemoteClient`` per (model, version); everything else (routes, validation,
templates, python nodes, admission, SSE, the OpenAI routes, metrics) is the same
code as in one process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray import serve

from trae_groups.cluster.board import board
from trae_groups.cluster.remote import RemoteClient, summed
from trae_groups.engine.errors import ModelLoadError
from trae_groups.engine.protocol import EngineStats, ModelStats
from trae_groups.graphs.compile import CompiledGraph, compile_graph, resolve_functions
from trae_groups.graphs.executor import GraphExecutor
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.routing import RouteError, VersionedModel, check_split
from trae_groups.graphs.spec import GraphSpec
from trae_groups.serving.app_state import ServerConfig
from trae_groups.serving.server import create_app

if TYPE_CHECKING:
    from trae_groups.graphs.runtime import Runtime

log = logging.getLogger("trae_groups.cluster")
#: How long a read of the stats board may take before the last posts stand in.
BOARD_TIMEOUT_S = 5.0

#: A graph as it travels to replicas: (YAML text, file name, folder relative sources count from).
GraphSource = tuple[str, str, str | None]


class RemoteRuntime:
    """The engine groups of the served graphs, as the app's runtime."""

    def __init__(self, handles: dict[str, dict[str, Any]], app: str):
        self.handles = handles  # graph -> group -> DeploymentHandle
        self.app = app
        self.graphs: dict[str, GraphExecutor] = {}
        self._board = board(app)
        self._last_posts: dict = {}

    def start(self) -> None:
        pass  # the replicas started their own engines

    def shutdown(self) -> None:
        pass  # Serve stops the replicas

    def bind(self, spec: GraphSpec | CompiledGraph) -> GraphExecutor:
        graph = spec if isinstance(spec, CompiledGraph) else compile_graph(spec)
        spec = graph.spec
        functions = resolve_functions(spec)
        groups = self.handles.get(spec.name, {})
        clients: dict[tuple[str, str], RemoteClient] = {}
        for handle in groups.values():
            for key, (name, task) in handle.describe.remote().result().items():
                clients[tuple(key)] = RemoteClient(
                    handle, tuple(key), name, task, lambda n=name: self._model_stats(n)
                )
        missing = [
            f"{m}@{v}" for m, model in spec.models.items() for v in model.sources
            if (m, v) not in clients
        ]  # fmt: skip
        if missing:
            raise ModelLoadError(
                spec.name,
                f"no engine group holds {', '.join(missing)}: on Ray, models are loaded "
                "when the application is deployed; redeploy to change them",
            )
        models = {
            name: VersionedModel(
                name, {v: clients[(name, v)] for v in model.sources}, model.weights, model.sticky
            )
            for name, model in spec.models.items()
        }
        executor = GraphExecutor(graph, models, functions)
        self.graphs[spec.name] = executor
        return executor

    def release(self, executor: GraphExecutor) -> None:
        pass  # the replicas keep their models until the application is redeployed

    def unavailable(self) -> str | None:
        return None  # a lost replica fails its own calls (ReplicaLost); Serve replaces it

    # -- versions: routing lives here, loading on the replicas ----------------------
    def set_route(self, graph: str, model: str, weights: dict[str, float]) -> dict[str, float]:
        versioned = self.graphs[graph].models[model]
        versioned.router.set_weights(check_split(weights, list(versioned.clients)))
        return versioned.router.weights

    def add_version(self, *args: Any) -> None:
        raise RouteError("on Ray, versions are loaded by deploying: add it to the graph file")

    def remove_version(self, *args: Any) -> None:
        raise RouteError("on Ray, versions are unloaded by deploying: remove it from the file")

    # -- stats ---------------------------------------------------------------------
    def _posts(self) -> dict:
        """The stats board's posts; the last ones read when the board is slow to answer
        (a busy cluster), so a metrics scrape or a log line never fails a request."""
        import ray

        try:
            self._last_posts = ray.get(self._board.read.remote(), timeout=BOARD_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            log.warning("the stats board did not answer in %s s: stats are stale", BOARD_TIMEOUT_S)
        return self._last_posts

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each live engine replica's stats, from the stats board."""
        return {replica: stats for replica, (_g, _pid, stats) in self._posts().items()}

    def replica_pids(self) -> dict[str, tuple[str, int]]:
        return {replica: (group, pid) for replica, (group, pid, _s) in self._posts().items()}

    def stats(self) -> EngineStats | None:
        return summed(list(self.replica_stats().values()))

    def _model_stats(self, name: str) -> ModelStats:
        total = self.stats()
        return total.models[name] if total and name in total.models else ModelStats(name, "llm")


@serve.ingress()
class Ingress:
    """The HTTP front on Ray (made a Serve deployment in cluster/app.py)."""

    def __init__(
        self,
        graphs: list[GraphSource],
        handles: dict[str, dict[str, Any]],
        server: ServerConfig,
        app: str = "trae",
    ):
        self.specs = [
            load_graph_text(text, name, Path(base) if base else None) for text, name, base in graphs
        ]
        self.server = server
        self.runtime: Runtime = RemoteRuntime(handles, app)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.specs, self.server, runtime=lambda specs, engine: self.runtime)
