"""The engine: memory pool, weight store, workers, scheduler, runners, sampling."""

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
