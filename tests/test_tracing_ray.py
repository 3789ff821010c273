"""Traces across Ray Serve replicas: the ingress replica's spans (graph, nodes, phases;
an OpenAI request and its model span) and each engine replica's ``engine <model>`` span
are one tree in the caller's trace, collected over OTLP on 127.0.0.1 from the OTEL_*
variables the deployment passes to its replicas. On the session's Ray cluster
(tests/ray_cluster.py), as an app of its own."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from ray_cluster import deployed
from tracing_fixtures import CHAT_TRACE, PARENT_SPAN, PHASES, TRACE_ID, traced_graph

from conftest import wait_until
from trae_groups.engine import EngineConfig

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.timeout(600)

APP = "traced"  # its own Serve app (and stats board) on the session's cluster
ENGINE = EngineConfig(pool_bytes=8 << 20, fast_linear=False, num_threads=1)
DEPLOY = """deploy:
  ingress: {num_cpus: 0.1}
  groups:
    engine: {num_cpus: 0.2}
    llm: {models: [dialog], num_cpus: 0.2}
"""
GRAPH_TRACE = TRACE_ID


@pytest.fixture(scope="module")
def http(ray_cluster, collector, traced_models, tmp_path_factory):
    """The graph on the session's Ray cluster, its replicas told to trace (the OTEL_*
    variables of the deploying process go to them with the deployment)."""
    from trae_groups.cluster.app import ClusterOptions, build

    root: Path = tmp_path_factory.mktemp("traced_ray")
    (root / "traced.yaml").write_text(traced_graph(traced_models, tail=DEPLOY))
    env = pytest.MonkeyPatch()
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        env.delenv(name)
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # batched spans leave within 0.1 s
    try:
        with deployed(APP):
            options = ClusterOptions(
                app=APP, graceful_shutdown_timeout_s=1, graceful_shutdown_wait_loop_s=0.1,
                health_check_period_s=1,
            )  # fmt: skip
            serve.run(build([root / "traced.yaml"], ENGINE, options=options), name=APP,
                      route_prefix="/")  # fmt: skip
            with httpx.Client(base_url=ray_cluster, timeout=120) as client:
                wait_until(lambda: client.get("/ready").status_code == 200, "the ingress",
                           120, 0.2)  # fmt: skip
                yield client
    finally:
        env.undo()


def test_the_replicas_spans_join_the_callers_trace(http, collector):
    graph = http.post(
        "/v1/graphs/traced", json={"inputs": {"text": "where is my order"}},
        headers={"traceparent": f"00-{GRAPH_TRACE}-{PARENT_SPAN}-01"},
    )  # fmt: skip
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "dialog", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"traceparent": f"00-{CHAT_TRACE}-{PARENT_SPAN}-01"},
    )  # fmt: skip
    assert (graph.status_code, chat.status_code) == (200, 200)
    expected = {
        GRAPH_TRACE: {"graph traced", "node intent", "node reply", "engine intent",
                      "engine dialog", *PHASES},
        CHAT_TRACE: {"openai chat", "model dialog", "engine dialog", *PHASES},
    }  # fmt: skip

    def arrived() -> dict:
        seen: dict = {GRAPH_TRACE: set(), CHAT_TRACE: set()}
        for s in collector.spans():
            seen.setdefault(s.trace_id, set()).add(s.name)
        return seen

    wait_until(lambda: arrived() == expected, "every span of both requests", 120, 0.2)
    spans = {(s.trace_id, s.name): s for s in collector.spans()}
    assert spans[(GRAPH_TRACE, "graph traced")].parent_id == PARENT_SPAN
    assert spans[(CHAT_TRACE, "openai chat")].parent_id == PARENT_SPAN
    for trace, engine, parent in [
        (GRAPH_TRACE, "engine intent", "node intent"),
        (GRAPH_TRACE, "engine dialog", "node reply"),
        (CHAT_TRACE, "engine dialog", "model dialog"),
    ]:
        span = spans[(trace, engine)]
        assert span.parent_id == spans[(trace, parent)].span_id
        assert span.service == "trae-groups-engine"
        assert span.attributes["trae.group"] == ("engine" if engine == "engine intent" else "llm")
        assert span.attributes["trae.replica"]
    assert spans[(GRAPH_TRACE, "node reply")].service == "trae-groups"  # the ingress replica


def test_the_deployment_passes_the_otel_variables_to_its_replicas(monkeypatch, tmp_path):
    from trae_groups.cluster.app import ClusterOptions, group_options
    from trae_groups.graphs.loader import load_graph_text

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    spec = load_graph_text(traced_graph(tmp_path, tail=DEPLOY), "traced.yaml")
    actor = group_options(spec.deploy.group("llm"), ClusterOptions())["ray_actor_options"]
    assert actor["runtime_env"]["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == (
        "http://127.0.0.1:4318"
    )
