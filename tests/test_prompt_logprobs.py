"""Prompt scores (``prompt_logprobs``, OpenAI's echo with logprobs) and generated-token
logprobs against transformers' own log_softmax: through chunked prefill, beside a warm
prefix cache, under preemption, and with nothing generated (``max_tokens`` 0)."""

from __future__ import annotations

import pytest
import torch
from test_engine import engine, prompts
from transformers import AutoModelForCausalLM

from trae_groups.engine.errors import RequestError
from trae_groups.engine.sampling import SamplingParams

TOLERANCE = 1e-4  # float32 logits of a batched paged forward against an unbatched one

_models: dict = {}


def reference_logprobs(path, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``tokens``: [len, vocab]."""
    if str(path) not in _models:
        _models[str(path)] = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = _models[str(path)](torch.tensor([tokens])).logits[0]
    return logits.float().log_softmax(-1)


def assert_scores_match(scores, tokens: list[int], ref: torch.Tensor, top: int) -> None:
    """``scores``: TokenLogprob of tokens 0..; entry i scores token i at position i - 1."""
    assert [s.token_id for s in scores] == tokens
    assert scores[0].logprob is None and scores[0].top == ()
    for i in range(1, len(tokens)):
        want = ref[i - 1]
        assert abs(scores[i].logprob - want[tokens[i]].item()) < TOLERANCE, i
        values = [lp for _, _, lp in scores[i].top]
        torch.testing.assert_close(
            torch.tensor(values), want.topk(top).values, atol=TOLERANCE, rtol=0
        )


def test_prompt_scores_match_transformers_through_chunks_and_a_warm_prefix_cache(llama_dir):
    prompt = prompts(n=1, seed=4, lo=70, hi=71)[0]
    params = SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    # a 24-token budget: the 70-token prompt is scored over three chunks
    with engine({"m": llama_dir}, max_num_batched_tokens=24) as eng:
        eng.generate([prompt], SamplingParams(max_tokens=2))  # its full pages are now cached
        (out,) = eng.generate([prompt], params)
    assert out.num_cached_tokens == 0  # a scored prompt is computed whole: cached KV has no logits
    ref = reference_logprobs(llama_dir, prompt + out.token_ids)
    assert_scores_match(out.prompt_logprobs, prompt, ref, top=2)
    # greedy: each chosen token's logprob is transformers' log_softmax there (tolerance on
    # the float, not on the argmax)
    for j, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert abs(logprob - ref[len(prompt) - 1 + j, token].item()) < TOLERANCE


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llama_dir):
    prompt = prompts(n=1, seed=5, lo=20, hi=21)[0]
    with engine({"m": llama_dir}) as eng:
        (out,) = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert out.token_ids == [] and out.finish_reason == "length"
    assert_scores_match(out.prompt_logprobs, prompt, reference_logprobs(llama_dir, prompt), 1)


def test_scores_survive_preemption_without_being_counted_twice(llama_dir):
    """12 pages of 16 tokens for eight 40-token prompts generating 24 tokens: preemption."""
    ps = prompts(n=8, seed=8, lo=40, hi=41)
    params = SamplingParams(max_tokens=24, prompt_logprobs=0, ignore_eos=True)
    with engine({"m": llama_dir}, pool_bytes=12 * 8192) as eng:
        outs = eng.generate(ps, params)
        assert eng.llms["m"].scheduler.num_preemptions > 0
    for prompt, out in zip(ps, outs, strict=True):
        assert_scores_match(out.prompt_logprobs, prompt, reference_logprobs(llama_dir, prompt), 0)


def test_only_rows_that_ask_get_logprobs(llama_dir):
    ps = prompts(n=2, seed=2, lo=6, hi=7)
    with engine({"m": llama_dir}) as eng:
        asked, plain = eng.generate(
            ps, [SamplingParams(max_tokens=3, logprobs=0), SamplingParams(max_tokens=3)]
        )
    assert len(asked.logprobs) == len(asked.token_ids) and asked.top_logprobs[0] == {}
    assert plain.logprobs is None and plain.prompt_logprobs is None


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("max_tokens", dict(max_tokens=0)),  # nothing to generate and nothing scored
        ("prompt_logprobs", dict(prompt_logprobs=21)),
        ("logit_bias", dict(logit_bias={5: 101.0})),
    ],
)
def test_bad_values_name_their_field(field, params):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**params)
    assert caught.value.field == field


def test_a_bias_on_a_token_the_model_lacks_is_refused(llama_dir):
    with engine({"m": llama_dir}) as eng, pytest.raises(RequestError) as caught:
        eng.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={10_000: 1.0}))
    assert caught.value.field == "logit_bias"
