"""A graph's ``deploy:`` section: how it runs on a Ray cluster (``trae serve --ray``).

One process ignores it. On Ray, the graph's models form engine *groups*: each group
is one Serve deployment whose replica is one runtime (one engine loop, one paged
pool, one weight store) holding every model of the group. By default all models are
one group, ``engine``; a heavy model can get a group of its own, with its own
replicas and resources.

    deploy:
      ingress: {replicas: 1, num_cpus: 0.5}
      groups:
        llm: {models: [dialog], autoscaling: {min: 1, max: 4, target_pending: 8}, num_gpus: 1}

Models no group lists belong to ``engine`` (configured as ``groups.engine``, if given).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from trae_groups.graphs.types import Slug, Spec

DEFAULT_GROUP = "engine"


class Autoscaling(Spec):
    """Replicas follow their pending work (running + waiting sequences and queued
    encoder items, reported by the engines) and their busy share: each replica is
    aimed at ``target_pending`` requests and ``target_utilization`` of its time."""

    min: int = Field(1, ge=0)
    max: int = Field(4, ge=1)
    target_pending: float = Field(8.0, gt=0)
    target_utilization: float = Field(0.75, gt=0, le=1)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min > self.max:
            raise ValueError(f"autoscaling: min ({self.min}) is above max ({self.max})")
        return self


class Resources(Spec):
    """What each replica reserves on the cluster (Ray's own resource names)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory: int | None = Field(None, gt=0, description="bytes")


class GroupSpec(Resources):
    """One engine group: its models, and replicas (a fixed number, or autoscaling)."""

    models: list[str] = []
    replicas: int | None = Field(None, ge=1)
    autoscaling: Autoscaling | None = None
    max_ongoing_requests: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> GroupSpec:
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("a group takes 'replicas' or 'autoscaling', not both")
        return self


class IngressSpec(Resources):
    """The HTTP front: our Starlette app (routes, templates, python nodes, admission)."""

    replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)


class DeploySpec(Spec):
    ingress: IngressSpec = IngressSpec()
    groups: dict[Slug, GroupSpec] = {}

    def group_of(self, models: list[str]) -> dict[str, str]:
        """Model -> its group's name (a model no group lists is in ``engine``)."""
        placed = {m: name for name, group in self.groups.items() for m in group.models}
        return {m: placed.get(m, DEFAULT_GROUP) for m in models}

    def group(self, name: str) -> GroupSpec:
        return self.groups.get(name) or GroupSpec()
