"""Traces across Ray Serve replicas: the ingress replica's spans (graph, nodes, phases;
an OpenAI request and its model span) and each engine replica's ``engine <model>`` span
are one tree in the caller's trace, collected over OTLP on 127.0.0.1 from the OTEL_*
variables the deployment passes to its replicas."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from conftest import build_encoder, build_llm
from trae_groups.engine import EngineConfig
from trae_groups.graphs import tracing

pytest.importorskip("opentelemetry.sdk")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.timeout(600)

ENGINE = EngineConfig(pool_bytes=8 << 20, fast_linear=False, num_threads=1)
GRAPH = """
name: traced
models:
  intent: {{source: {root}/intent, task: classify}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "{{{{ intent.label }}}}: {{{{ inputs.text }}}}"
    params: {{max_tokens: 3}}
outputs: {{intent: intent.label, reply: reply.text}}
deploy:
  ingress: {{num_cpus: 0.1}}
  groups:
    engine: {{num_cpus: 0.2}}
    llm: {{models: [dialog], num_cpus: 0.2}}
"""
GRAPH_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CHAT_TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "00f067aa0ba902b7"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, what: str, seconds: float = 120.0) -> None:
    for _ in range(int(seconds / 0.2)):  # bounded
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture(scope="module")
def collector():
    from otlp_collector import Collector

    with Collector() as running:
        yield running


@pytest.fixture(scope="module")
def http(collector, tmp_path_factory):
    """The graph on a local Ray cluster, its replicas told to trace (the OTEL_* variables
    of the deploying process go to them)."""
    from trae_groups.cluster.app import ClusterOptions, build

    root: Path = tmp_path_factory.mktemp("traced_ray")
    build_llm(root / "dialog", "llama")
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    (root / "traced.yaml").write_text(GRAPH.format(root=root))
    env = pytest.MonkeyPatch()
    for name in ("OTEL_TRACES_EXPORTER", *tracing.ENV_SWITCHES):
        env.delenv(name, raising=False)
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # batched spans leave within 0.1 s
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))  # fmt: skip
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        options = ClusterOptions(
            graceful_shutdown_timeout_s=1, graceful_shutdown_wait_loop_s=0.1,
            health_check_period_s=1,
        )  # fmt: skip
        serve.run(build([root / "traced.yaml"], ENGINE, options=options), name="trae",
                  route_prefix="/")  # fmt: skip
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            wait_until(lambda: client.get("/ready").status_code == 200, "the ingress")
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()
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
    phases = {name for name, _begin, _end in tracing.PHASES}
    expected = {
        GRAPH_TRACE: {"graph traced", "node intent", "node reply", "engine intent",
                      "engine dialog", *phases},
        CHAT_TRACE: {"openai chat", "model dialog", "engine dialog", *phases},
    }  # fmt: skip

    def arrived() -> dict:
        seen: dict = {GRAPH_TRACE: set(), CHAT_TRACE: set()}
        for s in collector.spans():
            seen.setdefault(s.trace_id, set()).add(s.name)
        return seen

    wait_until(lambda: arrived() == expected, "every span of both requests")
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
    spec = load_graph_text(GRAPH.format(root=tmp_path), "traced.yaml")
    actor = group_options(spec.deploy.group("llm"), ClusterOptions())["ray_actor_options"]
    assert actor["runtime_env"]["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == (
        "http://127.0.0.1:4318"
    )
