"""Sampling ranges have one home (engine/sampling.py ``BOUNDS``), and an out-of-range
value is refused once, where it enters: by the loader (file:line and node), by
``trae validate`` (exit 1), and by the OpenAI routes (422 naming the field).
The schemas that clients and docs read show exactly those limits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from conftest import build_llm
from trae_groups.engine import EngineConfig
from trae_groups.engine.errors import RequestError
from trae_groups.engine.sampling import BOUNDS, Bound, SamplingParams
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.nodes import GenerateParams
from trae_groups.serving.openai_api import ChatCompletionRequest, CompletionRequest
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

#: Out of range, each just past a limit a user might think is in.
BAD = {"temperature": 150, "min_p": 1.0, "repetition_penalty": 20, "top_p": 0, "max_tokens": 0}
MODELS = {"GenerateParams": GenerateParams, "ChatCompletionRequest": ChatCompletionRequest,
          "CompletionRequest": CompletionRequest}  # fmt: skip
#: The models that take a BOUNDS entry under its own name, where not all three do.
#: ``logprobs``: chat's ``top_logprobs`` carries its bound, completions' ``logprobs`` is
#: OpenAI's legacy 0..5; ``prompt_logprobs`` and ``logit_bias`` (a map) are no field.
TAKEN_BY = {
    "logprobs": (),
    "prompt_logprobs": (),
    "logit_bias": (),
    "n": ("ChatCompletionRequest", "CompletionRequest"),
    "best_of": ("CompletionRequest",),
}
NOT_EXPOSED = {name for name, models in TAKEN_BY.items() if not models}

HEAD = """\
name: g
models:
  llm: {source: ./llm, task: generate}
inputs: {text: str}
nodes:
"""  # nodes start on line 6


def graph_with(values: dict[str, object]) -> tuple[str, dict[str, int]]:
    """One generate node per value; returns the YAML and each node's params line."""
    lines, where = [], {}
    for i, (name, value) in enumerate(values.items()):
        node = f"n{i}"
        lines += [f"  {node}:", "    model: llm", '    prompt: "{{ inputs.text }}"']
        lines.append(f"    params: {{{name}: {value}}}")
        where[name] = HEAD.count("\n") + len(lines)
    outputs = ", ".join(f"o{i}: n{i}.text" for i in range(len(values)))
    return HEAD + "\n".join(lines) + f"\noutputs: {{{outputs}}}\n", where


@pytest.mark.parametrize(("name", "value"), list(BAD.items()))
def test_the_loader_refuses_an_out_of_range_value_with_file_line_and_node(name, value):
    text, where = graph_with({name: value})
    with pytest.raises(GraphValidationError) as caught:
        load_graph_text(text, "g.yaml")
    (issue,) = caught.value.issues
    assert (issue.file, issue.line, issue.node) == ("g.yaml", where[name], "n0")
    assert issue.message.startswith(f"params.{name}: ")


def test_trae_validate_refuses_every_out_of_range_value_and_exits_1(tmp_path):
    text, where = graph_with(BAD)
    (tmp_path / "g.yaml").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "trae_groups.cli", "validate", "--skip-models", "g.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == len(BAD), done.stderr
    for i, name in enumerate(BAD):
        assert any(
            line.startswith(f"g.yaml:{where[name]}: node 'n{i}': params.{name}: ") for line in lines
        ), (name, lines)


def _edges(bound: Bound) -> list[float]:
    """Values at and around each limit."""
    values = [0.5, 1, 3]
    for limit in (bound.low, bound.high):
        if limit is not None:
            step = 1 if bound.integer else 1e-3
            values += [limit - step, limit, limit + step]
    return [int(v) if bound.integer else float(v) for v in values]


@pytest.mark.parametrize("name", sorted(set(BOUNDS) - NOT_EXPOSED))
def test_spec_openai_and_engine_admit_the_same_values(name):
    bound = BOUNDS[name]
    models = [MODELS[m] for m in TAKEN_BY.get(name, MODELS)]
    for value in _edges(bound):
        admitted = bound.admits(value)
        for model in models:
            body = {name: value} if model is GenerateParams else {"model": "m", name: value}
            if model is ChatCompletionRequest:
                body["messages"] = [{"role": "user", "content": "hi"}]
            if model is CompletionRequest:
                body["prompt"] = "hi"
            try:
                model.model_validate(body)
                taken = True
            except ValidationError:
                taken = False
            assert taken == admitted, (model.__name__, name, value)
        try:
            SamplingParams(**{name: value})
            taken = True
        except RequestError:
            taken = False
        assert taken == admitted, ("SamplingParams", name, value)


