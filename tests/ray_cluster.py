"""One local Ray cluster for the whole test session (a plugin that tests/conftest.py
loads): starting Ray and Serve's proxy takes tens of
seconds, so the modules that deploy on it share it, each deploying its own Serve app
under its own name and deleting it when the module ends (``deployed``). Those modules run
back to back, and the cluster stops after the last of their tests, not at the end of the
session: idle, Ray's processes still take a share of the two cores every other test needs."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

FIXTURE = "ray_cluster"
_stops: list = []  # the running cluster's shutdown, called once after its last user
# Modules with a test on the cluster: their other tests count as users too, since a module's
# fixtures on the cluster (its deployed app) are torn down only after its last test.
_modules: set[str] = set()


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _uses_cluster(item: pytest.Item | None) -> bool:
    return item is not None and _module(item) in _modules


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules on the cluster move to where the first of them was, in their order."""
    _modules.update(_module(i) for i in items if FIXTURE in getattr(i, "fixturenames", ()))
    users = [item for item in items if _uses_cluster(item)]
    if not users:
        return
    at = items.index(users[0])
    rest = [item for item in items if not _uses_cluster(item)]
    items[:] = rest[:at] + users + rest[at:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the cluster's last user: stop it (trylast: after pytest's own teardown, which
    deletes the last module's app)."""
    if _uses_cluster(item) and not _uses_cluster(nextitem):
        while _stops:
            _stops.pop()()


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

    def stop() -> None:
        serve.shutdown()
        ray.shutdown()

    _stops.append(stop)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        while _stops:
            _stops.pop()()


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
