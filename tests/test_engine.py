"""The engine against transformers' own generate: token-exact greedy parity."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import LLM_FAMILIES, build_llm
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.errors import EngineStopped, ModelLoadError, RequestError
from trae_groups.engine.sampling import SamplingParams

MAX_NEW = 16


def prompts(n=16, seed=0, lo=2, hi=60, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


_refs: dict = {}


def reference(path, prompt, max_new=MAX_NEW):
    """transformers' generate, one prompt at a time (no padding to blur the comparison)."""
    key = str(path)
    if key not in _refs:
        _refs[key] = AutoModelForCausalLM.from_pretrained(path).eval()
    model = _refs[key]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def engine(paths, **cfg) -> LLMEngine:
    cfg.setdefault("pool_bytes", 8 << 20)
    cfg.setdefault("fast_linear", False)  # parity runs on the reference path
    return LLMEngine(paths, EngineConfig(**cfg)).start()


def assert_parity(path, outs, ps, max_new=MAX_NEW):
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == reference(path, prompt, max_new), f"prompt of {len(prompt)} tokens"
        assert out.finished and out.finish_reason in ("stop", "length")


def check_decode_path_under_pressure(path, make_engine) -> None:
    """What a fixed-size decode path (compiled, graphs) must keep: greedy parity through
    chunked prefill, preemption and prefix-cache hits. ``make_engine(**config)`` starts an
    engine on ``path`` whose runner has that path."""
    system = prompts(n=1, seed=9, lo=40, hi=41)[0]
    ps = [system + tail for tail in prompts(n=10, seed=6, lo=2, hi=20)]
    # 12 pages of 16 tokens for up to 8 sequences of ~75 tokens: preemption; 24-token budget
    with make_engine(pool_bytes=12 * 8192, max_num_batched_tokens=24) as eng:
        first = eng.generate(ps[:1], SamplingParams(max_tokens=MAX_NEW))
        rest = eng.generate(ps[1:], SamplingParams(max_tokens=MAX_NEW))
        worker = eng.llms["m"]
        assert worker.runner.compiled.steps > 0
        assert worker.scheduler.num_preemptions > 0
        assert eng.pool.stats().prefix_hits > 0
        assert eng.pool.stats().used_pages == 0
    assert_parity(path, first + rest, ps)


@pytest.mark.parametrize("family", sorted(LLM_FAMILIES))
def test_greedy_parity_per_family(llm_dirs, family):
    path = llm_dirs[family]
    with engine({"m": path}) as eng:
        ps = prompts(seed=hash(family) % 100)
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert_parity(path, outs, ps)
        assert eng.pool.stats().used_pages == 0


def test_sliding_window_is_enforced_past_the_window(llm_dirs):
    path = llm_dirs["mistral"]  # window 24: prompts and outputs cross it
    ps = prompts(n=4, seed=3, lo=30, hi=50)
    with engine({"m": path}) as eng:
        assert_parity(path, eng.generate(ps, SamplingParams(max_tokens=24)), ps, 24)


def test_tiny_token_budget_forces_chunked_prefill(llama_dir):
    ps = prompts(seed=1, lo=20, hi=60)
    with engine({"m": llama_dir}, max_num_batched_tokens=7) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert max(eng.llms["m"].counters.batch_tokens) <= 7
    assert_parity(llama_dir, outs, ps)


def test_tiny_pool_forces_preemption_and_keeps_outputs(llama_dir):
    ps = prompts(seed=2, lo=20, hi=40)
    # llama tiny: 2 layers x 2 kv heads x 16 dims x 4 B x 2 = 512 B/token; 16 tokens/page
    with engine({"m": llama_dir}, pool_bytes=12 * 8192, enable_prefix_cache=False) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        assert eng.llms["m"].scheduler.num_preemptions > 0
        assert eng.pool.stats().used_pages == 0
    assert_parity(llama_dir, outs, ps)


def test_shared_prefix_hits_the_cache(llama_dir):
    system = prompts(n=1, seed=9, lo=40, hi=41)[0]
    ps = [system + tail for tail in prompts(n=8, seed=4, lo=2, hi=10)]
    with engine({"m": llama_dir}) as eng:
        first = eng.generate(ps[:1], SamplingParams(max_tokens=MAX_NEW))
        rest = eng.generate(ps[1:], SamplingParams(max_tokens=MAX_NEW))
        stats = eng.pool.stats()
        assert stats.prefix_hits > 0
        assert all(o.num_cached_tokens >= 32 for o in rest)
    assert_parity(llama_dir, first + rest, ps)


