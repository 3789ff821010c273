"""One local Ray cluster for the whole test session (a plugin that tests/conftest.py
loads): starting Ray and Serve's proxy takes tens of
seconds, so the modules that deploy on it share it, each deploying its own Serve app
under its own name and deleting it when the module ends (``deployed``)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory) -> Iterator[str]:
    """A local Ray cluster (2 CPUs, no dashboard) and Serve's HTTP proxy on 127.0.0.1;
    its URL. Replicas report autoscaling stats every half second (default 10 s). What a
    module's replicas need of the environment goes with its deployment (cluster/app.py
    passes the OTEL_* variables), not with the cluster, so modules do not leak into each
    other through it."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    started = time.monotonic()
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        runtime_env={"env_vars": {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}},
    )  # fmt: skip
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print(f"ray cluster up in {time.monotonic() - started:.1f} s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def deployed(app: str) -> Iterator[None]:
    """While a module's Serve app ``app`` is up: deleted afterwards (its replicas and
    their CPUs go back), so the next module deploys on an empty cluster."""
    import ray
    from ray import serve

    from trae_groups.cluster.board import board

    try:
        yield
    finally:
        serve.delete(app)
        ray.kill(board(app))  # the app's stats board outlives it (a detached actor)