def _numeric(schema: dict) -> dict:
    """The numeric branch of a property schema (``int | None`` is an anyOf)."""
    if "anyOf" in schema:
        (schema,) = [s for s in schema["anyOf"] if s.get("type") in ("integer", "number")]
    return schema


def _limits(bound: Bound) -> dict:
    out: dict = {"type": "integer" if bound.integer else "number"}
    if bound.low is not None:
        out["minimum" if bound.low_inclusive else "exclusiveMinimum"] = bound.low
    if bound.high is not None:
        out["maximum" if bound.high_inclusive else "exclusiveMaximum"] = bound.high
    return out


SCHEMAS = {
    "GenerateParams": GenerateParams.model_json_schema(),
    "ChatCompletionRequest": ChatCompletionRequest.model_json_schema(),
    "CompletionRequest": CompletionRequest.model_json_schema(),
}


@pytest.mark.parametrize("schema", list(SCHEMAS))
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_every_bound_is_what_the_schemas_show(schema, name):
    properties = SCHEMAS[schema]["properties"]
    if schema not in TAKEN_BY.get(name, MODELS):
        assert (
            name not in properties or name == "logprobs" or not _numeric_or_none(properties[name])
        )
        return
    shown = _numeric(properties[name])
    if (schema, name) == ("CompletionRequest", "max_tokens"):
        assert shown["minimum"] == 0  # 0 with echo scores the prompt only; else refused
        shown = {**shown, "minimum": BOUNDS[name].low}
    assert {k: shown[k] for k in _limits(BOUNDS[name]) if k in shown} == _limits(BOUNDS[name])
    assert set(shown) & {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"} == (
        set(_limits(BOUNDS[name])) - {"type"}
    )
    if name == "max_tokens" and schema != "GenerateParams":  # OpenAI: null = the default
        assert properties[name]["default"] is None
    else:
        assert properties[name].get("default") == getattr(SamplingParams(), name)


def _numeric_or_none(schema: dict) -> bool:
    branches = schema.get("anyOf", [schema])
    return any(s.get("type") in ("integer", "number") for s in branches)


def test_openai_max_completion_tokens_has_the_max_tokens_bound():
    properties = SCHEMAS["ChatCompletionRequest"]["properties"]
    assert _numeric(properties["max_completion_tokens"]) == _numeric(properties["max_tokens"])


def test_chat_top_logprobs_has_the_logprobs_bound():
    shown = _numeric(SCHEMAS["ChatCompletionRequest"]["properties"]["top_logprobs"])
    assert {k: v for k, v in shown.items() if k != "type"} == {
        k: v for k, v in _limits(BOUNDS["logprobs"]).items() if k != "type"
    }


# ---------------------------------------------------------------- the OpenAI routes

WRITER = """
name: w
models:
  writer: {{source: {root}/llm, task: generate}}
inputs: {{text: str}}
nodes:
  say: {{model: writer, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
outputs: {{said: say.text}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("ranges")
    build_llm(root / "llm", "llama")
    (root / "w.yaml").write_text(textwrap.dedent(WRITER.format(root=root)))
    config = ServerConfig(engine=EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    with ServerThread(create_app([root / "w.yaml"], config)) as running:
        yield running


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_the_openai_routes_refuse_out_of_range_values_naming_the_field(server, route):
    base = {"model": "writer"}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if route == "chat/completions" else {}
    base |= {"prompt": "hi"} if route == "completions" else {}
    for name, value in BAD.items():
        answer = httpx.post(f"{server.url}/v1/{route}", json={**base, name: value}, timeout=60)
        assert answer.status_code == 422, (name, answer.text)
        error = answer.json()["error"]
        assert error["param"] == name, error
        assert error["message"].startswith(f"{name}: "), error
    ok = httpx.post(f"{server.url}/v1/{route}", json={**base, "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200, ok.text
