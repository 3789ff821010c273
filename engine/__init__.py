"""The engine: memory pool, weight store, workers, scheduler, runners, sampling.

Names load on first use (PEP 562): importing one light module of the package, such as
``trae_groups.engine.errors`` in a CLI command that only talks HTTP, must not pull in torch
and the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "EngineConfig": "config",
    "Priority": "deadlines",
    "LLMEngine": "engine",
    "EngineError": "errors",
    "EngineStopped": "errors",
    "ModelLoadError": "errors",
    "RequestAborted": "errors",
    "RequestError": "errors",
    "KVLayout": "memory_pool",
    "MemoryPool": "memory_pool",
    "PoolStats": "memory_pool",
    "OutputStream": "outputs",
    "SamplingParams": "sampling",
    "RequestOutput": "sequence",
    "SpeculativeConfig": "spec_config",
    "Urgency": "worker",
    "Worker": "worker",
}

if TYPE_CHECKING:
    from trae_groups.engine.config import EngineConfig
    from trae_groups.engine.deadlines import Priority
    from trae_groups.engine.engine import LLMEngine
    from trae_groups.engine.errors import (
        EngineError,
        EngineStopped,
        ModelLoadError,
        RequestAborted,
        RequestError,
    )
    from trae_groups.engine.memory_pool import KVLayout, MemoryPool, PoolStats
    from trae_groups.engine.outputs import OutputStream
    from trae_groups.engine.sampling import SamplingParams
    from trae_groups.engine.sequence import RequestOutput
    from trae_groups.engine.spec_config import SpeculativeConfig
    from trae_groups.engine.worker import Urgency, Worker


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "EngineConfig",
    "EngineError",
    "EngineStopped",
    "KVLayout",
    "LLMEngine",
    "MemoryPool",
    "ModelLoadError",
    "OutputStream",
    "PoolStats",
    "Priority",
    "RequestAborted",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "Urgency",
    "Worker",
]
