"""engine/verify.py for temperature > 0: rejection sampling keeps the model's distribution.

Fixed seeds and bounded loops: each check draws a fixed number of verdicts from seeded
generators and compares the counts with the distribution plain sampling draws from
(``filter_probs``) by a chi-square test at a 0.001 level. Deterministic, so never flaky.
"""

from __future__ import annotations

import torch
from scipy.stats import chi2
from test_engine import assert_parity, engine
from test_speculative import repetitive

from conftest import build_llm
from trae_groups.engine.sampling import Sampler, SamplingParams, filter_probs
from trae_groups.engine.scheduler import ScheduledSeq
from trae_groups.engine.sequence import Sequence
from trae_groups.engine.spec_config import SpeculativeConfig
from trae_groups.engine.verify import verify

VOCAB = 6
TRIALS = 3000
LEVEL = 1e-3


def logits_rows(seed: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 1.5


def draws(params: SamplingParams, logits: torch.Tensor, draft: list[int], seed: int):
    """TRIALS verdicts of one sequence that verifies ``draft`` against ``logits``."""
    sampler = Sampler()
    seq = Sequence("r", [1, 2, 3], params, sink=lambda out: None)
    seq.generator = torch.Generator().manual_seed(seed)
    item = ScheduledSeq(seq, 1 + len(draft), True, list(draft))
    return [verify(sampler, logits, [item])[0].tokens for _ in range(TRIALS)]


def assert_follows(samples: list[int], probs: torch.Tensor) -> None:
    """Counts of ``samples`` fit ``probs``; tokens of probability 0 never appear."""
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    probs = probs.double()
    assert counts[probs == 0].sum() == 0
    live = probs > 0
    expected = probs[live] * len(samples)
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(1 - LEVEL, int(live.sum()) - 1), (counts.tolist(), probs.tolist())


def test_each_position_keeps_the_target_distribution():
    params = SamplingParams(temperature=0.9)
    logits = logits_rows(0, 3)
    probs = filter_probs(logits, [params] * 3)
    draft = [int(probs[0].argmax()), int(probs[1].argmax())]  # likely guesses: all paths run
    verdicts = draws(params, logits, draft, seed=1)
    assert_follows([v[0] for v in verdicts], probs[0])
    # given the first guess was kept, the second token follows row 1; given both, row 2
    kept = [v for v in verdicts if v[0] == draft[0]]
    assert_follows([v[1] for v in kept], probs[1])
    both = [v for v in kept if len(v) == 3]
    assert len(both) > 200
    assert_follows([v[2] for v in both], probs[2])
    rejected = [v for v in verdicts if v[0] != draft[0]]
    assert rejected and all(len(v) == 1 for v in rejected)


def test_an_unlikely_guess_is_mostly_rejected_and_the_residual_is_exact():
    params = SamplingParams(temperature=1.0)
    logits = logits_rows(2, 2)
    probs = filter_probs(logits, [params] * 2)
    guess = int(probs[0].argmin())
    verdicts = draws(params, logits, [guess], seed=3)
    assert_follows([v[0] for v in verdicts], probs[0])
    kept = sum(1 for v in verdicts if v[0] == guess)
    assert kept < TRIALS * (float(probs[0, guess]) + 0.05)


def test_top_k_and_top_p_filter_before_verification():
    params = SamplingParams(temperature=1.2, top_k=4, top_p=0.9)
    logits = logits_rows(4, 2)
    probs = filter_probs(logits, [params] * 2)
    outside = int((probs[0] == 0).nonzero()[0])  # a guess the filters rule out
    verdicts = draws(params, logits, [outside], seed=5)
    assert all(v[0] != outside for v in verdicts)  # never kept: its probability is 0
    assert_follows([v[0] for v in verdicts], probs[0])


def test_sampling_that_leaves_one_token_is_greedy_through_the_engine(llama_dir):
    # top_p this small keeps only the most likely token: the sampled path (rejection
    # sampling) must then give greedy decoding's tokens exactly
    ps = repetitive(n=6, seed=21)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, seed=3)
    with engine({"m": llama_dir}, speculative=SpeculativeConfig(num_tokens=4)) as eng:
        outs = eng.generate(ps, params)
        counters = eng.llms["m"].speculator.counters
        assert 0 < counters.accepted < counters.proposed
        assert eng.pool.stats().used_pages == 0
    assert_parity(llama_dir, outs, ps, 24)


def test_seeded_sampling_with_speculation_is_reproducible_and_frees_its_pages(tmp_path):
    path = build_llm(tmp_path / "m", "llama", vocab_size=64)
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]
    params = SamplingParams(max_tokens=40, temperature=0.15, seed=7)
    with engine({"m": path}, speculative=SpeculativeConfig(num_tokens=3)) as eng:
        first = eng.generate([prompt] * 3, params)
        again = eng.generate([prompt] * 3, params)
        assert eng.llms["m"].speculator.counters.proposed > 0
        assert eng.pool.stats().used_pages == 0
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 40 or o.finish_reason == "stop" for o in first)
