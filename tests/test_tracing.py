"""OpenTelemetry traces: the span tree of one real request (the SDK's in-memory exporter),
the caller's traceparent as its parent, a follower's early prefills, nothing while off,
the service named by OTEL_SERVICE_NAME, and `trae serve --otlp-endpoint` sending OTLP/HTTP
to a collector on 127.0.0.1, the engine process's spans in the same tree."""

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
from tracing_fixtures import (
    PARENT_SPAN,
    PHASES,
    RECAP,
    TRACE_ID,
    children,
    one,
    served,
    traced_graph,
    traceparent,
)

from trae_groups.graphs import tracing
from trae_groups.loadgen import free_port

NEVER = """  never:
    model: dialog
    when: "inputs.text == 'no such text'"
    prompt: "{{ inputs.text }}"
"""


@pytest.fixture(scope="module")
def root(traced_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("traced")
    (root / "traced.yaml").write_text(traced_graph(traced_models, NEVER, ", never: never.text"))
    (root / "recap.yaml").write_text(
        traced_graph(traced_models, RECAP, ", recap: recap.text", max_tokens=16)
    )
    return root


def test_one_request_is_a_graph_span_with_a_child_per_node(root, exporter):
    with served(root / "traced.yaml") as client:
        answer = client.post(
            "/v1/graphs/traced",
            json={"inputs": {"text": "where is my order"}},
            headers=traceparent(),
        )
    assert answer.status_code == 200
    body = answer.json()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"graph traced", "node intent", "node reply", "node never", *PHASES}
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
    with served(root / "traced.yaml") as client:
        answer = client.post("/v1/graphs/traced", json={"inputs": {"text": "hello"}})
    assert answer.status_code == 200
    spans = exporter.get_finished_spans()
    reply = one(spans, "node reply")
    assert [s.name for s in children(spans, reply)] == ["queued", "prefill", "decode"]
    queued, prefill, decode = children(spans, reply)
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
    assert not children(spans, one(spans, "node intent"))  # an encoder: no phases


def test_without_a_traceparent_the_request_starts_its_own_trace(root, exporter):
    with served(root / "traced.yaml") as client:
        bad = client.post("/v1/graphs/traced", json={"inputs": {}})
        good = client.post("/v1/graphs/traced", json={"inputs": {"text": "hi"}})
    assert (bad.status_code, good.status_code) == (422, 200)  # a refused request: no span
    graphs = [s for s in exporter.get_finished_spans() if s.name == "graph traced"]
    assert len(graphs) == 1 and graphs[0].parent is None


def test_tracing_off_means_no_spans_and_the_env_turns_it_on(clean_env):
    monkeypatch = clean_env
    assert not tracing.enabled()
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


def test_trae_serve_otlp_endpoint_sends_the_spans_to_a_collector(root, clean_env):
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
                headers=traceparent(), timeout=120,
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
    front = {"graph traced", "node intent", "node reply", "node never", *PHASES}
    assert sorted(s.name for s in spans) == sorted(front | {"engine intent", "engine dialog"})
    assert {s.trace_id for s in spans} == {TRACE_ID}  # one trace, the caller's
    by_name = {s.name: s for s in spans}
    assert by_name["graph traced"].parent_id == PARENT_SPAN
    assert by_name["engine dialog"].parent_id == by_name["node reply"].span_id
    assert by_name["engine intent"].parent_id == by_name["node intent"].span_id
    services = {s.name: s.service for s in spans}
    assert services["graph traced"] == "trae-groups"
    assert services["engine dialog"] == "trae-groups-engine"  # the engine process's own


def test_the_carried_context_names_the_span_and_the_samplers_decision(clean_env):
    monkeypatch = clean_env
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


def test_a_followers_early_prefills_are_spans_of_its_node(root, exporter):
    with served(root / "recap.yaml") as client:
        answer = client.post(
            "/v1/graphs/traced", json={"inputs": {"text": "where is my order"}},
            headers=traceparent(),
        )  # fmt: skip
    assert answer.status_code == 200, answer.text
    spans = exporter.get_finished_spans()
    reply = one(spans, "node reply")
    assert reply.attributes["trae.node.tokens"] > 4  # so the follower got a piece early
    assert {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}
    recap = one(spans, "node recap")
    early = [s for s in children(spans, recap) if s.name == "early prefill"]
    assert early and [s.attributes["trae.prefix"] for s in early] == list(range(len(early)))
    for span in early:
        assert recap.start_time <= span.start_time <= span.end_time <= recap.end_time
        assert span.attributes["trae.prompt_tokens"] > 0
        assert span.attributes["trae.cached_tokens"] >= 0
    # the follower's own generation comes after its early prefills
    queued = one(children(spans, recap), "queued")
    assert early[-1].end_time <= queued.start_time
    assert [s.name for s in children(spans, reply)] == PHASES


