"""How Ray Serve scales and routes engine replicas.

Scaling (the seeds' HPA): each engine group follows its *pending work* — running and
waiting sequences plus queued encoder items, which the engines report through
``record_autoscaling_stats`` — and its replicas' busy share: enough replicas that
each holds about ``target_ongoing_requests`` pending items (``deploy.groups.*.
autoscaling.target_pending``) and is busy no more than ``target_utilization`` of the
time. Serve applies min/max and the up/down delays around it.

Routing: requests that carry a session (``X-Session-ID``, or OpenAI's ``user``) go to
the same replica while the replica set is unchanged (rendezvous hashing), so that
replica's prefix cache keeps hitting; without a session, Serve's power of two
choices. If that replica is full, the others are tried next.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter


class PendingWorkPolicy:
    """Serve custom autoscaling policy (``policy_function`` names this class)."""

    def __init__(self, target_utilization: float = 0.75):
        self.target_utilization = target_utilization

    def __call__(self, ctx: Any) -> tuple[float, dict]:
        metrics = ctx.aggregated_metrics
        metrics = metrics() if callable(metrics) else (metrics or {})
        current = ctx.current_num_replicas
        pending = metrics.get("pending", {})
        if not pending:  # nothing reported yet: stay
            return ctx.target_num_replicas, {}
        target = ctx.config.get_target_ongoing_requests()
        by_pending = sum(pending.values()) / target
        busy = list(metrics.get("utilization", {}).values())
        by_busy = current * (sum(busy) / len(busy)) / self.target_utilization if busy else 0.0
        return max(by_pending, by_busy), {}


def _score(session: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest()


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Power of two choices, except that a session keeps to one replica."""

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None):
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if not session or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        ranked = sorted(
            candidate_replicas,
            key=lambda r: _score(session, r.replica_id.unique_id),
            reverse=True,
        )
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
