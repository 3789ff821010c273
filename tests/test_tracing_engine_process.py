"""Traces across the engine process: the front's spans (the SDK's in-memory exporter) and
the engine process's own (OTLP to a collector on 127.0.0.1, from the OTEL_* variables it
inherits) are one tree: each ``engine <model>`` span is a child of the node's or the
OpenAI request's model span, in the caller's trace."""

from __future__ import annotations

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
outputs: {{intent: intent.label, reply: reply.text}}
"""
GRAPH_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CHAT_TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "00f067aa0ba902b7"


def traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{PARENT_SPAN}-01"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("traced_split")
    build_llm(root / "dialog", "llama")
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    (root / "traced.yaml").write_text(GRAPH.format(root=root))
    return root


def test_the_engine_process_spans_join_the_callers_trace(root, monkeypatch):
    front = InMemorySpanExporter()
    tracing.configure(front)
    for name in ("OTEL_TRACES_EXPORTER", *tracing.ENV_SWITCHES):
        monkeypatch.delenv(name, raising=False)
    try:
        with Collector() as collector:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)  # the child's
            config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20), engine_process=True)
            with (
                ServerThread(create_app([root / "traced.yaml"], config)) as server,
                httpx.Client(base_url=server.url, timeout=120) as client,
            ):
                graph = client.post(
                    "/v1/graphs/traced", json={"inputs": {"text": "where is my order"}},
                    headers=traceparent(GRAPH_TRACE),
                )  # fmt: skip
                chat = client.post(
                    "/v1/chat/completions",
                    json={"model": "dialog", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 2},
                    headers=traceparent(CHAT_TRACE),
                )  # fmt: skip
            # the server is down: the engine process flushed its spans as it exited
            engine = collector.spans()
    finally:
        tracing.shutdown()
    assert (graph.status_code, chat.status_code) == (200, 200)
    spans = {(format(s.context.trace_id, "032x"), s.name): s for s in front.get_finished_spans()}
    phases = {name for name, _begin, _end in tracing.PHASES}
    assert {name for trace, name in spans if trace == GRAPH_TRACE} == {
        "graph traced", "node intent", "node reply", *phases,
    }  # fmt: skip
    assert {name for trace, name in spans if trace == CHAT_TRACE} == {
        "openai chat", "model dialog", *phases,
    }  # fmt: skip
    assert {s.name for s in engine} == {"engine intent", "engine dialog"}
    assert {s.service for s in engine} == {"trae-groups-engine"}

    def span_id(trace: str, name: str) -> str:
        return format(spans[(trace, name)].context.span_id, "016x")

    parents = {(s.trace_id, s.name): s.parent_id for s in engine}
    assert parents == {
        (GRAPH_TRACE, "engine intent"): span_id(GRAPH_TRACE, "node intent"),
        (GRAPH_TRACE, "engine dialog"): span_id(GRAPH_TRACE, "node reply"),
        (CHAT_TRACE, "engine dialog"): span_id(CHAT_TRACE, "model dialog"),
    }
    body = graph.json()
    ids = {s.attributes["trae.request_id"] for s in engine if s.trace_id == GRAPH_TRACE}
    assert ids == {f"{body['request_id']}/intent", f"{body['request_id']}/reply"}
