import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from trae_groups.engine.errors import RequestError
from trae_groups.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    score_tokens,
)


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample(lg, params, seen=None, gens=None):
    n = lg.shape[0]
    return Sampler()(lg, params, seen or [[]] * n, gens or [None] * n).token_ids


def test_greedy_is_argmax():
    lg = logits()
    assert sample(lg, [SamplingParams()] * 4) == lg.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    lg = logits()
    hot = [SamplingParams(temperature=1.5, top_k=1)] * 4
    assert sample(lg, hot) == lg.argmax(-1).tolist()
    nucleus = [SamplingParams(temperature=1.0, top_p=1e-6)] * 4
    assert sample(lg, nucleus) == lg.argmax(-1).tolist()
    min_p = [SamplingParams(temperature=1.0, min_p=0.999)] * 4
    assert sample(lg, min_p) == lg.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    lg = logits(rows=3)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(lg[:1], [p], gens=[torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    assert len(set(alone)) == 1
    other = SamplingParams(temperature=1.0)
    mixed = sample(lg, [other, p, other], gens=[None, torch.Generator().manual_seed(7), None])
    in_row0 = sample(lg[1:2], [p], gens=[torch.Generator().manual_seed(7)])[0]
    assert mixed[1] == in_row0


def test_sampling_follows_the_distribution():
    lg = torch.tensor([[0.0, 1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    draws = [sample(lg, [SamplingParams(temperature=1.0)], gens=[gen])[0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    torch.testing.assert_close(freq, lg.softmax(-1)[0], atol=0.03, rtol=0)


def test_top_k_and_top_p_never_pick_filtered_tokens():
    lg = logits(rows=1, vocab=20)
    top3 = set(lg[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        assert sample(lg, [SamplingParams(temperature=2.0, top_k=3)], gens=[gen])[0] in top3
    probs = lg[0].softmax(-1)
    order = probs.argsort(descending=True)
    keep = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for _ in range(200):
        assert sample(lg, [SamplingParams(temperature=1.0, top_p=0.5)], gens=[gen])[0] in keep


def test_repetition_penalty_matches_transformers():
    lg = logits(rows=2)
    seen = [[1, 2, 3, 3], [4, 40]]
    ours = lg.clone()
    apply_repetition_penalty(ours, seen, [1.3, 1.3])
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([[1, 2, 3, 3], [4, 40, 4, 4]]), lg.clone()
    )
    torch.testing.assert_close(ours, theirs)


def test_logprobs_are_returned():
    lg = logits(rows=2)
    res = Sampler()(lg, [SamplingParams(logprobs=2)] * 2, [[], []], [None, None])
    want = lg.log_softmax(-1).max(-1).values
    torch.testing.assert_close(torch.tensor(res.logprobs), want)
    assert all(len(t) == 2 for t in res.top_logprobs)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 50),
        ("stop", [""]),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_logprobs_are_of_the_distribution_sampled_from():
    """After repetition penalty, logit_bias and temperature (OpenAI's definition)."""
    lg = logits(rows=1)
    params = SamplingParams(
        temperature=0.5, repetition_penalty=1.3, logit_bias={7: 3.0}, logprobs=2, seed=1
    )
    res = Sampler()(lg, [params], [[1, 2]], [torch.Generator().manual_seed(1)])
    want = lg.clone()
    apply_repetition_penalty(want, [[1, 2]], [1.3])
    want[0, 7] += 3.0
    want = (want / 0.5).log_softmax(-1)[0]
    assert res.logprobs[0] == pytest.approx(want[res.token_ids[0]].item(), abs=1e-5)
    assert list(res.top_logprobs[0]) == want.topk(2).indices.tolist()


def test_rows_that_do_not_ask_get_no_logprobs():
    res = Sampler()(logits(rows=2), [SamplingParams(logprobs=1), SamplingParams()], [[], []],
                    [None, None])  # fmt: skip
    assert res.logprobs[1] is None and res.top_logprobs[1] is None
    assert isinstance(res.logprobs[0], float) and len(res.top_logprobs[0]) == 1


def test_logit_bias_bans_and_forces_tokens():
    lg = logits(rows=1)
    best = int(lg.argmax())
    banned = Sampler()(lg, [SamplingParams(logit_bias={best: -100.0})], [[]], [None])
    assert banned.token_ids[0] != best
    forced = Sampler()(lg, [SamplingParams(logit_bias={11: 100.0}, temperature=1.0)], [[]], [None])
    assert forced.token_ids == [11]


def test_score_tokens_is_log_softmax_at_the_targets():
    lg = logits(rows=3)
    scores = score_tokens(lg, [4, 5, 6], top=2)
    want = lg.log_softmax(-1)
    for row, (value, top) in enumerate(scores):
        assert value == pytest.approx(want[row, 4 + row].item(), abs=1e-6)
        assert list(top) == want[row].topk(2).indices.tolist()
