"""A graph's ``monitoring:`` section: the bucket boundaries of the histograms it exports.

    monitoring:
      metrics:
        inference_latency: {buckets: [5, 10, 25, 50, 100, 250, 500, 1000, 5000]}   # ms
        trae_node_latency_seconds: {buckets: [0.01, 0.05, 0.1, 0.5, 1, 5, 30]}

The shape is checked here (a Prometheus name; finite, strictly increasing boundaries);
which names are histograms, and their default boundaries, is the metrics module's to say
(trae_groups/serving/metrics.py, ``HISTOGRAM_BUCKETS``), so the server checks the names
when it loads the graph, located in the file like every other error. ``+Inf`` is always
added, as Prometheus wants.
"""

from __future__ import annotations

import itertools
from typing import Annotated

from pydantic import Field, field_validator

from trae_groups.graphs.types import Spec

MetricName = Annotated[str, Field(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$", max_length=200)]


class HistogramSpec(Spec):
    """One histogram's upper bounds, in the metric's own unit (finite: the spec refuses
    infinities, and ``+Inf`` is added on its own)."""

    buckets: list[float] = Field(min_length=1, max_length=100)

    @field_validator("buckets")
    @classmethod
    def _increasing(cls, bounds: list[float]) -> list[float]:
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"bounds must increase strictly: {bounds}")
        return bounds


class MonitoringSpec(Spec):
    """What a graph sets about its metrics: histogram buckets, by metric name."""

    metrics: dict[MetricName, HistogramSpec] = Field(default_factory=dict)
