"""Traces of the OpenAI routes (the SDK's in-memory exporter, a real server): each request
is a span ``openai <endpoint>`` under the caller's traceparent, with a ``model <name>``
child holding the engine's phases, or the graph run's spans for a chat graph."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")
from tracing_fixtures import CHAT_TRACE, PARENT_SPAN, PHASES, children, one, served

from conftest import wait_until
from trae_groups.graphs import tracing
from trae_groups.serving.call_tracing import CallTrace

SHOP = """
name: shop
models:
  llm: {{source: {root}/dialog, task: generate}}
  emb: {{source: {root}/emb, task: embed}}
inputs: {{text: str}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 3}}}}
  vec: {{model: emb, input: "{{{{ inputs.text }}}}"}}
outputs: {{said: say.text, vec: vec.embedding}}
"""
CHATTY = """
name: chatty
models:
  talk: {{source: {root}/dialog, task: generate}}
inputs: {{history: messages}}
nodes:
  answer: {{model: talk, messages: "{{{{ inputs.history }}}}", params: {{max_tokens: 4}}}}
outputs: {{reply: answer.text}}
"""
USER = [{"role": "user", "content": "where is my order?"}]
TRACE_ID = CHAT_TRACE
HEADERS = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01", "tracestate": "vendor=7"}


@pytest.fixture(scope="module")
def http(traced_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("traced_openai")
    (root / "shop.yaml").write_text(SHOP.format(root=traced_models))
    (root / "chatty.yaml").write_text(CHATTY.format(root=traced_models))
    with served(root / "shop.yaml", root / "chatty.yaml") as client:
        yield client


def assert_under_the_caller(root) -> None:
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_SPAN
    assert root.context.trace_state.to_header() == "vendor=7"  # tracestate goes along


def test_a_chat_completion_on_an_llm_is_a_request_span_with_the_model_and_its_phases(
    http, exporter
):
    answer = http.post(
        "/v1/chat/completions",
        json={"model": "shop/llm", "messages": USER, "max_tokens": 3},
        headers=HEADERS,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == sorted(["openai chat", "model llm", *PHASES])
    assert {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}
    root = one(spans, "openai chat")
    assert_under_the_caller(root)
    attributes = root.attributes
    assert attributes["trae.endpoint"] == "chat" and attributes["trae.model"] == "shop/llm"
    assert attributes["trae.request_id"] == body["id"]
    assert attributes["http.response.status_code"] == 200
    [model] = children(spans, root)
    assert model.name == "model llm"
    assert model.attributes["trae.node.kind"] == "generate"
    assert model.attributes["trae.node.tokens"] == body["usage"]["completion_tokens"]
    assert model.attributes["trae.node.prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert model.attributes["trae.node.finish_reason"] == body["choices"][0]["finish_reason"]
    assert root.start_time <= model.start_time <= model.end_time <= root.end_time
    phases = children(spans, model)
    assert [s.name for s in phases] == PHASES
    assert model.start_time <= phases[0].start_time and phases[-1].end_time <= model.end_time
    assert {e.name for e in model.events} == {"first token", "finished"}


def test_a_streamed_completion_of_two_prompts_has_the_phases_of_each(http, exporter):
    answer = http.post(
        "/v1/completions",
        json={"model": "llm", "prompt": ["hello", "where is it"], "max_tokens": 2, "stream": True},
    )
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    # a stream's span is made when its scope is released, just after the last event
    wait_until(lambda: any(s.name == "openai completions" for s in exporter.get_finished_spans()),
               "the stream's span")  # fmt: skip
    spans = exporter.get_finished_spans()
    root = one(spans, "openai completions")
    assert root.parent is None  # no traceparent: a trace of its own
    [model] = children(spans, root)
    assert model.attributes["trae.prompts"] == 2
    phases = children(spans, model)
    assert sorted(s.name for s in phases) == sorted(PHASES * 2)
    assert sorted(s.attributes["trae.generation"] for s in phases) == [0, 0, 0, 1, 1, 1]
    assert len({s.context.trace_id for s in spans}) == 1


def test_embeddings_are_a_request_span_and_the_encoder_span(http, exporter):
    answer = http.post(
        "/v1/embeddings", json={"model": "emb", "input": ["one", "two"]}, headers=HEADERS
    )
    assert answer.status_code == 200, answer.text
    spans = exporter.get_finished_spans()
    root = one(spans, "openai embeddings")
    assert_under_the_caller(root)
    [model] = children(spans, root)
    assert model.name == "model emb"
    assert model.attributes["trae.node.kind"] == "embed" and model.attributes["trae.items"] == 2
    assert not children(spans, model)  # an encoder has no generation phases


def test_a_chat_graph_through_openai_holds_the_graph_run(http, exporter):
    answer = http.post(
        "/v1/chat/completions", json={"model": "chatty", "messages": USER}, headers=HEADERS
    )
    assert answer.status_code == 200, answer.text
    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}
    root = one(spans, "openai chat")
    assert_under_the_caller(root)
    [graph] = children(spans, root)
    assert graph.name == "graph chatty"
    [node] = children(spans, graph)
    assert node.name == "node answer"
    assert [s.name for s in children(spans, node)] == PHASES


def test_a_response_is_traced_like_a_chat_completion(http, exporter):
    answer = http.post(
        "/v1/responses", json={"model": "llm", "input": "hi", "max_output_tokens": 2},
        headers=HEADERS,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    spans = exporter.get_finished_spans()
    root = one(spans, "openai responses")
    assert_under_the_caller(root)
    [model] = children(spans, root)
    assert [s.name for s in children(spans, model)] == PHASES


def test_a_request_that_fails_in_the_engine_is_a_failed_span(http, exporter):
    answer = http.post(
        "/v1/completions", json={"model": "llm", "prompt": "word " * 400, "max_tokens": 2}
    )
    assert answer.status_code == 422, answer.text  # longer than the model's context
    spans = exporter.get_finished_spans()
    root = one(spans, "openai completions")
    assert root.status.status_code.name == "ERROR"
    assert root.attributes["http.response.status_code"] == 422


def test_while_off_a_request_has_no_trace_to_build_or_carry(http, clean_env):
    assert not tracing.enabled()
    assert CallTrace.start("chat", "llm", HEADERS) is None  # what the route's scope holds
    answer = http.post("/v1/chat/completions", json={"model": "llm", "messages": USER})
    assert answer.status_code == 200 and tracing.carried() is None


def test_a_malformed_or_unsampled_traceparent(http, exporter):
    bad = http.post(
        "/v1/chat/completions", json={"model": "llm", "messages": USER, "max_tokens": 1},
        headers={"traceparent": "00-not-a-trace-01"},
    )  # fmt: skip
    assert bad.status_code == 200  # ignored: the request starts a trace of its own
    [root] = [s for s in exporter.get_finished_spans() if s.name == "openai chat"]
    assert root.parent is None and format(root.context.trace_id, "032x") != TRACE_ID
    unsampled = http.post(
        "/v1/chat/completions", json={"model": "llm", "messages": USER, "max_tokens": 1},
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-00"},
    )  # fmt: skip
    assert unsampled.status_code == 200
    traced = {s.context.trace_id for s in exporter.get_finished_spans()}
    assert int(TRACE_ID, 16) not in traced  # the caller chose not to record it: nor do we
