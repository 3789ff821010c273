"""Every option a node kind documents reaches the engine.

The table below has one row per option of every node kind; its rows must be exactly
the options the registry (graphs/nodes.py ``KINDS``) declares, a generate node's
being every field of ``GenerateParams``, so an option added without a row fails here.
Each row sets a non-default value in a YAML graph, runs the graph through the real
runtime and executor, and checks what the worker's ``submit`` received (a spy that
records and calls through: the engine runs as always) and, where a result can show
it, the result. This is the test that catches "embed options never arrive".
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import BaseModel

from conftest import LORA_VARIANTS, build_encoder, build_llm, build_lora
from trae_groups.engine import EngineConfig, SamplingParams
from trae_groups.engine.constraints import Constraint
from trae_groups.engine.protocol import EncodeOptions, GenerateRequest
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.nodes import KINDS, GenerateParams, NodeBase
from trae_groups.graphs.runtime import ModelRuntime

#: Fields that say what a node runs on, not how: not options.
RUNS_ON = {"kind", "model", "function"}

#: kind -> option -> a value that is not its default.
ROWS: dict[str, dict[str, Any]] = {
    "classify": {},
    "tag": {},
    "embed": {"pooling": "cls", "normalize": True},
    "rerank": {},
    "generate": {
        "max_tokens": 3,
        "temperature": 0.7,
        "top_k": 7,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.3,
        "stop": ["zq"],
        "ignore_eos": True,
        "seed": 1234,
        "speculative": False,
    },
    "python": {},
}
GENERATE_MAX = 4  # every generate row's max_tokens, but the max_tokens row's own
#: kind -> node-level option (beside ``params``) -> a value that is not its default.
NODE_ROWS: dict[str, dict[str, Any]] = {
    "generate": {"output_schema": {"enum": ["yes", "no"]}, "adapter": "tuned"},
}


def documented_options(kind: str) -> set[str]:
    """A kind's options as the registry declares them: its spec's own fields that are
    not templates nor what it runs on; a nested spec (generate's params) counts by
    its fields."""
    spec = KINDS[kind].spec
    own = set(spec.model_fields) - set(NodeBase.model_fields) - set(spec.TEMPLATES) - RUNS_ON
    options: set[str] = set()
    for name in own:
        annotation = spec.model_fields[name].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            options |= set(annotation.model_fields)
        else:
            options.add(name)
    return options


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_documented_option_has_a_row(kind):
    assert kind in ROWS, f"node kind {kind!r} has no row in this test's table"
    assert set(ROWS[kind]) | set(NODE_ROWS.get(kind, {})) == documented_options(kind)


def test_generate_rows_are_every_params_field_and_not_defaults():
    assert set(ROWS["generate"]) == set(GenerateParams.model_fields)
    defaults = GenerateParams()
    for option, value in ROWS["generate"].items():
        assert getattr(defaults, option) != value, option
    embed = EncodeOptions()
    for option, value in ROWS["embed"].items():
        assert getattr(embed, option) != value, option


# ---------------------------------------------------------------- the runtime

MODELS = {"classify": "clf", "tag": "ner", "embed": "emb", "rerank": "rr", "generate": "llm"}
TEMPLATES = {
    "classify": {"input": "{{ inputs.text }}"},
    "tag": {"input": "{{ inputs.text }}"},
    "embed": {"input": "{{ inputs.text }}"},
    "rerank": {"query": "{{ inputs.text }}", "documents": "{{ inputs.docs }}"},
    "generate": {"prompt": "{{ inputs.text }}"},
}
TEXT = "hello where is my order"
DOCS = ["ship to paris", "refund my order"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("options")
    return {
        "classify": build_encoder(root / "clf", "classify", ["a", "b", "c"], seed=1),
        "tag": build_encoder(root / "ner", "tag", ["O", "B-LOC", "I-LOC"], seed=2),
        "embed": build_encoder(root / "emb", "embed", ["x"], seed=3),
        "rerank": build_encoder(root / "rr", "rerank", ["relevant"], seed=4),
        "generate": build_llm(root / "llm", "llama"),
        "lora": build_lora(root / "lora", root / "llm", **LORA_VARIANTS["short"]),
    }


@pytest.fixture(scope="module")
def runtime(dirs):
    config = EngineConfig(pool_bytes=8 << 20, fast_linear=False)
    rt = ModelRuntime(config, reserve_for=[dirs["generate"]])
    rt.start()
    yield rt
    rt.shutdown()


def graph_text(name: str, kind: str, dirs, options: dict[str, Any]) -> str:
    node: dict[str, Any] = {"model": MODELS[kind], **TEMPLATES[kind]}
    if kind == "generate":
        node_level = {k: v for k, v in options.items() if k in NODE_ROWS["generate"]}
        params = {k: v for k, v in options.items() if k not in node_level}
        node["params"] = {"max_tokens": GENERATE_MAX, **params}
        node.update(node_level)
    else:
        node.update(options)
    inputs: dict[str, Any] = {"text": "str"}
    if kind == "rerank":
        inputs["docs"] = "list[str]"
    model = {"source": str(dirs[kind]), "task": KINDS[kind].task}
    if "adapter" in options:  # the node's adapter is one the model declares
        model["adapters"] = {options["adapter"]: str(dirs["lora"])}
    graph = {
        "name": name,
        "models": {MODELS[kind]: model},
        "inputs": inputs,
        "nodes": {"n": node},
        "outputs": {"out": "n"},
    }
    return yaml.safe_dump(graph, sort_keys=False)


def run_graph(runtime, dirs, kind: str, options: dict[str, Any], name: str, monkeypatch):
    """Bind a one-node graph (its YAML through the loader), spy on its model's
    worker, run one request; returns (result, what submit received for it)."""
    executor = runtime.graphs.get(name) or runtime.bind(
        load_graph_text(graph_text(name, kind, dirs, options), f"{name}.yaml")
    )
    worker = executor.clients[MODELS[kind]].worker
    calls: list[tuple[tuple, dict]] = []
    real = worker.submit

    def submit(*args: Any, **kwargs: Any) -> Any:  # records, then the engine does its work
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "submit", submit)
    inputs = {"text": TEXT, "docs": DOCS} if kind == "rerank" else {"text": TEXT}
    result = asyncio.run(executor.run(inputs))
    monkeypatch.undo()
    mine = [(a, k) for a, k in calls if _request_id(a, k) == f"{result.request_id}/n"]
    assert mine, "the engine received nothing for this request"
    return result, mine


def _request_id(args: tuple, kwargs: dict) -> str:
    """An LLM worker takes the GenerateRequest whole; an encoder worker, keywords."""
    return args[0].request_id if isinstance(args[0], GenerateRequest) else kwargs["request_id"]


def received_request(calls) -> GenerateRequest:
    ((args, _kwargs),) = calls
    return args[0]


def received_params(calls) -> SamplingParams:
    return received_request(calls).params


def received_options(calls) -> list[EncodeOptions]:
    return [kwargs["options"] for _args, kwargs in calls]


GENERATE_CASES = list(ROWS["generate"].items())


@pytest.mark.parametrize(("option", "value"), GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_each_generate_option_reaches_the_engine(runtime, dirs, monkeypatch, option, value):
    result, calls = run_graph(
        runtime, dirs, "generate", {option: value}, f"g_{option}", monkeypatch
    )
    engine_value = tuple(value) if isinstance(value, list) else value
    expected = SamplingParams(**{"max_tokens": GENERATE_MAX, option: engine_value})
    assert received_params(calls) == expected  # that option, every other one the default
    out = result.outputs["out"]
    assert out["tokens"] <= expected.max_tokens
    if option == "max_tokens" and out["finish_reason"] == "length":
        assert out["tokens"] == value


def test_output_schema_reaches_the_engine_as_a_constraint(runtime, dirs, monkeypatch):
    schema = NODE_ROWS["generate"]["output_schema"]
    result, calls = run_graph(
        runtime,
        dirs,
        "generate",
        {"output_schema": schema, "max_tokens": 16},
        "g_schema",
        monkeypatch,
    )
    assert received_params(calls).constraint == Constraint.json_schema(schema)
    out = result.outputs["out"]
    assert out["json"] in ("yes", "no") and out["text"] == f'"{out["json"]}"'


def test_adapter_reaches_the_engine_and_changes_the_text(runtime, dirs, monkeypatch):
    adapter = NODE_ROWS["generate"]["adapter"]
    base, base_calls = run_graph(runtime, dirs, "generate", {}, "g_base", monkeypatch)
    tuned, calls = run_graph(runtime, dirs, "generate", {"adapter": adapter}, "g_lora", monkeypatch)
    assert received_request(calls).adapter == adapter
    assert received_request(base_calls).adapter is None
    assert received_params(calls) == SamplingParams(max_tokens=GENERATE_MAX)
    assert tuned.outputs["out"]["text"] != base.outputs["out"]["text"]


def test_generate_defaults_reach_the_engine_as_the_engines_defaults(runtime, dirs, monkeypatch):
    _result, calls = run_graph(runtime, dirs, "generate", {}, "g_defaults", monkeypatch)
    assert received_params(calls) == SamplingParams(max_tokens=GENERATE_MAX)
    assert GenerateParams().model_dump() == {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in vars(SamplingParams()).items()
        if k in GenerateParams.model_fields
    }


def test_stop_cuts_the_text_where_greedy_decoding_wrote_it(runtime, dirs, monkeypatch):
    whole, _ = run_graph(runtime, dirs, "generate", {"max_tokens": 12}, "g_whole", monkeypatch)
    text = whole.outputs["out"]["text"]
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), f"the greedy text {text!r} gives no stop string to test"
    cut, calls = run_graph(
        runtime, dirs, "generate", {"max_tokens": 12, "stop": [stop]}, "g_cut", monkeypatch
    )
    assert received_params(calls).stop == (stop,)
    assert cut.outputs["out"]["text"] == text[: text.index(stop)]
    assert cut.outputs["out"]["finish_reason"] == "stop"


@pytest.mark.parametrize(("option", "value"), list(ROWS["embed"].items()))
def test_each_embed_option_reaches_the_engine(runtime, dirs, monkeypatch, option, value):
    _result, calls = run_graph(runtime, dirs, "embed", {option: value}, f"e_{option}", monkeypatch)
    assert received_options(calls) == [EncodeOptions(**{option: value})]


@pytest.mark.parametrize("kind", [k for k, kind in KINDS.items() if kind.task and not ROWS[k]])
def test_kinds_without_options_send_the_default_options(runtime, dirs, monkeypatch, kind):
    _result, calls = run_graph(runtime, dirs, kind, {}, f"{kind}_plain", monkeypatch)
    expected = len(DOCS) if kind == "rerank" else 1  # one item per (query, document) pair
    assert received_options(calls) == [EncodeOptions()] * expected


def _embedding(runtime, dirs, monkeypatch, options: dict[str, Any], name: str) -> torch.Tensor:
    result, _ = run_graph(runtime, dirs, "embed", options, name, monkeypatch)
    return torch.tensor(result.outputs["out"]["embedding"])


def test_normalize_gives_unit_vectors(runtime, dirs, monkeypatch):
    raw = _embedding(runtime, dirs, monkeypatch, {}, "e_mean")
    unit = _embedding(runtime, dirs, monkeypatch, {"normalize": True}, "e_normalize")
    assert abs(float(raw.norm()) - 1.0) > 1e-3  # so the next line shows normalize did it
    assert abs(float(unit.norm()) - 1.0) < 1e-5
    assert torch.allclose(unit, raw / raw.norm(), atol=1e-5)


def test_cls_pooling_is_the_first_tokens_hidden_state(runtime, dirs, monkeypatch):
    from transformers import AutoModel, AutoTokenizer

    mean = _embedding(runtime, dirs, monkeypatch, {}, "e_mean")
    cls = _embedding(runtime, dirs, monkeypatch, {"pooling": "cls"}, "e_pooling")
    tokenizer = AutoTokenizer.from_pretrained(dirs["embed"])
    model = AutoModel.from_pretrained(dirs["embed"]).eval()
    with torch.no_grad():
        hidden = model(**tokenizer(TEXT, return_tensors="pt")).last_hidden_state[0]
    assert torch.allclose(cls, hidden[0], atol=1e-5)
    assert torch.allclose(mean, hidden.mean(0), atol=1e-5)
    assert not torch.allclose(cls, mean, atol=1e-3)


def test_the_graph_docs_list_every_kind_and_generate_param():
    text = (Path(__file__).parents[1] / "docs" / "graphs.md").read_text()
    for kind in KINDS:
        assert f"| `{kind}` |" in text, f"docs/graphs.md has no row for node kind {kind!r}"
    for option in GenerateParams.model_fields:
        assert f"| `{option}` |" in text, f"docs/graphs.md has no row for param {option!r}"
