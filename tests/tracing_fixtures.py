"""What the tracing tests share (a plugin that tests/conftest.py loads):
the traced graph and its tiny models (built once a session), the SDK's in-memory exporter
as the front's tracer, an environment without the developer's OTEL_* variables, a
collector on 127.0.0.1 for what other processes export, a real server, and the questions
the tests ask of a span tree."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import build_encoder, build_llm
from trae_groups.engine import EngineConfig
from trae_groups.graphs import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # a graph request's caller's trace
CHAT_TRACE = "0af7651916cd43dd8448eb211c80319c"  # an OpenAI request's
PARENT_SPAN = "00f067aa0ba902b7"
PHASES = [name for name, _begin, _end in tracing.PHASES]  # inside a generation's span

#: The classifier and a 3-token reply; ``nodes`` adds nodes, ``tail`` a deploy section
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
    params: {{max_tokens: {max_tokens}, temperature: 0}}
{nodes}
outputs: {{intent: intent.label, reply: reply.text{outputs}}}
{tail}
"""
#: A generate follower prefilled as the reply streams (its early prefills)
RECAP = """  recap:
    model: dialog
    follows: {node: reply, tokens: 4}
    prompt: "Here is what the assistant said, to be summed up in a few words. Reply: {{ reply.text }}"
    params: {max_tokens: 2, temperature: 0}
"""


def traced_graph(
    root: Path, nodes: str = "", outputs: str = "", tail: str = "", max_tokens: int = 3
) -> str:
    return GRAPH.format(
        root=root, nodes=nodes.rstrip("\n"), outputs=outputs, tail=tail, max_tokens=max_tokens
    )


def traceparent(trace_id: str = TRACE_ID, sampled: bool = True) -> dict[str, str]:
    """The headers of a caller whose span is PARENT_SPAN in ``trace_id``."""
    return {"traceparent": f"00-{trace_id}-{PARENT_SPAN}-{int(sampled):02x}"}


@pytest.fixture(scope="session")
def traced_models(tmp_path_factory) -> Path:
    """The tiny models of the traced graphs (``dialog``, ``intent``, ``emb``), once a
    session."""
    root = tmp_path_factory.mktemp("traced_models")
    build_llm(root / "dialog", "llama")
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    build_encoder(root / "emb", "embed", [], seed=5)
    return root


@pytest.fixture
def clean_env(monkeypatch) -> pytest.MonkeyPatch:
    """No OTEL_* variable of the developer's shell: a test sets the ones it means."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def exporter(clean_env):
    """Tracing on in this process, into the SDK's in-memory exporter; off afterwards."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    tracing.configure(spans)
    yield spans
    tracing.shutdown()


@pytest.fixture(scope="module")
def collector():
    """An OTLP/HTTP collector on 127.0.0.1 (for spans exported by other processes)."""
    from otlp_collector import Collector

    with Collector() as running:
        yield running


@contextlib.contextmanager
def served(*graphs: Path, **config) -> Iterator[httpx.Client]:
    """A real server (uvicorn on 127.0.0.1) of ``graphs`` and a client of it."""
    from trae_groups.serving.server import ServerConfig, ServerThread, create_app

    config.setdefault("engine", EngineConfig(pool_bytes=16 << 20))
    with (
        ServerThread(create_app(list(graphs), ServerConfig(**config))) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        yield client


def children(spans, parent) -> list:
    """``parent``'s child spans (SDK spans), in the order they started."""
    found = [s for s in spans if s.parent and s.parent.span_id == parent.context.span_id]
    return sorted(found, key=lambda s: s.start_time)


def one(spans, name: str):
    [span] = [s for s in spans if s.name == name]
    return span


def hex_id(span) -> str:
    """An SDK span's id as the collector (and a traceparent) writes it."""
    return format(span.context.span_id, "016x")
