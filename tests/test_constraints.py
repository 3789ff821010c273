"""engine/constraints.py: outputs that must match a JSON Schema, a regex, a choice."""

from __future__ import annotations

import json
import re

import pytest

from trae_groups.engine import EngineConfig, LLMEngine, RequestError, SamplingParams
from trae_groups.engine.constraints import Constraint

SCHEMA = {
    "type": "object",
    # bounded, so that a random tiny model finishes (a digit always fits an open integer)
    "properties": {
        "order_id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "urgent": {"type": "boolean"},
    },
    "required": ["order_id", "urgent"],
    "additionalProperties": False,
}
PROMPTS = ["hello world", "Order 1234 has not arrived", "the quick brown fox", "please refund me"]


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = LLMEngine({"m": llama_dir}, EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    yield eng
    eng.shutdown()


def test_json_schema_regex_and_choice_hold(engine):
    params = [
        SamplingParams(max_tokens=80, constraint=Constraint.json_schema(SCHEMA)),
        SamplingParams(max_tokens=20, constraint=Constraint("regex", r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(max_tokens=20, constraint=Constraint.choice(["refund", "track order"])),
        SamplingParams(
            max_tokens=80, temperature=1.0, seed=3, constraint=Constraint.json_schema(SCHEMA)
        ),
    ]
    outs = engine.generate(PROMPTS, params)
    for out in (outs[0], outs[3]):
        data = json.loads(out.text)
        assert set(data) == {"order_id", "urgent"}
        assert isinstance(data["order_id"], int) and isinstance(data["urgent"], bool)
        assert out.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].text)
    assert outs[2].text in ("refund", "track order")


def test_unconstrained_rows_are_untouched_by_constrained_ones(engine):
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate(PROMPTS, plain)
    constrained = SamplingParams(max_tokens=12, constraint=Constraint("regex", "[a-z ]+"))
    mixed = engine.generate(PROMPTS + PROMPTS, [plain] * 4 + [constrained] * 4)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]


def test_constraints_survive_preemption(llama_dir):
    # 12 pages of 16 tokens (512 B/token): 12 sequences of ~10 + 40 tokens cannot all fit
    config = EngineConfig(pool_bytes=12 * 8192, enable_prefix_cache=False, fast_linear=False)
    eng = LLMEngine({"m": llama_dir}, config)
    try:
        params = SamplingParams(max_tokens=40, constraint=Constraint("regex", "[a-z]{40}"))
        outs = eng.generate([f"{PROMPTS[i % 4]} {i}" for i in range(12)], params)
        assert eng.llms["m"].scheduler.num_preemptions > 0
        assert all(re.fullmatch("[a-z]{40}", o.text) for o in outs)
        assert eng.pool.stats().used_pages == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "kind, spec",
    [("regex", "(unclosed"), ("json_schema", "{not json"), ("json_schema", "[1, 2]"),
     ("choice", "[]"), ("choice", '["a", 1]'), ("grammar", "start: nope_rule"), ("xml", "x")],
)  # fmt: skip
def test_bad_constraints_are_refused_naming_the_field(kind, spec):
    with pytest.raises(RequestError) as err:
        Constraint(kind, spec)
    assert err.value.field == "constraint"


def test_one_compiled_matcher_per_constraint(engine):
    grammars = engine.llms["m"].grammars()
    constraint = Constraint.choice(["yes", "no"])
    first, second = grammars.matcher(constraint), grammars.matcher(constraint)
    assert first is not second  # each sequence gets its own state
    assert list(grammars._compiled).count(constraint) == 1


def test_32_concurrent_requests_with_different_schemas_beside_unconstrained_ones(engine):
    fields = ["a", "b", "c", "d"]
    schemas = [
        {"type": "object", "properties": {fields[i % 4]: {"type": "integer", "minimum": 0,
         "maximum": 10 ** (1 + i % 3)}}, "required": [fields[i % 4]], "additionalProperties": False}
        for i in range(16)
    ]  # fmt: skip
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    params = [SamplingParams(max_tokens=60, constraint=Constraint.json_schema(s)) for s in schemas]
    outs = engine.generate(prompts, params + [plain] * 16)
    for schema, out in zip(schemas, outs[:16], strict=True):
        (field,) = schema["required"]
        value = json.loads(out.text)[field]
        assert isinstance(value, int) and 0 <= value <= schema["properties"][field]["maximum"]
    alone = engine.generate(prompts[16:], plain)
    assert [o.token_ids for o in outs[16:]] == [o.token_ids for o in alone]


def test_a_word_level_tokenizer_with_a_fuse_decoder_gets_a_vocabulary(tmp_path):
    import llguidance.hf

    from conftest import build_word_tokenizer
    from trae_groups.engine.constraints import Grammars, fill_masks

    tokenizer = build_word_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="decoder type"):  # why the fallback exists
        llguidance.hf.from_tokenizer(tokenizer, n_vocab=512)
    grammars = Grammars(tokenizer, 512, {tokenizer.eos_token_id})
    matcher = grammars.matcher(Constraint.json_schema(SCHEMA))
    written: list[int] = []
    for _ in range(60):  # bounded: the schema's longest text is far shorter
        mask = fill_masks([matcher], grammars.words())[0]
        allowed = [t for t in range(512) if (int(mask[t // 32]) >> (t % 32)) & 1]
        token = max(allowed)  # any allowed token keeps the text inside the schema
        if token == tokenizer.eos_token_id:
            break
        assert matcher.consume_token(token)
        written.append(token)
    data = json.loads(tokenizer.decode(written))
    assert set(data) == {"order_id", "urgent"} and isinstance(data["urgent"], bool)
