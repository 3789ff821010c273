"""Weight and KV options of a graph file reach their effect: ``quantization``, ``dtype: auto``
with the accuracy gate, ``max_accuracy_drop``; checked at load with file and line; shown by
``trae model info``."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from conftest import build_encoder
from trae_groups.cli import main
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.hardware import Hardware
from trae_groups.engine.quant import Int8Linear, int8_available
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime

pytestmark = pytest.mark.skipif(not int8_available(), reason="no fbgemm/x86 int8 kernels")

GRAPH = """\
name: quant
models:
  intent: {{source: {intent}, task: classify, quantization: {intent_q}}}
  dialog: {{source: {dialog}, task: generate, {dialog_opts}}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "Intent: {{{{ intent.label }}}}. User: {{{{ inputs.text }}}}"
    params: {{max_tokens: 4, temperature: 0}}
outputs: {{intent: intent.label, reply: reply.text}}
"""


@pytest.fixture(scope="module")
def intent_dir(tmp_path_factory):
    return build_encoder(tmp_path_factory.mktemp("q") / "intent", "classify", ["a", "b", "c"])


def graph(intent_dir, llama_dir, intent_q="int8", dialog_opts="quantization: int8") -> str:
    return GRAPH.format(intent=intent_dir, dialog=llama_dir, intent_q=intent_q,
                        dialog_opts=dialog_opts)  # fmt: skip


def serve(text: str, hardware: Hardware | None = None, dtype: str = "float32"):
    spec = load_graph_text(text, "quant.yaml")
    config = EngineConfig(pool_bytes=8 << 20, dtype=dtype)
    runtime = ModelRuntime.for_specs([spec], config, hardware=hardware)
    executor = runtime.bind(spec)
    runtime.start()
    return runtime, executor


def test_quantization_int8_reaches_both_models_and_they_answer(intent_dir, llama_dir):
    runtime, executor = serve(graph(intent_dir, llama_dir))
    try:
        result = asyncio.run(executor.run({"text": "hello where is my order"}))
        assert result.outputs["intent"] in {"a", "b", "c"} and result.outputs["reply"]
        assert type(runtime.engine.llms["dialog"].model.lm_head) is Int8Linear
        assert {r.name: r.quantize for r in runtime.store.report()} == {
            "intent": "int8",
            "dialog": "int8",
        }
        assert runtime.engine.pool.stats().used_pages == 0
    finally:
        runtime.shutdown()


def test_auto_picks_by_the_injected_hardware_and_records_why(intent_dir, llama_dir):
    text = graph(intent_dir, llama_dir, intent_q="auto",
                 dialog_opts="dtype: auto, max_accuracy_drop: 0.05")  # fmt: skip
    runtime, executor = serve(text, Hardware("cpu", frozenset({"avx512_vnni", "avx512_bf16"})))
    try:
        reports = {r.name: r for r in runtime.store.report()}
        assert set(reports) == {"intent", "dialog"}  # the gate's float references are gone
        assert reports["intent"].quantize == "int8"
        assert reports["intent"].choice.startswith("int8 (cpu avx512_bf16+avx512_vnni")
        assert "label agreement" in reports["intent"].choice
        assert (reports["dialog"].dtype, reports["dialog"].quantize) == ("bfloat16", None)
        assert "gate passed: perplexity" in reports["dialog"].choice
        worker = runtime.engine.llms["dialog"]
        assert worker.kv.layout.dtype == torch.bfloat16  # KV follows the model's dtype
        result = asyncio.run(executor.run({"text": "hello"}))
        assert result.outputs["reply"]
    finally:
        runtime.shutdown()
    # without bf16 or VNNI in the hardware description, auto keeps float32
    runtime, _ = serve(text, Hardware("cpu"))
    try:
        reports = {r.name: r for r in runtime.store.report()}
        assert (reports["dialog"].dtype, reports["intent"].quantize) == ("float32", None)
        assert reports["dialog"].choice == "float32 (float reference)"
    finally:
        runtime.shutdown()


def test_model_info_shows_what_was_chosen(intent_dir, llama_dir, tmp_path, capsys):
    path = tmp_path / "quant.yaml"
    path.write_text(graph(intent_dir, llama_dir, intent_q="auto"))
    assert main(["model", "info", str(path), "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert models["dialog"]["quantize"] == "int8" and models["dialog"]["chosen"] is None
    assert models["intent"]["chosen"]  # detected hardware: whatever it was, it says why


@pytest.mark.parametrize(
    "options,line,message",
    [
        ("quantization: int4", 4, "quantization"),
        ("quantization: int8, dtype: bfloat16", 4, "int8 runs from float32 weights"),
        ("max_accuracy_drop: 0.05", 4, "is for an 'auto' dtype or quantization"),
        ("dtype: auto, eval_set: e.jsonl", 4, "eval_set is for classify models"),
        ("dtype: auto, max_accuracy_drop: 2", 4, "max_accuracy_drop"),
    ],
)
def test_bad_weight_options_are_refused_at_load_with_their_line(
    intent_dir, llama_dir, options, line, message
):
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(graph(intent_dir, llama_dir, dialog_opts=options), "quant.yaml")
    text = str(err.value)
    assert f"quant.yaml:{line}" in text and message in text and "dialog" in text


def test_a_classifier_with_an_eval_set_is_gated_on_its_held_out_accuracy(
    intent_dir, llama_dir, tmp_path
):
    from trae_groups.engine.errors import ModelLoadError
    from trae_groups.graphs.loader import load_graph

    rows = [{"text": t, "label": lab} for t, lab in
            [("hello world", "a"), ("where is my order", "b"), ("cheap pills", "c")] * 4]  # fmt: skip
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = graph(intent_dir, llama_dir, intent_q="auto") + ""
    text = text.replace("quantization: auto}", "quantization: auto, eval_set: eval.jsonl}")
    (tmp_path / "quant.yaml").write_text(text)
    spec = load_graph(tmp_path / "quant.yaml")  # eval.jsonl counts from the graph's folder
    runtime = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20),
                                     hardware=Hardware("cpu", frozenset({"avx512_vnni"})))  # fmt: skip
    try:
        runtime.bind(spec)
        intent = {r.name: r for r in runtime.store.report()}["intent"]
        assert intent.quantize == "int8"
        assert "held-out accuracy" in intent.choice and "on 12 examples" in intent.choice
    finally:
        runtime.shutdown()
    (tmp_path / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n{not json\n")
    runtime = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=8 << 20),
                                     hardware=Hardware("cpu", frozenset({"avx512_vnni"})))  # fmt: skip
    try:
        with pytest.raises(ModelLoadError, match=r"eval\.jsonl.*'intent': eval_set: line 2"):
            runtime.bind(spec)
    finally:
        runtime.shutdown()


def test_an_auto_engine_dtype_reaches_models_that_set_none(intent_dir, llama_dir):
    """``EngineConfig(dtype="auto")`` (trae serve's default) is ``dtype: auto`` for every model
    whose graph sets no dtype; one that sets its own keeps it."""
    text = graph(intent_dir, llama_dir, intent_q="none", dialog_opts="max_tokens_limit: 64")
    bf16 = Hardware("cpu", frozenset({"avx512_bf16"}))
    runtime, _ = serve(text, bf16, dtype="auto")
    try:
        reports = {r.name: r for r in runtime.store.report()}
        assert reports["dialog"].dtype == "bfloat16" and "gate passed" in reports["dialog"].choice
        assert reports["intent"].dtype == "bfloat16"
    finally:
        runtime.shutdown()
    runtime, _ = serve(text.replace("max_tokens_limit: 64", "dtype: float32"), bf16, "auto")
    try:
        reports = {r.name: r for r in runtime.store.report()}
        assert reports["dialog"].dtype == "float32" and reports["intent"].dtype == "bfloat16"
    finally:
        runtime.shutdown()


def test_trae_serve_defaults_to_auto_and_other_commands_to_float32(llama_dir):
    from trae_groups import cli
    from trae_groups.engine.engine import LLMEngine
    from trae_groups.engine.hardware import detect

    parser = cli.build_parser()
    assert cli._engine_config(parser.parse_args(["serve", "g.yaml"])).dtype == "auto"
    assert cli._engine_config(parser.parse_args(["run", "g.yaml"])).dtype == "float32"
    served = parser.parse_args(["serve", "g.yaml", "--dtype", "float32"])
    assert cli._engine_config(served).dtype == "float32"
    # an engine given a folder directly chooses the same way, by the detected hardware
    engine = LLMEngine({"m": str(llama_dir)}, EngineConfig(pool_bytes=8 << 20, dtype="auto"))
    hw = detect("cpu")
    expected = torch.bfloat16 if hw.bf16_math or hw.bf16_panels else torch.float32
    assert next(engine.llm("m").model.parameters()).dtype == expected
    out = engine.generate([[1, 2, 3]], None)[0]
    assert out.finished and out.token_ids
