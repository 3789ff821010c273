"""Traffic between model versions: weighted random, or sticky on a request key.

A request picks one version per versioned model when it starts, and all its nodes
use that choice. Sticky routing hashes the key into [0, 100) and walks the
cumulative weights, so one user sees one version for as long as the split holds.
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
from collections.abc import Mapping

_PART = re.compile(r"^\s*([A-Za-z0-9_][A-Za-z0-9_.-]*)\s*:\s*(\d+(?:\.\d+)?)\s*%?\s*$")


class RouteError(ValueError):
    """A split that cannot be applied; nothing was changed."""


def parse_split(text: str) -> dict[str, float]:
    """'v1:90%, v2:10%' → {'v1': 90.0, 'v2': 10.0} (the CLI's syntax)."""
    if not isinstance(text, str) or not text.strip():
        raise RouteError("a split looks like 'v1:90%, v2:10%'")
    weights: dict[str, float] = {}
    for part in text.split(","):
        match = _PART.match(part)
        if not match:
            raise RouteError(f"cannot read {part.strip()!r}: use 'version:percent', e.g. 'v1:90%'")
        name, value = match.group(1), float(match.group(2))
        if name in weights:
            raise RouteError(f"version {name!r} is named twice")
        weights[name] = value
    return weights


def check_split(weights: Mapping[str, float], versions: list[str]) -> dict[str, float]:
    """Every version listed (missing ones get 0), weights in [0, 100] summing to 100."""
    unknown = sorted(set(weights) - set(versions))
    if unknown:
        raise RouteError(f"unknown version(s) {unknown}; this model has {sorted(versions)}")
    for name, value in weights.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 100:
            raise RouteError(f"weight of {name!r} must be a number in [0, 100], got {value!r}")
    total = sum(weights.values())
    if abs(total - 100) > 1e-6:
        raise RouteError(f"weights must sum to 100%, these sum to {total:g}%")
    return {v: float(weights.get(v, 0.0)) for v in versions}


class Router:
    """One versioned model's split; safe to change while requests are routed."""

    def __init__(self, model: str, weights: Mapping[str, float], seed: int | None = None):
        self.model = model
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._weights = check_split(weights, list(weights))

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    def set_weights(self, weights: Mapping[str, float], versions: list[str] | None = None) -> None:
        checked = check_split(weights, versions or list(self._weights))
        with self._lock:
            self._weights = checked

    def add_version(self, version: str) -> None:
        with self._lock:
            self._weights.setdefault(version, 0.0)

    def remove_version(self, version: str) -> None:
        with self._lock:
            if self._weights.get(version, 0.0) > 0:
                raise RouteError(
                    f"version {version!r} still gets {self._weights[version]:g}% of traffic"
                )
            self._weights.pop(version, None)

    def choose(self, key: str | None = None) -> str:
        with self._lock:
            weights = list(self._weights.items())
            point = _bucket(self.model, key) if key is not None else self._rng.random() * 100
        upto = 0.0
        for version, weight in weights:
            upto += weight
            if point < upto:
                return version
        return next(v for v, w in reversed(weights) if w > 0)


def _bucket(model: str, key: str) -> float:
    """A stable point in [0, 100) for this key (same key, same point, every process)."""
    digest = hashlib.blake2b(f"{model}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * 100


class VersionedModel:
    """A graph model's versions (name → client) and the router that picks one per request.

    An unversioned model is the one-version case ("default" at 100%).
    """

    def __init__(
        self, name: str, clients: Mapping, weights: Mapping[str, float], sticky: str | None = None
    ):
        self.name = name
        self.clients = dict(clients)
        self.router = Router(name, weights)
        self.sticky = sticky  # an input name, e.g. "user_id"
        self.sources: dict[str, str] = {}  # version -> its folder, as served now

    @classmethod
    def single(cls, name: str, client) -> VersionedModel:
        return cls(name, {"default": client}, {"default": 100.0})

    def choose(self, inputs: Mapping) -> str:
        if len(self.clients) == 1:
            return next(iter(self.clients))
        key = inputs.get(self.sticky) if self.sticky else None
        return self.router.choose(None if key is None else str(key))

    def add(self, version: str, client, source: str | None = None) -> None:
        self.clients[version] = client
        self.router.add_version(version)
        if source is not None:
            self.sources[version] = source

    def remove(self, version: str):
        self.router.remove_version(version)  # refuses while it still gets traffic
        self.sources.pop(version, None)
        return self.clients.pop(version)


def with_weight(weights: Mapping[str, float], version: str, percent: float) -> dict[str, float]:
    """Give ``version`` this share; the others keep their proportions of the rest
    (``--version v2 --weight 100%`` completes a rollout)."""
    if version not in weights:
        raise RouteError(f"unknown version {version!r}; this model has {sorted(weights)}")
    if not 0 <= percent <= 100:
        raise RouteError(f"weight must be in [0, 100], got {percent:g}")
    others = {v: w for v, w in weights.items() if v != version}
    rest, total = 100.0 - percent, sum(others.values())
    if rest > 0 and total == 0:
        if not others:
            raise RouteError(f"{version!r} is the only version: it takes 100%")
        share = {v: rest / len(others) for v in others}  # nobody had traffic: split evenly
    else:
        share = {v: (w / total * rest if total else 0.0) for v, w in others.items()}
    return {**share, version: float(percent)}
