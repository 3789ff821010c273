"""The histogram bounds the served graphs ask for in their ``monitoring:`` sections
(graphs/monitoring.py), checked against the histograms this server exports
(``HISTOGRAM_BUCKETS``, serving/metrics.py).

An unknown name, or two served graphs that set different bounds for one metric (a family
has one set of bounds per server), is refused when the graphs load, located in the file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from trae_groups.graphs.errors import GraphValidationError, ValidationIssue
from trae_groups.graphs.spec import GraphSpec
from trae_groups.serving.metrics import HISTOGRAM_BUCKETS

__all__ = ["histogram_buckets"]


def histogram_buckets(specs: Iterable[GraphSpec]) -> dict[str, tuple[float, ...]]:
    """Histogram name -> the bounds the graphs set (names they leave keep the defaults)."""
    chosen: dict[str, tuple[tuple[float, ...], GraphSpec]] = {}
    issues: list[ValidationIssue] = []
    for spec in specs:
        for name, histogram in spec.monitoring.metrics.items():
            path = ("monitoring", "metrics", name)
            if name not in HISTOGRAM_BUCKETS:
                issues.append(_issue(spec, path, _unknown(name)))
                continue
            bounds = tuple(histogram.buckets)
            first = chosen.setdefault(name, (bounds, spec))
            if first[0] != bounds:
                message = (
                    f"monitoring.metrics.{name}.buckets: differs from graph "
                    f"'{first[1].name}''s; the server exports one set of bounds per metric"
                )
                issues.append(_issue(spec, (*path, "buckets"), message))
    if issues:
        raise GraphValidationError(issues)
    return {name: bounds for name, (bounds, _spec) in chosen.items()}


def _unknown(name: str) -> str:
    known = sorted(HISTOGRAM_BUCKETS)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"monitoring.metrics: '{name}' is not a histogram the server exports{hint}; "
        f"one of: {', '.join(known)}"
    )


def _issue(spec: GraphSpec, path: tuple, message: str) -> ValidationIssue:
    if spec.source is not None:
        return spec.source.issue(path, message)
    return ValidationIssue(f"graph '{spec.name}'", None, None, message)
