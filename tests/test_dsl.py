"""trae_groups/dsl.py: the Python DSL builds the same spec as YAML, with the same errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trae_groups.dsl import ModelGroup, Ref, path_of
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph, load_graph_text

EXAMPLE = Path(__file__).parents[1] / "examples" / "support.yaml"
SYSTEM = (
    "You are a support assistant. The user's intent is {{ intent.label }}.\n"
    "Entities: {{ entities.spans | map(attribute='text') | join(', ') or 'none' }}.\n"
)


def support_group() -> ModelGroup:
    """examples/support.yaml, written with the DSL."""
    group = ModelGroup(
        "support",
        description="Intent + entities feed a dialog model; spam gets no reply.",
        timeout="30s",
    )
    group.add_model("intent", path="./models/intent", task="classify", max_batch_size=64,
                    max_queue_delay_ms=2)  # fmt: skip
    group.add_model("ner", path="./models/ner", task="tag")
    group.add_model("dialog", path="./models/dialog", task="generate", max_batch_size=32,
                    dtype="bfloat16")  # fmt: skip
    text = group.input("text", str)
    group.input("history", "messages", default=[], description="earlier turns of the chat")
    intent = group.classify("intent", model="intent", input=text)
    entities = group.tag(
        "entities", model="ner", input=text, on_error="default", default={"spans": []}
    )
    reply = group.generate(
        "reply",
        model="dialog",
        when="intent.label != 'spam'",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        max_tokens=128,
        temperature=0.7,
        stop=["\nUser:"],
        timeout="20s",
    )
    group.output("intent", intent.label)
    group.output("entities", entities.spans)
    group.output("reply", reply.text)
    return group


def test_dsl_and_yaml_give_equal_specs():
    assert support_group().spec() == load_graph(EXAMPLE)


def test_dsl_spec_round_trips_through_yaml():
    spec = support_group().spec()
    assert load_graph_text(spec.to_yaml(), "dump.yaml") == spec
    assert support_group().to_yaml() == load_graph(EXAMPLE).to_yaml()


def test_references():
    ref = Ref("reply")
    assert path_of(ref.text) == "reply.text"
    assert path_of(ref["docs"][0].title) == "reply.docs.0.title"
    assert f"Reply: {ref.text}" == "Reply: {{ reply.text }}"
    with pytest.raises(AttributeError):
        _ = ref._private


def test_f_string_templates_make_edges():
    group = ModelGroup("g")
    group.add_model("clf", path="clf", task="classify")
    group.add_model("llm", path="llm", task="generate")
    text = group.input("text", str)
    intent = group.classify("intent", model="clf", input=text)
    reply = group.generate(
        "reply", model="llm", prompt=f"Intent: {intent.label}\nUser: {text}", when=intent.score
    )
    group.output("reply", reply.text)
    spec = group.spec()
    assert spec.nodes["reply"].prompt == "Intent: {{ intent.label }}\nUser: {{ inputs.text }}"
    assert spec.nodes["reply"].when == "intent.score"
    assert spec.nodes["intent"].input == "{{ inputs.text }}"


def test_sharing_policy_python_nodes_and_options():
    group = ModelGroup("g")
    group.add_model("emb", path="emb", task="embed")
    group.set_sharing_policy(memory="shared", gpu="dedicated")
    group.set_resources(weight_budget="1GiB", load_wait_s=5)
    query = group.input("query", str)
    group.input("k", int, default=4)
    vector = group.embed("vector", model="emb", input=query)
    docs = group.python(
        "docs", function=json.dumps, args={"obj": vector.embedding, "indent": 2}, timeout=1.5
    )
    group.python("log", function="json:dumps", args={"obj": docs}, after=[vector], optional=docs,
                 on_error="skip")  # fmt: skip
    group.output("docs", docs)
    spec = group.spec()
    assert spec.sharing.gpu == "dedicated"
    assert (spec.resources.weight_budget, spec.resources.load_wait_s) == (1 << 30, 5)
    assert spec.inputs["k"].default == 4 and spec.inputs["k"].optional
    assert spec.nodes["docs"].function == "json:dumps"
    assert spec.nodes["docs"].args == {"obj": "{{ vector.embedding }}", "indent": 2}
    assert spec.nodes["log"].after == ["vector"] and spec.nodes["log"].optional == ["docs"]
    assert spec.nodes["log"].on_error == "skip" and spec.nodes["docs"].timeout == 1.5


def test_errors_name_the_dsl_line():
    group = ModelGroup("g")
    group.add_model("clf", path="clf", task="classify")
    group.input("text", str)
    line = _line() + 1
    group.classify("a", model="clff", input="{{ inputs.txt }}")
    group.classify("a", model="clf", input="x")
    group.output("a", "a.label")
    with pytest.raises(GraphValidationError) as info:
        group.spec()
    found = [(i.file, i.line, i.node, i.message) for i in info.value.issues]
    assert found == [
        (__file__, line, "a", "unknown model 'clff' (did you mean 'clf'?)"),
        (__file__, line, "a", "unknown input 'txt' (did you mean 'text'?)"),
        (__file__, line + 1, "a", f"duplicate node 'a' (first at line {line})"),
    ]


def test_unknown_keyword_is_a_validation_error():
    group = ModelGroup("g")
    group.add_model("clf", path="clf", task="classify")
    group.classify("a", model="clf", input="x", colour="red")
    group.output("a", "a.label")
    with pytest.raises(GraphValidationError, match="unknown field 'colour'"):
        group.spec()


def test_local_function_fails_validation_not_the_call():
    def local():
        return 1

    group = ModelGroup("g")
    group.python("a", function=local)
    group.output("a", "a")
    with pytest.raises(GraphValidationError, match="package.module:function"):
        group.spec()


def test_nothing_runs_until_the_graph_is_run(tmp_path):
    group = ModelGroup("lazy")
    group.add_model("m", path=str(tmp_path / "not-there"), task="classify")
    text = group.input("text", str)
    group.output("label", group.classify("c", model="m", input=text).label)
    assert group.spec().models["m"].source.endswith("not-there")  # no folder is opened
    assert getattr(group, "_local", None) is None
    with pytest.raises(Exception, match="not-there"):
        group.run({"text": "hi"})  # loading happens here, and fails for the missing folder


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


RERANK_YAML = """\
name: search
models:
  rr: {source: ./rr, task: rerank}
  emb: {source: ./emb, task: embed}
