"""Where engine replicas post their stats, so the ingress can read every replica.

A Serve handle reaches one replica per call, never all of them; so each replica
posts its ``EngineStats`` (and pid) to one small named actor every second, and the
ingress reads the board for ``/metrics`` (a ``replica`` label per series). A replica
that stops posting drops off after ``STALE_S``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

NAMESPACE = "trae"
POST_EVERY_S = 1.0
STALE_S = 5.0


@ray.remote(num_cpus=0)
class StatsBoard:
    """replica id -> (posted at, group, pid, EngineStats)."""

    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, str, int, Any]] = {}

    def post(self, replica: str, group: str, pid: int, stats: Any) -> None:
        self._posts[replica] = (time.monotonic(), group, pid, stats)

    def read(self, max_age_s: float = STALE_S) -> dict[str, tuple[str, int, Any]]:
        now = time.monotonic()
        for replica, (at, *_rest) in list(self._posts.items()):
            if now - at > max_age_s:
                del self._posts[replica]
        return {r: (group, pid, stats) for r, (_at, group, pid, stats) in self._posts.items()}


def board(app: str) -> Any:
    """The board of one Serve application (created by whoever asks first)."""
    return StatsBoard.options(
        name=f"stats-{app}", namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class Poster:
    """A daemon thread that posts ``stats()`` to the board every POST_EVERY_S."""

    def __init__(self, app: str, replica: str, group: str, stats: Callable[[], Any]):
        self._board = board(app)
        self._args = (replica, group, os.getpid())
        self._stats = stats
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="trae-stats-poster", daemon=True).start()

    def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the board is being replaced: next time
                self._board.post.remote(*self._args, self._stats())
            if self._stop.wait(POST_EVERY_S):
                return

    def stop(self) -> None:
        self._stop.set()
