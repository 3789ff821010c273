"""graphs/loader.py and compile.py: reading files, YAML edge cases, the compiled DAG."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trae_groups.graphs.compile import compile_graph
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import MAX_YAML_DEPTH, load_graph, load_graph_text, read_yaml

EXAMPLE = Path(__file__).parents[1] / "examples" / "support.yaml"


def load(text: str):
    return load_graph_text(textwrap.dedent(text), "g.yaml")


def rejected(text: str) -> list[str]:
    with pytest.raises(GraphValidationError) as info:
        load_graph_text(text, "g.yaml")
    return [str(issue) for issue in info.value.issues]


# ---------------------------------------------------------------- reading


def test_example_loads_and_compiles():
    spec = load_graph(EXAMPLE)
    assert spec.name == "support" and spec.source.file == str(EXAMPLE)
    graph = compile_graph(spec)
    assert graph.order == ("intent", "entities", "reply")
    assert graph.depth == {"intent": 0, "entities": 0, "reply": 1}


def test_missing_file_is_a_validation_error(tmp_path):
    with pytest.raises(GraphValidationError) as info:
        load_graph(tmp_path / "nope.yaml")
    assert info.value.issues[0].file.endswith("nope.yaml")


def test_not_utf8_is_a_validation_error(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(GraphValidationError):
        load_graph(path)


def test_source_map_records_keys_and_items():
    _, source, issues = read_yaml("a:\n  b: 1\n  c:\n    - x\n    - |\n      y\n", "f.yaml")
    assert issues == []
    assert source.locations[("a", "b")].line == 2
    assert source.locations[("a", "c", 1)].line == 5
    assert source.locations[("a", "c", 1)].literal


def test_aliases_and_merge_keys_work():
    spec = load("""\
        name: g
        models:
          clf: &base {source: ./clf, task: classify, max_batch_size: 8}
          clf2: {<<: *base, max_batch_size: 16}
        inputs: {text: str}
        nodes:
          a: {model: clf, input: &t "{{ inputs.text }}"}
          b: {model: clf2, input: *t}
        outputs: {a: a.label, b: b.label}
        """)
    assert spec.models["clf2"].max_batch_size == 16 and spec.models["clf2"].source == "./clf"
    assert spec.nodes["b"].input == "{{ inputs.text }}"


def test_alias_bomb_is_refused():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    found = rejected("\n".join(lines) + "\n")
    assert "expands to more than" in found[0]


def test_recursive_alias_is_refused():
    assert "recursive alias" in rejected("a: &a [*a]\n")[0]


def test_deep_nesting_is_refused():
    deep = "a: " + "[" * (MAX_YAML_DEPTH + 5) + "]" * (MAX_YAML_DEPTH + 5) + "\n"
    assert "nested deeper" in rejected(deep)[0]
    deeper = "[" * 5000 + "]" * 5000
    assert rejected(deeper)


@pytest.mark.parametrize(
    "text",
    ["a: 2001-02-30\n", "? [a, b]\n: 1\n", "!!python/object:os.system x\n", "a: !!binary '%%'\n"],
)
def test_odd_yaml_is_a_validation_error(text):
    assert rejected(text)


def test_non_string_keys_are_reported():
    found = rejected(
        "name: g\nmodels: {1: {source: x, task: classify}}\ninputs: {}\nnodes: {}\noutputs: {}\n"
    )
    assert any(line.startswith("g.yaml:2:") for line in found)


# ---------------------------------------------------------------- the compiled DAG

DIAMOND = """\
name: diamond
models:
  clf: {source: ./clf, task: classify}
  ner: {source: ./ner, task: tag}
  emb: {source: ./emb, task: embed}
  llm: {source: ./llm, task: generate}
inputs: {text: str}
nodes:
  intent: {model: clf, input: "{{ inputs.text }}"}
  entities: {model: ner, input: "{{ inputs.text }}"}
  vector: {model: emb, input: "{{ inputs.text }}", after: [intent]}
  docs:
    function: "json:dumps"
    args: {obj: "{{ vector.embedding }}"}
    when: "intent.label == 'question'"
  reply:
    model: llm
    prompt: "{{ intent.label }} {{ entities.spans }} {{ docs if docs else '' }}"
    optional: [docs]
  audit: {function: "json:dumps", args: {obj: "{{ reply.text }}"}, after: [docs]}
outputs: {reply: reply.text, label: intent.label, docs: docs, text: inputs.text}
"""


@pytest.fixture
def diamond():
    return compile_graph(load(DIAMOND))


def test_edges_from_references_after_and_conditions(diamond):
    assert set(diamond.dag.edges) == {
        ("intent", "vector"),
        ("vector", "docs"),
        ("intent", "docs"),
        ("intent", "reply"),
        ("entities", "reply"),
        ("docs", "reply"),
        ("reply", "audit"),
        ("docs", "audit"),
    }
    assert diamond.dag.edges["intent", "vector"]["via"] == "after"
    assert diamond.dag.edges["intent", "docs"]["via"] == "reference"


def test_depth_generations_parents_children(diamond):
    assert diamond.depth == {
        "intent": 0, "entities": 0, "vector": 1, "docs": 2, "reply": 3, "audit": 4,
    }  # fmt: skip
    assert diamond.generations == (
        ("intent", "entities"), ("vector",), ("docs",), ("reply",), ("audit",),
    )  # fmt: skip
    assert diamond.roots == ("intent", "entities")
    assert diamond.parents("reply") == ("intent", "entities", "docs")  # join
    assert diamond.children("intent") == ("vector", "docs", "reply")  # fan-out
    assert diamond.dag.nodes["reply"] == {"kind": "generate", "depth": 3}


def test_skip_rule(diamond):
    # docs' `when` was false: reply lists docs as optional, audit does not
    assert diamond.skipped_because("reply", {"docs"}) is None
    assert diamond.skipped_because("audit", {"docs"}) == "docs"
    assert diamond.skipped_because("docs", {"vector"}) == "vector"
    assert diamond.skipped_because("intent", {"docs"}) is None


def test_skipped_dependant_sees_null(diamond):
    context = {
        "inputs": {"text": "hi"},
        "intent": {"label": "chat", "score": 1.0, "scores": {}},
        "entities": {"spans": []},
        "vector": {"embedding": [0.0]},
        "docs": None,
    }
    assert not diamond.templates["docs"].should_run(context)
    assert diamond.templates["reply"].render(context) == {"prompt": "chat [] "}


def test_outputs_of_skipped_nodes_are_null(diamond):
    context = {
        "inputs": {"text": "hi"},
        "intent": {"label": "chat"},
        "docs": None,
        "reply": {"text": "hello", "tokens": [1], "finish_reason": "stop"},
    }
    assert diamond.outputs(context) == {
        "reply": "hello",
        "label": "chat",
        "docs": None,
        "text": "hi",
    }
    assert diamond.outputs(context, ["label"]) == {"label": "chat"}


def test_needed_for(diamond):
    assert set(diamond.needed_for(["label"])) == {"intent"}
    assert diamond.needed_for(["text"]) == ()
    assert set(diamond.needed_for(["reply"])) == {"intent", "entities", "vector", "docs", "reply"}
    assert diamond.output_node("docs") == "docs" and diamond.output_node("text") is None


def test_compile_checks_a_spec_built_by_hand():
    spec = load(DIAMOND)
    broken = spec.model_copy(update={"outputs": {"x": "nowhere.text"}})
    broken.with_source(None)
    with pytest.raises(GraphValidationError, match="<spec>: output 'x': unknown name 'nowhere'"):
        compile_graph(broken)