def test_two_llms_share_one_pool_concurrently(llm_dirs):
    a, b = llm_dirs["llama"], llm_dirs["qwen3"]
    pa, pb = prompts(n=8, seed=5), prompts(n=8, seed=6)
    with engine({"a": a, "b": b}) as eng:
        results = {}

        def run(name, ps):
            results[name] = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW), model=name)

        import threading

        threads = [threading.Thread(target=run, args=x) for x in (("a", pa), ("b", pb))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert eng.pool.stats().used_pages == 0
    assert_parity(a, results["a"], pa)
    assert_parity(b, results["b"], pb)


def test_different_shapes_draw_from_the_same_pages(tmp_path):
    wide = build_llm(tmp_path / "wide", "llama", num_key_value_heads=4, seed=1)
    narrow = build_llm(tmp_path / "narrow", "qwen3", num_hidden_layers=1, seed=2)
    with engine({"w": wide, "n": narrow}) as eng:
        w, n = eng.llms["w"], eng.llms["n"]
        assert w.kv.tokens_per_page == 16 and n.kv.tokens_per_page > w.kv.tokens_per_page
        assert w.kv.k[0].data_ptr() == n.kv.k[0].data_ptr() == eng.pool.buffer.data_ptr()
        ps = prompts(n=4, seed=8)
        assert_parity(wide, eng.generate(ps, SamplingParams(max_tokens=8), model="w"), ps, 8)
        assert_parity(narrow, eng.generate(ps, SamplingParams(max_tokens=8), model="n"), ps, 8)


def test_abort_mid_generation_frees_every_page(llama_dir):
    with engine({"m": llama_dir}) as eng:
        start = eng.pool.stats().used_pages

        async def go():
            stream = eng.add_request(
                prompts(n=1, seed=7)[0], SamplingParams(max_tokens=200, ignore_eos=True)
            )
            seen = 0
            async for out in stream:
                seen += len(out.delta_token_ids)
                if seen >= 3:
                    break  # leaving the stream aborts the request
            return seen

        assert asyncio.run(go()) >= 3
        for _ in range(3000):  # up to 30 s: a loaded machine steps slowly
            if eng.pool.stats().used_pages == start and not eng.llms["m"].scheduler.has_work():
                break
            asyncio.run(asyncio.sleep(0.01))
        assert eng.pool.stats().used_pages == start


def test_random_submits_and_aborts_never_leak(llama_dir):
    rng = random.Random(0)
    with engine({"m": llama_dir}, pool_bytes=24 * 8192) as eng:

        async def go():
            streams = []
            for i in range(40):
                p = prompts(n=1, seed=100 + i, lo=2, hi=50)[0]
                streams.append(eng.add_request(p, SamplingParams(max_tokens=rng.randrange(1, 30))))
                if rng.random() < 0.4:
                    eng.abort(rng.choice(streams).request_id)
                await asyncio.sleep(rng.random() * 0.005)
            finals = await asyncio.wait_for(asyncio.gather(*(s.final() for s in streams)), 120)
            return finals

        finals = asyncio.run(go())
        assert all(f.finished for f in finals)
        assert {f.finish_reason for f in finals} <= {"stop", "length", "abort"}
        eng.pool.clear_cache()
        stats = eng.pool.stats()
        assert stats.used_pages == 0 and stats.free_pages == eng.pool.num_pages


def test_stream_yields_increments_that_add_up(llama_dir):
    with engine({"m": llama_dir}) as eng:
        p = prompts(n=1, seed=11)[0]

        async def go():
            deltas, texts = [], []
            async for out in eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)):
                deltas += out.delta_token_ids
                texts.append(out.delta_text)
                last = out
            return deltas, "".join(texts), last

        deltas, text, last = asyncio.run(go())
    assert deltas == last.token_ids and len(deltas) == 10
    tok = AutoTokenizer.from_pretrained(llama_dir)
    assert text == last.text == tok.decode(last.token_ids, skip_special_tokens=True)


def test_stop_strings_trim_the_text(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    with engine({"m": llama_dir}) as eng:
        p = prompts(n=1, seed=12)[0]
        full = eng.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        assert len(full.text) > 6
        stop = full.text[3:6]
        cut = eng.generate([p], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0]
        assert cut.finish_reason == "stop"
        assert cut.text == full.text[: full.text.index(stop)]
        assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
        token = full.token_ids[4]
        by_id = eng.generate(
            [p], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[token])
        )[0]
        assert by_id.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
        assert by_id.text == tok.decode(by_id.token_ids[:-1], skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llama_dir):
    ps = prompts(n=4, seed=13)
    with engine({"m": llama_dir}) as eng:
        hot = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
        a = [o.token_ids for o in eng.generate(ps, hot)]
        b = [o.token_ids for o in eng.generate(ps[::-1], hot)][::-1]  # other batch order
        assert a == b
        greedy = eng.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True))
        top1 = eng.generate(
            ps, SamplingParams(max_tokens=12, temperature=0.9, top_k=1, ignore_eos=True)
        )
        assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_text_prompts_and_logprobs(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    with engine({"m": llama_dir}) as eng:
        out = eng.generate(
            ["hello world"], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True)
        )[0]
    ids = tok.encode("hello world", add_special_tokens=False)
    assert out.prompt_token_ids == ids and out.token_ids == reference(llama_dir, ids, 5)
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
    assert all(len(t) == 3 for t in out.top_logprobs)


