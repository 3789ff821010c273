"""graphs/spec.py: the pydantic spec, its defaults, kind inference and YAML dump."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from trae_groups.graphs.errors import GraphValidationError, SourceMap
from trae_groups.graphs.loader import load_graph, load_graph_text
from trae_groups.graphs.spec import (
    ClassifyNode,
    GenerateNode,
    GenerateParams,
    GraphSpec,
    InputSpec,
    PythonNode,
)

EXAMPLE = Path(__file__).parents[1] / "examples" / "support.yaml"


def spec_of(text: str) -> GraphSpec:
    return load_graph_text(textwrap.dedent(text), "g.yaml")


BASE = """
name: g
models:
  clf: {source: ./m/clf, task: classify}
  llm: {source: ./m/llm, task: generate}
inputs: {text: str}
nodes:
  intent: {model: clf, input: "{{ inputs.text }}"}
  reply: {model: llm, prompt: "{{ intent.label }}: {{ inputs.text }}"}
  glue: {function: "json:dumps", args: {obj: "{{ reply.text }}", indent: 2}}
outputs: {label: intent.label, reply: reply.text}
"""


def test_kind_is_inferred_from_the_model_task_or_function():
    spec = spec_of(BASE)
    assert isinstance(spec.nodes["intent"], ClassifyNode)
    assert isinstance(spec.nodes["reply"], GenerateNode)
    assert isinstance(spec.nodes["glue"], PythonNode)
    assert spec.nodes["glue"].args == {"obj": "{{ reply.text }}", "indent": 2}


def test_explicit_kind_equals_inferred_kind():
    explicit = BASE.replace("{model: clf,", "{kind: classify, model: clf,")
    assert spec_of(explicit) == spec_of(BASE)


def test_defaults():
    node = spec_of(BASE).nodes["reply"]
    assert node.params == GenerateParams()
    # one default everywhere (engine/sampling.py): greedy, 256 tokens
    assert (node.params.max_tokens, node.params.temperature, node.params.top_p) == (256, 0.0, 1.0)
    assert node.on_error == "fail" and node.after == [] and node.optional == []
    assert node.timeout is None and node.when is None
    assert spec_of(BASE).sharing.memory == "shared"


def test_input_short_and_long_forms():
    inputs = {
        "a": "str",
        "b": {"type": "int", "default": 3},
        "c": {"type": "list[str]", "optional": True},
        "d": {"type": "messages", "default": [{"role": "user", "content": "hi"}]},
    }
    parsed = {name: InputSpec.model_validate(value) for name, value in inputs.items()}
    assert not parsed["a"].optional
    assert parsed["b"].optional and parsed["b"].default == 3
    assert parsed["c"].optional and parsed["c"].default is None
    assert parsed["d"].optional and parsed["d"].default[0]["role"] == "user"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"type": "integer"}, "Input should be"),
        ({"type": "int", "default": "x"}, "is not of type int"),
        ({"type": "bool", "default": 1}, "is not of type bool"),
        ({"type": "str", "default": "x", "optional": False}, "with a default is optional"),
    ],
)
def test_bad_inputs(raw, fragment):
    with pytest.raises(ValidationError, match=fragment):
        InputSpec.model_validate(raw)


def test_durations_accept_units():
    spec = spec_of(BASE.replace("name: g", "name: g\ntimeout: 1.5m").replace(
        '{model: clf, input: "{{ inputs.text }}"}',
        '{model: clf, input: "{{ inputs.text }}", timeout: 250ms}',
    ))  # fmt: skip
    assert spec.timeout == 90.0
    assert spec.nodes["intent"].timeout == 0.25


def test_stop_accepts_one_string():
    params = GenerateParams.model_validate({"stop": "\n", "top_k": 5})
    assert params.stop == ["\n"] and params.top_k == 5


@pytest.mark.parametrize(
    "params",
    [{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"stop": [""]}, {"top_k": "5"}],
)
def test_bad_params(params):
    with pytest.raises(ValidationError):
        GenerateParams.model_validate(params)


def test_generate_needs_exactly_one_of_prompt_or_messages():
    base = {"kind": "generate", "model": "llm"}
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateNode.model_validate(base)
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateNode.model_validate({**base, "prompt": "x", "messages": "{{ inputs.chat }}"})
    node = GenerateNode.model_validate({**base, "messages": [{"role": "user", "content": "x"}]})
    assert node.messages[0].content == "x"


def test_round_trip_of_the_example():
    spec = load_graph(EXAMPLE)
    again = load_graph_text(spec.to_yaml(), "dump.yaml")
    assert again == spec
    assert again.to_yaml() == spec.to_yaml()
    assert GraphSpec.model_validate(spec.model_dump()) == spec
    assert GraphSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_dump_is_small_and_readable():
    dumped = yaml.safe_load(load_graph(EXAMPLE).to_yaml())
    assert dumped["inputs"]["text"] == "str"  # short form kept
    assert "kind" not in dumped["nodes"]["intent"]  # inferable kind left out
    assert "on_error" not in dumped["nodes"]["intent"]  # defaults left out
    assert "content: |" in load_graph(EXAMPLE).to_yaml()  # prompts as literal blocks


def test_equality_ignores_the_source():
    text = textwrap.dedent(BASE)
    a, b = load_graph_text(text, "a.yaml"), load_graph_text("\n\n" + text, "b.yaml")
    assert a == b and a.source.file == "a.yaml"


def test_model_path_is_relative_to_the_graph_file(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(textwrap.dedent(BASE))
    spec = load_graph(path)
    assert spec.model_path("clf") == tmp_path / "m" / "clf"
    bare = GraphSpec.model_validate(spec.model_dump())
    assert bare.model_path("clf") == Path("./m/clf")
    assert bare.with_source(SourceMap("x", base_dir=Path("/srv"))).model_path("clf") == Path(
        "/srv/m/clf"
    )


def test_input_model_validates_request_bodies():
    spec = load_graph(EXAMPLE)
    model = spec.input_model()
    body = model.model_validate({"text": "hello"})
    assert body.text == "hello" and body.history == []
    with pytest.raises(ValidationError):
        model.model_validate({})
    with pytest.raises(ValidationError):
        model.model_validate({"text": 3})
    with pytest.raises(ValidationError):
        model.model_validate({"text": "x", "history": [{"role": "user"}]})
    with pytest.raises(ValidationError):
        model.model_validate({"text": "x", "other": 1})


def test_spec_is_frozen():
    spec = spec_of(BASE)
    with pytest.raises(ValidationError):
        spec.name = "other"


def test_embed_options():
    spec = spec_of(
        BASE.replace(
            "  llm: {source: ./m/llm, task: generate}",
            "  llm: {source: ./m/llm, task: generate}\n  emb: {source: ./m/emb, task: embed}",
        ).replace(
            "nodes:\n", 'nodes:\n  vec: {model: emb, input: "{{ inputs.text }}", pooling: cls}\n'
        )
    )
    assert spec.nodes["vec"].pooling == "cls" and spec.nodes["vec"].normalize is False
    with pytest.raises(GraphValidationError, match="pooling"):
        spec_of(
            BASE.replace(
                "nodes:\n", "nodes:\n  v: {kind: embed, model: x, input: y, pooling: max}\n"
            )
        )
