"""A graph's ``resources:`` section: how much memory its engine takes.

    resources:
      weight_budget: 2GiB          # weights held at once; on-demand models are evicted to fit
      load_wait_s: 30              # a request waits this long for an on-demand model, then 503
      pool_bytes: 512MiB           # the KV/working-memory pool (default: sized after loading)
      gpu_memory_reservation: 0.8  # on a GPU: the pool takes this share less what is in use

Each field is an ``EngineConfig`` field of the same name: its meaning, default and range
live there, and a value here is checked by building one (so a bad value is refused at
load time, located in the file). A ``trae serve`` flag for the same field wins; a field
set by neither keeps the engine's default. With several graphs on one process, the
first that sets a field gives it.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import BeforeValidator, model_validator

from trae_groups.engine.config import EngineConfig, parse_size
from trae_groups.graphs.types import Spec

Size = Annotated[int, BeforeValidator(parse_size)]


class ResourcesSpec(Spec):
    """Engine memory settings a graph asks for (see ``EngineConfig``)."""

    weight_budget: Size | None = None
    load_wait_s: float | None = None
    pool_bytes: Size | None = None
    gpu_memory_reservation: float | None = None

    @model_validator(mode="after")
    def _engine_accepts(self) -> ResourcesSpec:
        EngineConfig(**self.settings())  # its ValueError names the field and the range
        return self

    def settings(self) -> dict[str, Any]:
        """The fields this graph sets."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


def apply(config: EngineConfig, resources: list[ResourcesSpec]) -> EngineConfig:
    """``config`` with every field it leaves unset (None) taken from the first graph
    that sets it: a flag's value wins over a graph's."""
    changes: dict[str, Any] = {}
    for spec in resources:
        for name, value in spec.settings().items():
            if getattr(config, name) is None:
                changes.setdefault(name, value)
    return dataclasses.replace(config, **changes)
