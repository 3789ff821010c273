"""Offline ``generate`` asks for final outputs only (GenerateRequest.final_only): the worker
builds one RequestOutput per request, and it carries what a streamed request's outputs add
up to (tokens, text, logprobs, prompt scores sent once)."""

from __future__ import annotations

import threading

import pytest
from test_engine import engine, prompts

from trae_groups.engine.outputs import Outputs
from trae_groups.engine.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=1, ignore_eos=True)


def test_generate_builds_one_output_per_request_with_what_streaming_adds_up_to(
    llama_dir, monkeypatch
):
    ps = prompts(n=3, seed=8, lo=20, hi=40)
    streamed: dict[int, list] = {i: [] for i in range(len(ps))}
    ended = threading.Semaphore(0)

    def sink_for(i):
        def sink(out):
            streamed[i].append(out)
            if out.finished:
                ended.release()

        return sink

    with engine({"m": llama_dir}) as eng:
        for i, p in enumerate(ps):
            eng.submit(p, PARAMS, sink=sink_for(i))
        for _ in ps:
            assert ended.acquire(timeout=120)
        built = []
        output = Outputs.output
        monkeypatch.setattr(Outputs, "output", lambda s, *a: built.append(1) or output(s, *a))
        outs = eng.generate(ps, PARAMS)
    assert len(built) == len(ps)  # one each, not one a step
    for i, out in enumerate(outs):
        steps = streamed[i]
        assert len(steps) > 1 and steps[-1].finished and out.finished
        assert out.token_ids == steps[-1].token_ids
        assert out.text == "".join(s.delta_text for s in steps) == steps[-1].text
        assert out.finish_reason == steps[-1].finish_reason == "length"
        assert len(out.logprobs) == len(out.token_ids) == PARAMS.max_tokens
        # the same tokens; a logprob from another batch may differ in its last bits
        streamed_logprobs = [lp.logprob for s in steps for lp in s.delta_logprobs]
        assert out.logprobs == pytest.approx(streamed_logprobs, abs=1e-4, rel=0)
        scored = [t.token_id for s in steps for t in (s.prompt_logprobs or ())]
        assert [t.token_id for t in out.prompt_logprobs] == scored == ps[i]