def test_the_engine_calls_of_an_early_prefill_carry_its_spans_context(root, exporter):
    from trae_groups.engine import clients

    seen: list[dict | None] = []
    generate = clients.LocalLLM.generate

    def spying(self, request):
        if request.prefix_only:  # what an engine process or a Ray replica would be sent
            seen.append(tracing.carried())
        return generate(self, request)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clients.LocalLLM, "generate", spying)
        with served(root / "recap.yaml") as client:
            answer = client.post("/v1/graphs/traced", json={"inputs": {"text": "hello"}})
    assert answer.status_code == 200, answer.text
    spans = exporter.get_finished_spans()
    early = {f"{s.context.span_id:016x}": s for s in spans if s.name == "early prefill"}
    assert seen and len(seen) == len(early)
    for headers in seen:
        _version, trace_id, span_id, _flags = headers["traceparent"].split("-")
        assert span_id in early and int(trace_id, 16) == early[span_id].context.trace_id


def test_otel_service_name_and_resource_attributes_win_over_our_names(clean_env):
    def service(**env: str) -> dict:
        for name, value in env.items():
            clean_env.setenv(name, value)
        spans = InMemorySpanExporter()
        tracing.configure(spans, service_name=tracing.ENGINE_SERVICE)
        try:
            with tracing.served_span("engine x", tracing.RunTrace().headers()):
                pass
        finally:
            tracing.shutdown()
        for name in env:
            clean_env.delenv(name)
        [span] = spans.get_finished_spans()
        return dict(span.resource.attributes)

    assert service()["service.name"] == "trae-groups-engine"  # ours, by default
    assert service(OTEL_SERVICE_NAME="shop")["service.name"] == "shop"
    named = service(OTEL_RESOURCE_ATTRIBUTES="service.name=shop2,deployment.environment=ci")
    assert named["service.name"] == "shop2" and named["deployment.environment"] == "ci"
    both = service(OTEL_SERVICE_NAME="shop", OTEL_RESOURCE_ATTRIBUTES="service.name=other")
    assert both["service.name"] == "shop"  # the spec's order: OTEL_SERVICE_NAME first
    other = service(OTEL_RESOURCE_ATTRIBUTES="deployment.environment=ci")
    assert other["service.name"] == "trae-groups-engine" and other["deployment.environment"] == "ci"


def test_while_off_no_span_id_or_context_is_made(root, clean_env):
    """Tracing off: no RunTrace, CallTrace or carried context anywhere on the request path
    (graph runs, a follower's early prefills, OpenAI calls, streamed or not)."""
    from trae_groups.serving.call_tracing import CallTrace

    def refuse(*args, **kwargs):
        raise AssertionError("tracing work while tracing is off")

    assert not tracing.enabled()
    clean_env.setattr(tracing, "RunTrace", refuse)
    clean_env.setattr(tracing, "carry", refuse)
    clean_env.setattr(tracing, "record_run", refuse)
    clean_env.setattr(CallTrace, "__init__", refuse)
    chat = {"model": "dialog", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with served(root / "recap.yaml") as client:
        graph = client.post(
            "/v1/graphs/traced", json={"inputs": {"text": "hello"}}, headers=traceparent()
        )
        streamed = client.post(
            "/v1/graphs/traced", json={"inputs": {"text": "hello"}, "stream": True},
            headers=traceparent(),
        )  # fmt: skip
        answers = [client.post("/v1/chat/completions", json=chat, headers=traceparent()),
                   client.post("/v1/chat/completions", json={**chat, "stream": True})]  # fmt: skip
    assert [r.status_code for r in (graph, streamed, *answers)] == [200] * 4
    assert graph.json()["nodes"]["recap"]["status"] == "ok"
    assert "event: error" not in streamed.text