def test_text_prompts_tokenize_as_transformers_does(llama_dir):
    """The engine encodes with the Rust tokenizer directly; it must match ``encode``."""
    tok = AutoTokenizer.from_pretrained(llama_dir)
    texts = [
        "hello world",
        "<s>user: where is my order?</s>\n<s>assistant:",
        "  leading and trailing spaces \t\n\n",
        "caf\u00e9 \U0001f600 \u65e5\u672c\u8a9e",
    ]
    with engine({"m": llama_dir}) as eng:
        outs = eng.generate(texts, SamplingParams(max_tokens=1, ignore_eos=True))
    for text, out in zip(texts, outs, strict=True):
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False), text


def test_an_llm_folder_without_a_tokenizer_takes_token_ids(llama_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (bare / name).write_bytes((llama_dir / name).read_bytes())
    ps = prompts(4, seed=5)
    with engine({"m": bare}) as eng:
        assert eng.llms["m"].tokenizer is None
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
        with pytest.raises(RequestError) as err:
            eng.generate(["hello"], SamplingParams(max_tokens=2))
    assert err.value.field == "prompt" and "token ids" in str(err.value)
    assert_parity(llama_dir, outs, ps)


def test_bad_requests_are_refused_before_any_work(llama_dir):
    with engine({"m": llama_dir}) as eng:
        cases = [
            ([], {}, "prompt"),
            ("", {}, "prompt"),
            ([1] * 300, {}, "prompt"),  # max_position_embeddings is 256
            ([1, 99999], {}, "prompt"),
            ([1, -1], {}, "prompt"),
            ([1, 2.5], {}, "prompt"),
            ([1, 2**70], {}, "prompt"),
        ]
        for prompt, kw, field in cases:
            with pytest.raises(RequestError) as err:
                eng.generate([prompt], SamplingParams(**kw))
            assert err.value.field == field
        with pytest.raises(RequestError) as err:
            eng.generate([[1, 2]], model="nope")
        assert err.value.field == "model"
        assert eng.pool.stats().used_pages == 0
        assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].finished  # still serving


def test_missing_or_broken_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine({"m": tmp_path / "absent"}, EngineConfig(pool_bytes=1 << 20))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        LLMEngine({"m": broken}, EngineConfig(pool_bytes=1 << 20))


def test_submit_to_a_stopped_engine(llama_dir):
    eng = LLMEngine({"m": llama_dir}, EngineConfig(pool_bytes=1 << 20, fast_linear=False))
    with pytest.raises(EngineStopped):
        eng.submit([1, 2, 3], sink=lambda out: None)


def test_generate_steps_inline_when_the_loop_is_not_running(llama_dir):
    eng = LLMEngine({"m": llama_dir}, EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    assert not eng.loop.running
    ps = prompts(n=6, seed=21)
    outs = eng.generate(ps, SamplingParams(max_tokens=MAX_NEW))
    assert not eng.loop.running and eng.pool.stats().used_pages == 0
    assert_parity(llama_dir, outs, ps)
    with pytest.raises(RequestError):
        eng.generate([[5, 6], []], SamplingParams(max_tokens=4))  # the bad one refuses the batch
    assert eng.pool.stats().used_pages == 0 and not eng.llms["m"].scheduler.has_work()


def test_a_batch_joins_a_running_loop_whole(llama_dir, monkeypatch):
    """generate() with the loop thread running queues its batch at once: the first step
    admits every prompt even where the submitting thread is slow between prompts (a loaded
    machine), so what the batch schedules (preemption included) does not hang on timing."""
    ps = prompts(n=4, seed=3, lo=10, hi=20)
    with engine({"m": llama_dir}) as eng:
        worker = eng.llms["m"]
        encode = worker.encode

        def slow_encode(prompt):
            time.sleep(0.05)  # the engine thread meanwhile steps whatever is queued
            return encode(prompt)

        monkeypatch.setattr(worker, "encode", slow_encode)
        before = worker.counters.steps
        outs = eng.generate(ps, SamplingParams(max_tokens=2))
        first = list(worker.counters.batch_tokens)[-(worker.counters.steps - before)]
    assert first == sum(map(len, ps))
    assert_parity(llama_dir, outs, ps, max_new=2)
