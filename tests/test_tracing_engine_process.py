"""Traces across the engine process: the front's spans (the SDK's in-memory exporter) and
the engine process's own (OTLP to a collector on 127.0.0.1, from the OTEL_* variables it
inherits) are one tree: each ``engine <model>`` span is a child of the node's, of a
follower's early prefill's or of the OpenAI request's model span, in the caller's trace."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")
from tracing_fixtures import (
    CHAT_TRACE,
    PHASES,
    RECAP,
    TRACE_ID,
    hex_id,
    served,
    traced_graph,
    traceparent,
)


def test_the_engine_process_spans_join_the_callers_trace(
    traced_models, tmp_path, exporter, collector, clean_env
):
    graph_file = tmp_path / "traced.yaml"
    graph_file.write_text(traced_graph(traced_models, RECAP, ", recap: recap.text", max_tokens=16))
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)  # the child's
    with served(graph_file, engine_process=True) as client:
        graph = client.post(
            "/v1/graphs/traced", json={"inputs": {"text": "where is my order"}},
            headers=traceparent(TRACE_ID),
        )  # fmt: skip
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "dialog", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2},
            headers=traceparent(CHAT_TRACE),
        )  # fmt: skip
    # the server is down: the engine process flushed its spans as it exited
    engine = collector.spans()
    assert (graph.status_code, chat.status_code) == (200, 200)
    front = exporter.get_finished_spans()
    early = [s for s in front if s.name == "early prefill"]
    assert early  # the recap's prefills while the reply streamed
    spans = {(format(s.context.trace_id, "032x"), s.name): s for s in front}
    assert {name for trace, name in spans if trace == TRACE_ID} == {
        "graph traced", "node intent", "node reply", "node recap", "early prefill", *PHASES,
    }  # fmt: skip
    assert {name for trace, name in spans if trace == CHAT_TRACE} == {
        "openai chat", "model dialog", *PHASES,
    }  # fmt: skip
    assert {s.name for s in engine} == {"engine intent", "engine dialog"}
    assert {s.service for s in engine} == {"trae-groups-engine"}

    def span_id(trace: str, name: str) -> str:
        return hex_id(spans[(trace, name)])

    parents = sorted((s.trace_id, s.name, s.parent_id) for s in engine)
    assert parents == sorted([
        (TRACE_ID, "engine intent", span_id(TRACE_ID, "node intent")),
        (TRACE_ID, "engine dialog", span_id(TRACE_ID, "node reply")),
        (TRACE_ID, "engine dialog", span_id(TRACE_ID, "node recap")),
        *[(TRACE_ID, "engine dialog", hex_id(s)) for s in early],  # each early prefill's
        (CHAT_TRACE, "engine dialog", span_id(CHAT_TRACE, "model dialog")),
    ])  # fmt: skip
    body = graph.json()
    ids = {s.attributes["trae.request_id"] for s in engine if s.trace_id == TRACE_ID}
    request = body["request_id"]
    assert {i for i in ids if not i.endswith("/prefix")} == {
        f"{request}/intent", f"{request}/reply", f"{request}/recap",
    }  # fmt: skip
