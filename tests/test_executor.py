"""The graph executor on real tiny models and real python functions."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import anyio
import pytest

from conftest import build_encoder, build_llm
from trae_groups.engine import EngineConfig, SamplingParams
from trae_groups.engine.protocol import EncodeRequest
from trae_groups.graphs.errors import GraphTimeout, NodeError
from trae_groups.graphs.executor import InputError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime

sys.path.insert(0, str(Path(__file__).parent))  # graph_functions

INTENTS = ["greet", "order", "spam"]
TAGS = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph_models")
    return {
        "intent": build_encoder(root / "intent", "classify", INTENTS, seed=3),
        "ner": build_encoder(root / "ner", "tag", TAGS, seed=4),
        "dialog": build_llm(root / "dialog", "llama"),
    }


def support_yaml(dirs, when="intent.label != 'nothing'") -> str:
    return f"""
name: support
models:
  intent: {{source: {dirs["intent"]}, task: classify, max_queue_delay_ms: 20}}
  ner: {{source: {dirs["ner"]}, task: tag, max_queue_delay_ms: 20}}
  dialog: {{source: {dirs["dialog"]}, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  entities: {{model: ner, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    when: "{when}"
    prompt: "Intent: {{{{ intent.label }}}}. Entities: {{{{ entities.spans | map(attribute='text') | join(', ') }}}}. User: {{{{ inputs.text }}}}. Assistant:"
    params: {{max_tokens: 6, temperature: 0}}
outputs: {{intent: intent.label, entities: entities.spans, reply: reply.text, tokens: reply.tokens}}
"""


def runtime_for(spec, **cfg):
    cfg.setdefault("pool_bytes", 8 << 20)
    cfg.setdefault("fast_linear", False)
    rt = ModelRuntime.for_specs([spec], EngineConfig(**cfg))
    executor = rt.bind(spec)
    rt.start()
    return rt, executor


TEXTS = ["hello where is my order", "john wants a refund", "cheap pills buy now",
         "ship to paris please", "hello world", "where is london"]  # fmt: skip


def test_support_graph_batches_every_node_and_matches_models_alone(model_dirs):
    spec = load_graph_text(support_yaml(model_dirs), "support.yaml")
    rt, executor = runtime_for(spec)
    try:
        texts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(64)]

        async def all_at_once():
            return await asyncio.gather(*(executor.run({"text": t}) for t in texts))

        results = asyncio.run(all_at_once())
        models = rt.stats().models
        assert max(models["intent"].batch_sizes) > 1
        assert max(models["ner"].batch_sizes) > 1
        dialog = rt.engine.llms["dialog"]
        assert max(dialog.counters.batch_tokens) > 1 + 20  # several prompts per step
        assert rt.engine.pool.stats().used_pages == 0
        # each model alone, one request at a time, gives the same answers
        intent = executor.clients["intent"]

        async def alone(text):
            label = await intent.encode(EncodeRequest(text, "solo", priority=_p()))
            return label["label"]

        for text, result in zip(texts[:8], results[:8], strict=True):
            assert set(result.nodes) == {"intent", "entities", "reply"}
            assert all(r.status == "ok" for r in result.nodes.values())
            assert result.outputs["intent"] == asyncio.run(alone(text))
            prompt = (
                f"Intent: {result.outputs['intent']}. Entities: "
                f"{', '.join(s['text'] for s in result.outputs['entities'])}. User: {text}. Assistant:"
            )
            params = SamplingParams(max_tokens=6, logprobs=2)
            solo = rt.engine.generate([prompt], params, model=dialog.name)[0]
            if result.outputs["reply"] != solo.text:  # only a near-tie may flip (fp32 order)
                apart = _first_token_apart(
                    dialog.tokenizer, solo.token_ids, result.outputs["reply"]
                )
                assert _margin(solo.top_logprobs[apart]) < NEAR_TIE, (result.outputs, solo.text)
                continue
            assert result.outputs["tokens"] == len(solo.token_ids)
    finally:
        rt.shutdown()


#: Batched and solo steps of one model sum in different orders: logprobs differ by ~1e-6
#: here (fp32), so a greedy pick can flip only where two tokens are this close.
NEAR_TIE = 1e-3


def _margin(top: dict[int, float]) -> float:
    """How far the greedy pick's logprob is ahead of the runner-up's."""
    best, second = sorted(top.values(), reverse=True)[:2]
    return best - second


def _first_token_apart(tokenizer, ids: list[int], text: str) -> int:
    """The first of ``ids`` whose text leaves ``text`` (another run's reply)."""
    for k in range(1, len(ids) + 1):
        if not text.startswith(tokenizer.decode(ids[:k], skip_special_tokens=True)):
            return k - 1
    return len(ids) - 1  # ``text`` runs on past the last of ``ids``


def _p():
    from trae_groups.engine import Priority

    return Priority()


PY_GRAPH = """
name: glue
inputs: {text: str, flag: {type: bool, default: true}}
nodes:
  upper: {function: "graph_functions:shout", args: {text: "{{ inputs.text }}"}}
  docs: {function: "graph_functions:retrieve", args: {query: "{{ inputs.text }}"}}
  both:
    function: "graph_functions:join"
    args: {a: "{{ upper }}", b: "{{ docs[0].title }}"}
  gated:
    function: "graph_functions:shout"
    when: "inputs.flag"
    args: {text: "gate"}
  after_gate:
    function: "graph_functions:shout"
    args: {text: "{{ gated }}"}
  tolerant:
    function: "graph_functions:shout"
    optional: [gated]
    args: {text: "{{ gated or 'none' }}"}
outputs:
  upper: upper
  both: both.joined
  n: both.n
  gated: gated
  after_gate: after_gate
  tolerant: tolerant
"""


def run_graph(text: str, inputs: dict, **kwargs):
    spec = load_graph_text(text, "g.yaml")
    rt, executor = runtime_for(spec)
    try:
        return asyncio.run(executor.run(inputs, **kwargs)), rt
    finally:
        rt.shutdown()


def test_fan_out_join_and_python_nodes():
    result, _ = run_graph(PY_GRAPH, {"text": "hi"})
    assert result.outputs == {
        "upper": "HI", "both": "HI+doc about hi", "n": len("HI") + len("doc about hi"),
        "gated": "GATE", "after_gate": "GATE", "tolerant": "GATE",
    }  # fmt: skip


def test_skip_rule_propagates_unless_optional():
    result, _ = run_graph(PY_GRAPH, {"text": "hi", "flag": False})
    assert result.outputs["gated"] is None and result.outputs["after_gate"] is None
    assert result.outputs["tolerant"] == "NONE"
    assert result.nodes["gated"].status == "skipped"
    assert result.nodes["after_gate"].reason == "parent 'gated' was skipped"


def test_only_requested_outputs_run():
    result, _ = run_graph(PY_GRAPH, {"text": "hi"}, outputs=["upper"])
    assert result.outputs == {"upper": "HI"} and set(result.nodes) == {"upper"}


ERR_GRAPH = """
name: errs
inputs: {text: str}
nodes:
  boom: {function: "graph_functions:explode", args: {text: "{{ inputs.text }}"}, on_error: POLICY}
  next: {function: "graph_functions:shout", args: {text: "{{ boom or 'fallback' }}"}, optional: [boom]}
outputs: {boom: boom, next: next}
"""


def test_on_error_fail_names_the_node():
    with pytest.raises(NodeError) as err:
        run_graph(ERR_GRAPH.replace("POLICY", "fail"), {"text": "x"})
    assert err.value.node == "boom" and "cannot handle" in str(err.value)


def test_on_error_skip_and_default():
    skipped, _ = run_graph(ERR_GRAPH.replace("POLICY", "skip"), {"text": "x"})
    assert skipped.outputs == {"boom": None, "next": "FALLBACK"}
    assert (
        skipped.nodes["boom"].status == "skipped" and "cannot handle" in skipped.nodes["boom"].error
    )
    graph = ERR_GRAPH.replace("on_error: POLICY", 'on_error: default, default: "dflt"')
    defaulted, _ = run_graph(graph, {"text": "x"})
    assert defaulted.outputs == {"boom": "dflt", "next": "DFLT"}


TIMEOUT_GRAPH = """
name: slow
timeout: GRAPH_T
inputs: {s: float}
nodes:
  a: {function: "graph_functions:slow_async", args: {seconds: "{{ inputs.s }}"}, timeout: NODE_T}
outputs: {a: a}
"""


def test_node_and_graph_timeouts():
    with pytest.raises(GraphTimeout) as err:
        run_graph(TIMEOUT_GRAPH.replace("GRAPH_T", "10").replace("NODE_T", "0.05"), {"s": 5.0})
    assert err.value.node == "a"
    with pytest.raises(GraphTimeout) as err:
        run_graph(TIMEOUT_GRAPH.replace("GRAPH_T", "0.05").replace("NODE_T", "10"), {"s": 5.0})
    assert err.value.node is None
    ok, _ = run_graph(TIMEOUT_GRAPH.replace("GRAPH_T", "10").replace("NODE_T", "10"), {"s": 0.0})
    assert ok.outputs == {"a": "done"}


def test_bad_inputs_name_the_field():
    with pytest.raises(InputError) as err:
        run_graph(PY_GRAPH, {"text": 3})
    assert err.value.field == "text"
    with pytest.raises(InputError) as err:
        run_graph(PY_GRAPH, {"txt": "a"})
    assert err.value.field in ("text", "txt")
    with pytest.raises(InputError) as err:
        run_graph(PY_GRAPH, {"text": "a"}, outputs=["nope"])
    assert err.value.field == "outputs"


def test_cancel_mid_generation_returns_every_page(model_dirs):
    yaml_text = support_yaml(model_dirs).replace("max_tokens: 6", "max_tokens: 200")
    spec = load_graph_text(yaml_text, "support.yaml")
    rt, executor = runtime_for(spec)
    try:
        start = rt.engine.pool.stats().used_pages

        async def cancel_some():
            async with anyio.create_task_group() as group:
                for i in range(6):
                    group.start_soon(executor.run, {"text": f"hello {i}"})
                await anyio.sleep(0.3)
                group.cancel_scope.cancel()

        asyncio.run(cancel_some())
        for _ in range(3000):  # up to 30 s: a loaded machine steps slowly
            if (
                rt.engine.pool.stats().used_pages == start
                and not rt.engine.llms["dialog"].scheduler.has_work()
            ):
                break
            asyncio.run(asyncio.sleep(0.01))
        assert rt.engine.pool.stats().used_pages == start
    finally:
        rt.shutdown()


TWO_REPLIES = """
name: two
models:
  dialog: {{source: {dialog}, task: generate}}
inputs: {{text: str}}
nodes:
  short: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 3}}}}
  long: {{model: dialog, prompt: "User: {{{{ inputs.text }}}}", params: {{max_tokens: 6}}}}
outputs: {{short: short.text, long: long.text}}
"""


def test_two_generate_nodes_of_one_request_on_one_model(model_dirs):
    """Each node's engine work has its own id (request id / node): the second was
    refused as 'already running' when both used the request's id."""
    spec = load_graph_text(TWO_REPLIES.format(dialog=model_dirs["dialog"]), "two.yaml")
    rt, executor = runtime_for(spec)
    try:
        result = asyncio.run(executor.run({"text": "hello world"}))
        assert all(r.status == "ok" for r in result.nodes.values()), result.nodes
        dialog = rt.engine.llms["dialog"]
        for node, prompt, n in (("short", "hello world", 3), ("long", "User: hello world", 6)):
            solo = rt.engine.generate([prompt], SamplingParams(max_tokens=n), model=dialog.name)
            assert result.outputs[node] == solo[0].text
        assert rt.engine.pool.stats().used_pages == 0
    finally:
        rt.shutdown()


def test_stream_events_in_order(model_dirs):
    spec = load_graph_text(support_yaml(model_dirs), "support.yaml")
    rt, executor = runtime_for(spec)
    try:

        async def collect():
            return [e async for e in executor.stream({"text": "hello john"})]

        events = asyncio.run(collect())
    finally:
        rt.shutdown()
    types = [e.type for e in events]
    assert types[-1] == "result"
    tokens = "".join(e.data["text"] for e in events if e.type == "token")
    assert tokens == events[-1].data["outputs"]["reply"]
    started = [e.data["node"] for e in events if e.type == "node_started"]
    assert started.index("reply") > max(started.index("intent"), started.index("entities"))


def test_many_concurrent_mixed_requests_never_mix_results():
    spec = load_graph_text(PY_GRAPH, "g.yaml")
    rt, executor = runtime_for(spec)
    rng = random.Random(0)
    try:
        words = [
            "".join(rng.choice("abcdef") for _ in range(rng.randrange(1, 8))) for _ in range(40)
        ]

        async def go():
            return await asyncio.gather(*(executor.run({"text": w}) for w in words))

        for word, result in zip(words, asyncio.run(go()), strict=True):
            assert result.outputs["upper"] == word.upper()
            assert result.outputs["both"] == f"{word.upper()}+doc about {word}"
    finally:
        rt.shutdown()


def test_dsl_and_yaml_forms_give_equal_results(model_dirs):
    from trae_groups import ModelGroup, load_graph_text

    group = ModelGroup("support")
    group.add_model(
        "intent", path=str(model_dirs["intent"]), task="classify", max_queue_delay_ms=20
    )
    group.add_model("ner", path=str(model_dirs["ner"]), task="tag", max_queue_delay_ms=20)
    group.add_model("dialog", path=str(model_dirs["dialog"]), task="generate")
    text = group.input("text", str)
    intent = group.classify("intent", model="intent", input=text)
    entities = group.tag("entities", model="ner", input=text)
    reply = group.generate(
        "reply",
        model="dialog",
        when="intent.label != 'nothing'",
        prompt=(
            f"Intent: {intent.label}. Entities: "
            "{{ entities.spans | map(attribute='text') | join(', ') }}. "
            f"User: {text}. Assistant:"
        ),
        params={"max_tokens": 6, "temperature": 0},
    )
    group.output("intent", intent.label)
    group.output("entities", entities.spans)
    group.output("reply", reply.text)
    group.output("tokens", reply.tokens)
    yaml_spec = load_graph_text(support_yaml(model_dirs), "support.yaml")
    assert group.spec() == yaml_spec
    try:
        group.load(EngineConfig(pool_bytes=8 << 20, fast_linear=False))
        from_dsl = [group.run({"text": t}).outputs for t in TEXTS[:3]]
    finally:
        group.close()
    rt, executor = runtime_for(yaml_spec)
    try:
        from_yaml = [asyncio.run(executor.run({"text": t})).outputs for t in TEXTS[:3]]
    finally:
        rt.shutdown()
    assert from_dsl == from_yaml


def test_module_level_run_sync_and_async():
    import trae_groups

    spec = load_graph_text(PY_GRAPH, "g.yaml")
    assert trae_groups.run(spec, {"text": "ab"}).outputs["upper"] == "AB"
    result = asyncio.run(trae_groups.arun(spec, {"text": "cd"}, outputs=["both"]))
    assert result.outputs == {"both": "CD+doc about cd"}


def test_heads_on_one_backbone_share_a_worker_and_run_it_once(model_dirs, tmp_path):
    from transformers import BertForTokenClassification

    tagger = BertForTokenClassification.from_pretrained(model_dirs["ner"])
    classifier_dir = model_dirs["intent"]
    from transformers import BertModel

    tagger.bert.load_state_dict(
        BertModel.from_pretrained(classifier_dir).state_dict(), strict=False
    )
    shared_ner = tmp_path / "shared_ner"
    tagger.save_pretrained(shared_ner)
    for f in model_dirs["ner"].glob("*"):
        if "token" in f.name or f.name == "vocab.txt":
            (shared_ner / f.name).write_bytes(f.read_bytes())
    text = f"""
name: heads
models:
  intent: {{source: {classifier_dir}, task: classify, max_queue_delay_ms: 50}}
  ner: {{source: {shared_ner}, task: tag, max_queue_delay_ms: 50}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  entities: {{model: ner, input: "{{{{ inputs.text }}}}"}}
outputs: {{intent: intent.label, spans: entities.spans}}
"""
    spec = load_graph_text(text, "heads.yaml")
    rt, executor = runtime_for(spec)
    try:
        intent, ner = executor.clients["intent"], executor.clients["ner"]
        assert intent.worker is ner.worker
        backbone = intent.worker.runner.primary.model.base_model
        calls = []
        backbone.register_forward_hook(lambda mod, args, out: calls.append(1))

        async def go():
            return await asyncio.gather(*(executor.run({"text": t}) for t in TEXTS))

        results = asyncio.run(go())
        assert len(results) == len(TEXTS) and all(r.outputs["intent"] in INTENTS for r in results)
        assert len(calls) <= 2  # both heads, all texts: one or two backbone batches
    finally:
        rt.shutdown()
