"""Where speculative decoding is declared: a generate model's ``speculative:`` in a graph file
(checked at load with file and line), the DSL, ``EngineConfig`` and ``trae serve
--speculative``; what it reports: /metrics and ``trae model info``."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import build_llm, build_word_tokenizer
from trae_groups.cli import _engine_config, build_parser, main
from trae_groups.dsl import ModelGroup
from trae_groups.engine import EngineConfig
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.spec_config import SpeculativeConfig
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

GRAPH = """\
name: spec
models:
  llm:
    source: {root}/llm
    task: generate
    {options}
inputs: {{text: str}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 16}}}}
outputs: {{said: say.text}}
"""
PROMPT = [5, 6, 7, 8, 9] * 4 + [5, 6]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    build_llm(root / "llm", "llama")
    return root


def graph(root, options="speculative: {method: ngram, num_tokens: 3}") -> str:
    return GRAPH.format(root=root, options=options)


def test_a_graph_files_setting_reaches_its_model(root):
    spec = load_graph_text(graph(root), "spec.yaml")
    assert spec.models["llm"].speculative.config() == SpeculativeConfig(num_tokens=3)
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    try:
        rt.bind(spec)
        rt.start()
        (name, worker), *_ = rt.engine.llms.items()
        assert worker.speculator.config.num_tokens == 3
        rt.engine.generate([PROMPT], SamplingParams(max_tokens=16), model=name)
        assert worker.speculator.counters.proposed > 0
    finally:
        rt.shutdown()


def test_a_node_can_opt_out_per_request(root):
    text = graph(root).replace("max_tokens: 16}", "max_tokens: 16, speculative: false}")
    spec = load_graph_text(text, "spec.yaml")
    assert spec.nodes["say"].sampling().speculative is False
    assert load_graph_text(graph(root), "spec.yaml").nodes["say"].sampling().speculative


def test_without_a_setting_a_model_does_not_speculate(root):
    spec = load_graph_text(graph(root, options="max_batch_size: 4"), "spec.yaml")
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    try:
        rt.bind(spec)
        (_, worker), *_ = rt.engine.llms.items()
        assert worker.speculator is None
    finally:
        rt.shutdown()


@pytest.mark.parametrize(
    "options,message",
    [
        ("speculative: {method: draft}", "draft: names the draft model"),
        ("speculative: {method: medusa}", "method: must be one of ['ngram', 'draft', 'follows']"),
        ("speculative: {num_tokens: 0}", "num_tokens: must be an integer in [1, 16]"),
        ("speculative: {num_tokens: 4, k: 2}", "k"),
    ],
)
def test_bad_settings_are_refused_at_load_with_their_line(root, options, message):
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(graph(root, options), "spec.yaml")
    text = str(err.value)
    assert "spec.yaml:" in text and message in text and "llm" in text, text


def test_only_generate_models_speculate(root):
    text = graph(root).replace("task: generate", "task: classify")
    with pytest.raises(GraphValidationError, match="speculative is for generate models"):
        load_graph_text(text, "spec.yaml")


def test_the_dsl_declares_it_the_same_way(root):
    group = ModelGroup("spec")
    group.add_model("llm", f"{root}/llm", task="generate", speculative={"num_tokens": 2})
    text = group.input("text")
    say = group.generate("say", model="llm", prompt=f"{text}")
    group.output("said", say.text)
    assert group.spec().models["llm"].speculative.config() == SpeculativeConfig(num_tokens=2)


def test_the_serve_flag_sets_the_engines_default():
    args = build_parser().parse_args(["serve", "g.yaml", "--speculative", "ngram:3"])
    assert _engine_config(args).speculative == SpeculativeConfig(num_tokens=3)
    assert _engine_config(build_parser().parse_args(["serve", "g.yaml"])).speculative is None
    bad = build_parser().parse_args(["serve", "g.yaml", "--speculative", "medusa"])
    with pytest.raises(SystemExit, match="--speculative: method"):
        _engine_config(bad)


def test_metrics_and_model_info_report_it(root, capsys):
    path = root / "spec.yaml"
    path.write_text(graph(root))
    config = ServerConfig(engine=EngineConfig(pool_bytes=8 << 20, fast_linear=False))

    def proposed(text: str) -> float:
        (line,) = [x for x in text.splitlines() if x.startswith("trae_llm_spec_proposed_tokens_")]
        return float(line.split()[-1])

    with ServerThread(create_app([path], config)) as server:
        words = "the cat sat on the mat " * 4
        body = {"model": "spec/llm", "prompt": words + "the cat", "max_tokens": 16}
        url = f"{server.url}/v1/completions"
        out = httpx.post(url, json={**body, "speculative": False}, timeout=60)
        assert out.status_code == 200
        assert proposed(httpx.get(f"{server.url}/metrics").text) == 0  # opted out
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        text = httpx.get(f"{server.url}/metrics").text
    assert proposed(text) > 0
    assert "trae_llm_spec_acceptance_rate{" in text
    assert "trae_llm_spec_drafting_seconds_total{" in text
    assert main(["model", "info", str(path), "--json"]) == 0
    (info,) = json.loads(capsys.readouterr().out)["speculative"].values()
    assert info["spec_num_tokens"] == 3 and info["spec_proposed_tokens"] == 0  # just loaded
    assert main(["model", "info", str(path)]) == 0
    assert "speculative decoding: " in capsys.readouterr().out


DRAFT_GRAPH = """\
name: drafted
models:
  llm:
    source: {root}/llm
    task: generate
    speculative: {{method: draft, draft: {draft}, num_tokens: 3}}
  small: {{source: {root}/{small}, task: generate}}
inputs: {{text: str}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 16}}}}
outputs: {{said: say.text}}
"""


def test_a_draft_model_of_the_graph_drafts_in_the_same_pool(root):
    build_llm(root / "small", "llama", num_hidden_layers=1)
    spec = load_graph_text(DRAFT_GRAPH.format(root=root, draft="small", small="small"), "d.yaml")
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    try:
        rt.bind(spec)
        rt.start()
        worker = rt.engine.llms["llm"]
        assert worker.speculator.drafter is not None
        rt.engine.generate([PROMPT] * 2, SamplingParams(max_tokens=16), model="llm")
        assert worker.speculator.counters.proposed > 0
        assert rt.engine.pool.stats().used_pages == 0
    finally:
        rt.shutdown()


@pytest.mark.parametrize(
    "draft,message",
    [
        ("smal", "unknown draft model 'smal' (did you mean 'small'?)"),
        ("llm", "model 'llm' cannot be its own draft model"),
    ],
)
def test_a_bad_draft_model_is_refused_at_load_with_its_line(root, draft, message):
    text = DRAFT_GRAPH.format(root=root, draft=draft, small="small")
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(text, "d.yaml")
    assert "d.yaml:6" in str(err.value) and message in str(err.value), str(err.value)


def test_a_draft_model_with_another_tokenizer_is_refused_with_its_line(root):
    build_llm(root / "words", "llama", tokenizer=build_word_tokenizer)
    spec = load_graph_text(DRAFT_GRAPH.format(root=root, draft="small", small="words"), "d.yaml")
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    try:
        with pytest.raises(GraphValidationError) as err:
            rt.bind(spec)
        assert "d.yaml:6" in str(err.value) and "has another tokenizer" in str(err.value)
    finally:
        rt.shutdown()