inputs:
  q: str
  docs: list[str]
nodes:
  vector: {model: emb, input: "{{ inputs.q }}", pooling: cls, normalize: true}
  rank: {model: rr, query: "{{ inputs.q }}", documents: "{{ inputs.docs }}", after: [vector],
         timeout: 2s}
outputs: {top: rank.top, scores: rank.scores, vector: vector.embedding}
"""


def test_every_registered_kind_is_a_method_and_rerank_matches_yaml():
    from trae_groups.graphs.nodes import KINDS

    group = ModelGroup("search")
    assert all(callable(getattr(group, kind)) for kind in KINDS)
    assert set(KINDS) <= set(dir(group))
    with pytest.raises(AttributeError):
        _ = group.summarize
    group.add_model("rr", path="./rr", task="rerank")
    group.add_model("emb", path="./emb", task="embed")
    q = group.input("q", str)
    docs = group.input("docs", list[str])
    vector = group.embed("vector", model="emb", input=q, pooling="cls", normalize=True)
    rank = group.rerank("rank", model="rr", query=q, documents=docs, after=[vector], timeout="2s")
    group.output("top", rank.top)
    group.output("scores", rank.scores)
    group.output("vector", vector.embedding)
    assert group.spec() == load_graph_text(RERANK_YAML, "search.yaml")


def test_the_generic_node_call_and_its_errors_name_the_dsl_line():
    group = ModelGroup("g")
    group.add_model("rr", path="./rr", task="rerank")
    q = group.input("q", str)
    group.node("rank", "rerank", model="rr", query=q, documents=q, colour="red")
    line = test_the_generic_node_call_and_its_errors_name_the_dsl_line.__code__.co_firstlineno + 4
    group.output("top", Ref("rank").top)
    with pytest.raises(GraphValidationError) as caught:
        group.spec()
    (issue,) = caught.value.issues
    assert (issue.line, issue.node) == (line, "rank") and "colour" in issue.message
