"""trae-groups: serve composite model apps (a DAG of models) behind one endpoint."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Loaded on first use, so `import trae_groups` (and the CLI) start fast.
_EXPORTS = {
    "ModelGroup": "trae_groups.dsl",
    "LocalGraph": "trae_groups.local",
    "load": "trae_groups.local",
    "run": "trae_groups.local",
    "arun": "trae_groups.local",
    "load_graph": "trae_groups.graphs.loader",
    "load_graph_text": "trae_groups.graphs.loader",
    "GraphSpec": "trae_groups.graphs.spec",
    "LLMEngine": "trae_groups.engine",
    "EngineConfig": "trae_groups.engine",
    "SamplingParams": "trae_groups.engine",
    "create_app": "trae_groups.serving.server",
    "serve": "trae_groups.serving.server",
    "ServerConfig": "trae_groups.serving.server",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trae_groups' has no attribute {name!r}")
