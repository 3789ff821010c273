"""Running a graph in this process, without a server: sync or async.

``load(graph)`` loads the graph's models onto a fresh engine once and keeps them for
many runs; ``run(graph, inputs)`` is the one-shot form.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trae_groups.engine import EngineConfig
from trae_groups.graphs.executor import Event, GraphExecutor, RunResult
from trae_groups.graphs.loader import load_graph
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.graphs.spec import GraphSpec

if TYPE_CHECKING:
    pass

GraphLike = "GraphSpec | ModelGroup | str | Path"


def as_spec(graph: Any) -> GraphSpec:
    """A GraphSpec from a spec, a ModelGroup, or a YAML file path."""
    if isinstance(graph, GraphSpec):
        return graph
    if isinstance(graph, str | Path):
        return load_graph(graph)
    if hasattr(graph, "spec"):
        return graph.spec()
    raise TypeError(
        f"expected a GraphSpec, a ModelGroup or a YAML path, got {type(graph).__name__}"
    )


class LocalGraph:
    """A graph with its models loaded in this process; close() frees them."""

    def __init__(self, graph: Any, config: EngineConfig | None = None):
        self.spec = as_spec(graph)
        self.runtime = ModelRuntime.for_specs([self.spec], config)
        self.executor: GraphExecutor = self.runtime.bind(self.spec)
        self.runtime.start()

    async def arun(self, inputs: dict, **kwargs: Any) -> RunResult:
        """kwargs: outputs=[...], timeout=seconds, request_id=..."""
        return await self.executor.run(inputs, **kwargs)

    def run(self, inputs: dict, **kwargs: Any) -> RunResult:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun(inputs, **kwargs))
        raise RuntimeError("run() was called inside an event loop; use `await graph.arun(...)`")

    def stream(self, inputs: dict, **kwargs: Any) -> AsyncIterator[Event]:
        return self.executor.stream(inputs, **kwargs)

    def close(self) -> None:
        self.runtime.shutdown()

    def __enter__(self) -> LocalGraph:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load(graph: Any, config: EngineConfig | None = None) -> LocalGraph:
    return LocalGraph(graph, config)


def run(graph: Any, inputs: dict, config: EngineConfig | None = None, **kwargs: Any) -> RunResult:
    """One request, start to finish: loads the models, runs, frees them."""
    with LocalGraph(graph, config) as local:
        return local.run(inputs, **kwargs)


async def arun(
    graph: Any, inputs: dict, config: EngineConfig | None = None, **kwargs: Any
) -> RunResult:
    local = LocalGraph(graph, config)
    try:
        return await local.arun(inputs, **kwargs)
    finally:
        local.close()
