"""OpenTelemetry traces: the span tree of one real request (the SDK's in-memory exporter),
the caller's traceparent as its parent, nothing while off, and `trae serve --otlp-endpoint`
sending OTLP/HTTP to a collector on 127.0.0.1, the engine process's spans in the same tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from otlp_collector import Collector

from conftest import build_encoder, build_llm
from trae_groups.engine import EngineConfig
from trae_groups.graphs import tracing
from trae_groups.loadgen import free_port
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

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
  never:
    model: dialog
    when: "inputs.text == 'no such text'"
    prompt: "{{{{ inputs.text }}}}"
outputs: {{intent: intent.label, reply: reply.text, never: never.text}}
"""
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("traced")
    build_llm(root / "dialog", "llama")
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    (root / "traced.yaml").write_text(GRAPH.format(root=root))
    return root


@pytest.fixture
def exporter():
    spans = InMemorySpanExporter()
    tracing.configure(spans)
    yield spans
    tracing.shutdown()


def test_one_request_is_a_graph_span_with_a_child_per_node(root, exporter):
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    with (
        ServerThread(create_app([root / "traced.yaml"], config)) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        answer = client.post(
            "/v1/graphs/traced",
            json={"inputs": {"text": "where is my order"}},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"},
        )
    assert answer.status_code == 200
    body = answer.json()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    phases = {name for name, _begin, _end in tracing.PHASES}  # inside the reply's span
    assert set(spans) == {"graph traced", "node intent", "node reply", "node never", *phases}
    graph = spans["graph traced"]
    assert format(graph.context.trace_id, "032x") == TRACE_ID  # the caller's trace
    assert format(graph.parent.span_id, "016x") == PARENT_SPAN
    assert graph.attributes["trae.request_id"] == body["request_id"]
    for name in ("intent", "reply", "never"):
        span = spans[f"node {name}"]
        assert span.parent.span_id == graph.context.span_id
        assert span.attributes["trae.node.status"] == body["nodes"][name]["status"]
        assert graph.start_time <= span.start_time <= span.end_time <= graph.end_time
    reply = spans["node reply"].attributes
    assert reply["trae.node.kind"] == "generate" and reply["trae.node.model"] == "dialog"
    assert 1 <= reply["trae.node.tokens"] <= 3 and reply["trae.node.prompt_tokens"] > 0
    finish = "length" if reply["trae.node.tokens"] == 3 else "stop"
    assert reply["trae.node.finish_reason"] == finish
    assert spans["node intent"].attributes["trae.node.kind"] == "classify"
    never = spans["node never"].attributes
    assert never["trae.node.status"] == "skipped"
    assert never["trae.node.reason"] == "condition is false"
    ms = (spans["node reply"].end_time - spans["node reply"].start_time) / 1e6
    assert ms == pytest.approx(body["nodes"]["reply"]["ms"], abs=1.0)  # the record's own time


def test_a_generate_node_span_holds_the_engine_phases(root, exporter):
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    with (
        ServerThread(create_app([root / "traced.yaml"], config)) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        answer = client.post("/v1/graphs/traced", json={"inputs": {"text": "hello"}})
    assert answer.status_code == 200
    spans = exporter.get_finished_spans()
    reply = next(s for s in spans if s.name == "node reply")
    children = [
        s for s in spans if s.parent is not None and s.parent.span_id == reply.context.span_id
    ]
    assert [s.name for s in sorted(children, key=lambda s: s.start_time)] == [
        "queued", "prefill", "decode",
    ]  # fmt: skip
    queued, prefill, decode = sorted(children, key=lambda s: s.start_time)
    assert reply.start_time <= queued.start_time <= queued.end_time <= prefill.start_time
    assert prefill.start_time <= prefill.end_time <= decode.start_time
    assert decode.start_time <= decode.end_time <= reply.end_time
    finish = reply.attributes["trae.node.finish_reason"]
    assert decode.attributes["trae.finish_reason"] == finish
    events = {e.name: e for e in reply.events}
    assert set(events) == {"first token", "finished"}
    assert events["first token"].timestamp == prefill.end_time == decode.start_time
    assert events["finished"].timestamp == decode.end_time
    assert events["finished"].attributes["trae.finish_reason"] == finish
    intent = next(s for s in spans if s.name == "node intent")  # an encoder: no phases
    assert not [
        s for s in spans if s.parent is not None and s.parent.span_id == intent.context.span_id
    ]


def test_without_a_traceparent_the_request_starts_its_own_trace(root, exporter):
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    with (
        ServerThread(create_app([root / "traced.yaml"], config)) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        bad = client.post("/v1/graphs/traced", json={"inputs": {}})
        good = client.post("/v1/graphs/traced", json={"inputs": {"text": "hi"}})
    assert (bad.status_code, good.status_code) == (422, 200)  # a refused request: no span
    graphs = [s for s in exporter.get_finished_spans() if s.name == "graph traced"]
    assert len(graphs) == 1 and graphs[0].parent is None


def test_tracing_off_means_no_spans_and_the_env_turns_it_on(monkeypatch):
    assert not tracing.enabled()
    for name in ("OTEL_TRACES_EXPORTER", *tracing.ENV_SWITCHES):
        monkeypatch.delenv(name, raising=False)
    assert tracing.configure_from_env() is False and not tracing.enabled()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert tracing.configure_from_env() is False  # "none" wins
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    try:
        assert tracing.configure_from_env() is True and tracing.enabled()
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


def test_trae_serve_otlp_endpoint_sends_the_spans_to_a_collector(root):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with Collector() as collector:
        server = subprocess.Popen(
            [sys.executable, "-m", "trae_groups.cli", "serve", str(root / "traced.yaml"),
             "--port", str(port), "--pool-bytes", "16MiB", "--otlp-endpoint", collector.endpoint],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(1200):  # bounded: a few minutes on a loaded machine
                try:
                    if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert server.poll() is None, "trae serve exited"
                time.sleep(0.2)
            answer = httpx.post(
                f"{url}/v1/graphs/traced", json={"inputs": {"text": "hi"}},
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"}, timeout=120,
            )  # fmt: skip
            assert answer.status_code == 200
            os.kill(server.pid, signal.SIGTERM)  # its shutdown flushes the batched spans
            assert server.wait(120) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(30)
        spans = collector.spans()
    assert set(collector.paths) == {"/v1/traces"}
    phases = {name for name, _begin, _end in tracing.PHASES}  # from the engine's own process
    front = {"graph traced", "node intent", "node reply", "node never", *phases}
    assert sorted(s.name for s in spans) == sorted(front | {"engine intent", "engine dialog"})
    assert {s.trace_id for s in spans} == {TRACE_ID}  # one trace, the caller's
    by_name = {s.name: s for s in spans}
    assert by_name["graph traced"].parent_id == PARENT_SPAN
    assert by_name["engine dialog"].parent_id == by_name["node reply"].span_id
    assert by_name["engine intent"].parent_id == by_name["node intent"].span_id
    services = {s.name: s.service for s in spans}
    assert services["graph traced"] == "trae-groups"
    assert services["engine dialog"] == "trae-groups-engine"  # the engine process's own


def test_the_carried_context_names_the_span_and_the_samplers_decision(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    tracing.configure(InMemorySpanExporter())  # the SDK's default: parent-based, always on
    try:
        caller = tracing.RunTrace(f"00-{TRACE_ID}-{PARENT_SPAN}-01", "vendor=7")
        node = caller.headers(tracing.node_key("reply"))
        assert node == {
            "traceparent": f"00-{TRACE_ID}-{caller.child_id('node reply'):016x}-01",
            "tracestate": "vendor=7",
        }
        assert caller.headers(tracing.node_key("reply")) == node  # one id per node
        assert caller.headers()["traceparent"] == f"00-{TRACE_ID}-{caller.span_id:016x}-01"
        unsampled = tracing.RunTrace(f"00-{TRACE_ID}-{PARENT_SPAN}-00")
        assert unsampled.headers()["traceparent"].endswith("-00")
        assert tracing.RunTrace().headers()["traceparent"].endswith("-01")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
        tracing.configure(InMemorySpanExporter())  # the provider reads its sampler then
        assert tracing.RunTrace().headers()["traceparent"].endswith("-00")
    finally:
        tracing.shutdown()
