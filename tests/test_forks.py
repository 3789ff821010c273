"""n sequences of one prompt (``SamplingParams.n``/``best_of``) from one prefill: the
forks share the prompt's full pages, compute only its last partial page, and end as one
request."""

from __future__ import annotations

import threading

from test_engine import engine, prompts, reference

from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.sequence import RequestOutput

PAGE = 16  # the tiny llama's tokens per page in these pools


def run(eng, prompt, params, on_first=None) -> dict[int, RequestOutput]:
    """Every sequence's last output, by index (bounded wait)."""
    last: dict[int, RequestOutput] = {}
    done = threading.Event()

    def sink(out: RequestOutput) -> None:
        if on_first is not None and not last:
            on_first(out)
        if out.finished:
            last[out.index] = out
            if len(last) == params.num_sequences:
                done.set()

    eng.submit(prompt, params, sink=sink)
    assert done.wait(120), f"only {sorted(last)} of {params.num_sequences} finished"
    return last


def test_n_greedy_forks_compute_the_prompt_once_and_match_transformers(llama_dir):
    prompt = prompts(n=1, seed=3, lo=53, hi=54)[0]
    n, new = 4, 6
    params = SamplingParams(max_tokens=new, n=n, ignore_eos=True)
    with engine({"m": llama_dir}, enable_prefix_cache=False) as eng:
        outs = run(eng, prompt, params)
        computed = sum(eng.llms["m"].counters.batch_tokens)
        assert eng.pool.stats().used_pages == 0
    assert sorted(outs) == list(range(n))
    want = reference(llama_dir, prompt, new)
    assert all(out.token_ids == want for out in outs.values())
    shared = (len(prompt) - 1) // PAGE * PAGE  # full pages before the last prompt token
    # one prefill, each fork the rest of the last page, then one token a step each
    assert computed == len(prompt) + (n - 1) * (len(prompt) - shared) + n * (new - 1)
    assert {out.num_cached_tokens for i, out in outs.items() if i} == {shared}


def test_seeded_forks_differ_and_reproduce(llama_dir):
    prompt = prompts(n=1, seed=7, lo=30, hi=31)[0]
    params = SamplingParams(max_tokens=10, n=3, temperature=2.0, seed=11, ignore_eos=True)
    with engine({"m": llama_dir}) as eng:
        first = run(eng, prompt, params)
        again = run(eng, prompt, params)
    tokens = [first[i].token_ids for i in range(3)]
    assert tokens == [again[i].token_ids for i in range(3)]
    assert len({tuple(t) for t in tokens}) > 1


def test_an_abort_ends_every_fork_and_frees_their_pages(llama_dir):
    prompt = prompts(n=1, seed=1, lo=40, hi=41)[0]
    params = SamplingParams(max_tokens=200, n=3, ignore_eos=True)
    with engine({"m": llama_dir}) as eng:
        outs = run(eng, prompt, params, on_first=lambda out: eng.abort(out.request_id))
        assert {out.finish_reason for out in outs.values()} == {"abort"}
        assert eng.pool.stats().used_pages == 0
