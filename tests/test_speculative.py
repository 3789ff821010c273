"""Speculative decoding (engine/speculative.py, engine/verify.py): greedy output identical to
transformers' generate and to the engine without speculation, through chunked prefill,
preemption, the prefix cache, constrained and LoRA rows; pages of rejected proposals given
back; the per-request opt-out and the batch-size switch."""

from __future__ import annotations

import random

import pytest
from test_engine import assert_parity, engine

from conftest import LLM_FAMILIES, LORA_VARIANTS, build_llm, build_lora
from trae_groups.engine.constraints import Constraint
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.spec_config import SpeculativeConfig
from trae_groups.engine.speculative import REST_STEPS, SpecState, Speculator, ngram_propose

MAX_NEW = 24
NGRAM = SpeculativeConfig(num_tokens=4)


def repetitive(n=8, seed=0, vocab=500) -> list[list[int]]:
    """Prompts that repeat a short pattern (and end inside it): prompt lookup finds it."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pattern = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 8))]
        head = [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 6))]
        out.append(head + pattern * rng.randrange(2, 5) + pattern[: rng.randrange(2, 4)])
    return out


def spec_counters(eng, model="m"):
    return eng.llms[model].speculator.counters


def assert_exercised(counters) -> None:
    """Proposals were verified, some kept and some rejected: both paths ran."""
    assert counters.proposed > 0
    assert 0 < counters.accepted < counters.proposed


# -- the proposer ---------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert ngram_propose([5, 1, 2, 6, 4, 1, 2], 3) == [6, 4, 1]
    # the 3-token suffix [4, 1, 2] beats the later 2-token match [1, 2]
    assert ngram_propose([4, 1, 2, 9, 9, 1, 2, 8, 4, 1, 2], 1) == [9]
    assert ngram_propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert ngram_propose([7, 7], 3) == []  # too short to hold a match and a suffix
    assert ngram_propose([1, 2, 1, 2], 5) == [1, 2]  # no more than there is


# -- greedy exactness -----------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(LLM_FAMILIES))
def test_greedy_output_is_generates_with_ngram_speculation(llm_dirs, family):
    path = llm_dirs[family]
    ps = repetitive(seed=sorted(LLM_FAMILIES).index(family))
    with engine({"m": path}, speculative=NGRAM) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert_exercised(spec_counters(eng))
        assert eng.pool.stats().used_pages == 0
    assert_parity(path, outs, ps, MAX_NEW)


def test_same_tokens_and_logprobs_as_without_speculation(llama_dir):
    ps = repetitive(n=6, seed=11)
    params = SamplingParams(max_tokens=MAX_NEW, logprobs=2, repetition_penalty=1.02)
    with engine({"m": llama_dir}) as plain:
        want = plain.generate(ps, params)
    with engine({"m": llama_dir}, speculative=NGRAM) as eng:
        got = eng.generate(ps, params)
        assert_exercised(spec_counters(eng))
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert [set(t) for t in g.top_logprobs] == [set(t) for t in w.top_logprobs]


def test_chunked_prefill_with_a_tiny_budget(llama_dir):
    ps = repetitive(seed=1)
    with engine({"m": llama_dir}, max_num_batched_tokens=7, speculative=NGRAM) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert max(eng.llms["m"].counters.batch_tokens) <= 7  # proposals count in the budget
        assert_exercised(spec_counters(eng))
    assert_parity(llama_dir, outs, ps, MAX_NEW)


def test_preemption_keeps_outputs_and_gives_every_page_back(llama_dir):
    ps = repetitive(n=10, seed=2)
    # 512 B/token for the tiny llama, 16 tokens a page: 12 pages cannot hold 10 sequences
    cfg = dict(pool_bytes=12 * 8192, enable_prefix_cache=False, speculative=NGRAM)
    with engine({"m": llama_dir}, **cfg) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert eng.llms["m"].scheduler.num_preemptions > 0
        assert_exercised(spec_counters(eng))
        assert eng.pool.stats().used_pages == 0
    assert_parity(llama_dir, outs, ps, MAX_NEW)


def test_the_prefix_cache_keeps_only_verified_tokens(llama_dir):
    system = repetitive(n=1, seed=9)[0] * 3
    ps = [system + tail for tail in repetitive(n=6, seed=4)]
    with engine({"m": llama_dir}, speculative=NGRAM) as eng:
        first = eng.generate(ps[:1], SamplingParams(max_tokens=MAX_NEW))
        rest = eng.generate(ps[1:], SamplingParams(max_tokens=MAX_NEW))
        assert eng.pool.stats().prefix_hits > 0
        assert_exercised(spec_counters(eng))
        page = eng.llms["m"].kv.tokens_per_page
        finals = [p + o.token_ids for p, o in zip(ps, first + rest, strict=True)]
        blocks = {tuple(t[i : i + page]) for t in finals for i in range(0, len(t) - page + 1, page)}
        published = [key[2] for key in eng.pool._key_page]  # (model, parent, block tokens)
        assert published and all(block in blocks for block in published)
    assert_parity(llama_dir, first + rest, ps, MAX_NEW)


def test_rejected_proposals_give_their_pages_back(llama_dir):
    with engine({"m": llama_dir}, speculative=SpeculativeConfig(num_tokens=16)) as eng:
        worker = eng.llms["m"]
        page = worker.kv.tokens_per_page
        seen: list[tuple[int, int]] = []
        settle = worker.scheduler.settle

        def checked(seq):
            settle(seq)
            seen.append((len(seq.pages), seq.num_tokens))

        worker.scheduler.settle = checked
        eng.generate(repetitive(n=4, seed=3), SamplingParams(max_tokens=40))
        # pages up to the newest token at most (its slot comes with the next step)
        assert seen and all(
            -(-(tokens - 1) // page) <= pages <= -(-tokens // page) for pages, tokens in seen
        )
        assert eng.pool.stats().used_pages == 0


def test_constrained_rows_do_not_speculate_and_keep_their_output(llama_dir):
    ps = repetitive(n=4, seed=5)
    constrained = SamplingParams(max_tokens=12, constraint=Constraint("regex", "[a-z]{12}"))
    plain = SamplingParams(max_tokens=MAX_NEW)
    params = [constrained, plain] * 2
    with engine({"m": llama_dir}) as base:
        want = base.generate(ps, params)
    with engine({"m": llama_dir}, speculative=NGRAM) as eng:
        got = eng.generate(ps, params)
        counters = spec_counters(eng)
        assert counters.off_rows["constrained"] > 0 and counters.proposed > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.fixture(scope="module")
def llama_loras(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_loras")
    return {
        name: build_lora(root / name, llama_dir, seed=i, **kw)
        for i, (name, kw) in enumerate(LORA_VARIANTS.items())
    }


def test_lora_rows_speculate_with_their_adapter(llama_dir, llama_loras):
    from test_lora import MAX_NEW as LORA_NEW
    from test_lora import assert_parity as lora_parity
    from test_lora import engine as lora_engine
    from test_lora import mixed

    base, adapters = llama_dir, llama_loras
    ps, names = mixed(repetitive(n=3, seed=6), list(adapters))
    every_batch = SpeculativeConfig(num_tokens=4, max_batch=64)  # 12 rows speculate too
    with lora_engine(base, adapters, speculative=every_batch) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=LORA_NEW), adapters=names)
        assert_exercised(spec_counters(eng))
        assert eng.pool.stats().used_pages == 0
    lora_parity(base, adapters, outs, ps, names)


# -- who speculates -------------------------------------------------------------------------


def test_a_request_can_opt_out(llama_dir):
    ps = repetitive(n=3, seed=7)
    with engine({"m": llama_dir}, speculative=NGRAM) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW, speculative=False))
        counters = spec_counters(eng)
        assert counters.proposed == 0 and counters.off_rows["opted_out"] > 0
    assert_parity(llama_dir, outs, ps, MAX_NEW)


def test_a_large_batch_turns_speculation_off_for_the_step(llama_dir):
    ps = repetitive(n=6, seed=8)
    spec = SpeculativeConfig(num_tokens=4, max_batch=2)
    with engine({"m": llama_dir}, speculative=spec) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert spec_counters(eng).off_steps > 0
    assert_parity(llama_dir, outs, ps, MAX_NEW)


def test_k_adapts_to_what_is_accepted():
    spec = Speculator(SpeculativeConfig(num_tokens=4), max_model_len=256)

    class Seq:
        spec = SpecState(4, 4)

    seq = Seq()
    spec.record(seq, 4, 1)
    assert seq.spec.k == 2  # partly accepted: what was kept plus one
    spec.record(seq, 2, 2)
    assert seq.spec.k == 3  # all kept: one more
    spec.record(seq, 3, 0)
    spec.record(seq, 1, 0)
    assert seq.spec.k == 0 and seq.spec.rest == REST_STEPS  # all failed: rest, then k=1
    assert spec.counters.proposed == 10 and spec.counters.accepted == 3


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="num_tokens: must be an integer in \\[1, 16\\]"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="draft: names the draft model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft: names the draft model"):
        SpeculativeConfig(draft="small")
    with pytest.raises(ValueError, match="method: must be one of"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="max_batch"):
        SpeculativeConfig(max_batch=True)
    assert SpeculativeConfig.parse("ngram:3") == SpeculativeConfig(num_tokens=3)
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig.parse("ngram:x")


# -- a draft model on the same engine ------------------------------------------------------


def draft_engine(target, draft, **cfg):
    spec = SpeculativeConfig(method="draft", draft="draft", num_tokens=3)
    return engine({"draft": draft, "m": target}, speculative=spec, **cfg)


@pytest.mark.parametrize("same_weights", [True, False])
def test_a_draft_model_keeps_greedy_output_exact(llama_dir, tmp_path, same_weights):
    # the same weights: guesses are kept; other weights: mostly rejected
    draft = build_llm(tmp_path / "draft", "llama", seed=0 if same_weights else 5)
    ps = repetitive(n=6, seed=12)
    with draft_engine(llama_dir, draft, pool_bytes=16 << 20) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW), model="m")
        counters = spec_counters(eng)
        assert counters.proposed > 0
        assert (counters.accepted > counters.proposed // 2) == same_weights
        assert eng.llms["draft"].speculator is None  # a draft does not draft for itself
        assert eng.pool.stats().used_pages == 0  # the draft's shadows gave their pages back
    assert_parity(llama_dir, outs, ps, MAX_NEW)


def test_a_draft_model_survives_preemption(llama_dir):
    ps = repetitive(n=8, seed=13)
    with draft_engine(llama_dir, llama_dir, pool_bytes=16 * 8192) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW), model="m")
        assert eng.llms["m"].scheduler.num_preemptions > 0
        assert spec_counters(eng).accepted > 0
        assert eng.pool.stats().used_pages == 0
    assert_parity(llama_dir, outs, ps, MAX_NEW)


def test_a_draft_model_must_be_on_the_engine_with_the_same_vocabulary(llama_dir, tmp_path):
    from trae_groups.engine.errors import ModelLoadError

    spec = SpeculativeConfig(method="draft", draft="small")
    with pytest.raises(ModelLoadError, match="'small' is not on this engine"):
        engine({"m": llama_dir}, speculative=spec)
    other = build_llm(tmp_path / "other", "llama", vocab_size=256)
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        draft_engine(llama_dir, other)
