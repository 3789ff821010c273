"""Typed JSON edges: a generate node with an output_schema yields parsed JSON that
downstream templates, conditions and outputs read by field, checked at load."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

from conftest import build_llm, build_word_tokenizer
from trae_groups.engine import EngineConfig
from trae_groups.engine.errors import ModelLoadError
from trae_groups.graphs.errors import GraphValidationError, NodeError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.serving.graph_api import output_schema

GRAPH = """
name: orders
models:
  llm: {{source: {root}/llm, task: generate}}
inputs: {{text: str}}
nodes:
  extract:
    model: llm
    prompt: "Extract the order from: {{{{ inputs.text }}}}"
    output_schema:
      type: object
      properties:
        order_id: {{type: integer, minimum: 0, maximum: 9999}}
        status: {{enum: [late, lost]}}
      required: [order_id, status]
      additionalProperties: false
    params: {{max_tokens: {max_tokens}}}
  answer:
    model: llm
    when: "extract.json.status == 'late' or extract.json.status == 'lost'"
    prompt: "Order {{{{ extract.json.{field} }}}} is {{{{ extract.json.status }}}}."
    params: {{max_tokens: 3}}
outputs: {{order: extract.json.order_id, status: extract.json.status, answer: answer.text}}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("typed")
    build_llm(root / "llm", "llama")
    return root


def spec_for(root, field="order_id", max_tokens=40, model="llm"):
    text = GRAPH.format(root=root, field=field, max_tokens=max_tokens)
    return load_graph_text(text.replace(f"{root}/llm", f"{root}/{model}"), "o.yaml")


def run(spec, text):
    runtime = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    executor = runtime.bind(spec)
    runtime.start()
    try:
        return asyncio.run(executor.run({"text": text}))
    finally:
        runtime.shutdown()


def test_downstream_nodes_read_the_parsed_fields(root):
    result = run(spec_for(root), "order 1234 never came")
    assert isinstance(result.outputs["order"], int) and 0 <= result.outputs["order"] <= 9999
    assert result.outputs["status"] in ("late", "lost")
    assert result.nodes["answer"].status == "ok"  # the condition read extract.json.status


def test_a_reference_to_a_field_the_schema_lacks_is_refused_at_load(root):
    with pytest.raises(GraphValidationError) as err:
        spec_for(root, field="order")
    (issue,) = err.value.issues
    assert issue.node == "answer" and issue.line == 21  # the prompt that reads it
    assert "'extract.json' has no field 'order' (fields: order_id, status)" in issue.message
    assert "did you mean 'order_id'?" in issue.message


def test_json_of_a_node_without_a_schema_and_a_bad_schema_are_refused(root):
    text = GRAPH.format(root=root, field="order_id", max_tokens=40)
    untyped = text.replace("extract.json.order_id }}", "answer.json.x }}").replace(
        "answer: answer.text", "answer: answer.text, x: answer.json"
    )
    with pytest.raises(GraphValidationError, match="has no output_schema"):
        load_graph_text(untyped, "o.yaml")
    broken = text.replace("type: integer, minimum: 0", "type: 12, minimum: 0")
    with pytest.raises(GraphValidationError, match="output_schema"):
        load_graph_text(broken, "o.yaml")


def test_an_output_cut_by_max_tokens_fails_the_node_clearly(root):
    with pytest.raises(NodeError, match="before it completed its output_schema"):
        run(spec_for(root, max_tokens=3), "order 1234")


def test_the_graph_api_shows_the_typed_outputs(root):
    schema = output_schema(spec_for(root))["properties"]
    assert schema["order"] == {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "null"}]
    }
    assert schema["status"] == {"anyOf": [{"enum": ["late", "lost"]}, {"type": "null"}]}


def test_the_dsl_takes_a_pydantic_model(root):
    from trae_groups import ModelGroup

    class Order(BaseModel):
        order_id: int = Field(ge=0, le=9999)

    group = ModelGroup("orders")
    group.add_model("llm", path=str(root / "llm"), task="generate")
    text = group.input("text", str)
    extract = group.generate("extract", model="llm", prompt=f"{text}", output_schema=Order)
    group.output("order", extract.json.order_id)
    spec = group.spec()
    assert spec.nodes["extract"].output_schema == Order.model_json_schema()
    with pytest.raises(GraphValidationError, match="has no field 'id'"):
        group.output("bad", extract.json.id)
        group.spec()


def test_an_output_schema_can_live_in_a_file_beside_the_graph(root, tmp_path):
    import json

    from trae_groups.graphs.loader import load_graph

    (tmp_path / "order.json").write_text(json.dumps({"enum": ["late", "lost"]}))
    text = (
        "name: fromfile\n"
        f"models:\n  llm: {{source: {root / 'llm'}, task: generate}}\n"
        "inputs: {text: str}\n"
        "nodes:\n"
        '  status: {model: llm, prompt: "{{ inputs.text }}", output_schema: order.json}\n'
        "outputs: {status: status.json}\n"
    )
    (tmp_path / "g.yaml").write_text(text)
    assert load_graph(tmp_path / "g.yaml").nodes["status"].output_schema == {
        "enum": ["late", "lost"]
    }
    (tmp_path / "bad.yaml").write_text(text.replace("order.json", "missing.json"))
    with pytest.raises(GraphValidationError) as err:
        load_graph(tmp_path / "bad.yaml")
    (issue,) = err.value.issues
    assert issue.line == 6 and "cannot read 'missing.json'" in issue.message


def test_the_demo_extraction_example_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "support_extract.yaml"
    spec = load_graph_text(example.read_text(), str(example))
    assert set(spec.nodes["order"].output_schema["properties"]) == {"order_id", "product"}
    assert spec.outputs["order_id"] == "order.json.order_id"


def test_a_tokenizer_llguidance_cannot_read_is_constrained_from_its_decoded_tokens(root):
    # WordLevel with a Fuse decoder: llguidance's own reader raises "can't determine
    # decoder type"; the vocabulary comes from the bytes each token decodes to instead
    build_llm(root / "words", "llama", tokenizer=build_word_tokenizer)
    result = run(spec_for(root, model="words", max_tokens=60), "where is order 12?")
    assert isinstance(result.outputs["order"], int) and result.outputs["status"] in ("late", "lost")


def test_a_model_without_a_tokenizer_cannot_take_an_output_schema(root, tmp_path):
    bare = root / "bare"
    bare.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (bare / name).write_bytes((root / "llm" / name).read_bytes())
    spec = spec_for(root, model="bare")
    runtime = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    try:
        with pytest.raises(ModelLoadError) as err:
            runtime.bind(spec)
    finally:
        runtime.shutdown()
    assert "model 'llm' has no tokenizer" in str(err.value) and "'extract'" in str(err.value)
