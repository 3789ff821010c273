"""Bounded step time: while sequences decode, a step carries only the prompt tokens that keep
it near ``step_time_target_ms``, by the model's own measured step cost (engine/step_cost.py).

The scheduler tests feed the cost model steps of known cost (no clocks), so every budget is
exact; the engine test shows the option reaches a real engine, and that offline generate()
does not hold prompts back."""

from __future__ import annotations

import random
import threading

import pytest

from conftest import build_llm
from trae_groups.engine import scheduler as scheduler_module
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.scheduler import (
    ADMIT_WAIT,
    ALONE_STRETCH,
    DECODE_SLOWDOWN,
    MIN_ALONE_CHUNK,
    MIN_PROMPT_CHUNK,
    PROMPT_STRETCH,
    Scheduler,
    SchedulerSettings,
    prompt_floor,
)
from trae_groups.engine.sequence import Sequence
from trae_groups.engine.step_cost import StepCost

# a made-up model: 30 ms a step, 3 ms a decode, 1 ms a prompt token
BASE, PER_DECODE, PER_TOKEN = 0.030, 0.003, 0.001


def cost_of(decodes: int, tokens: int) -> float:
    return BASE + PER_DECODE * decodes + PER_TOKEN * tokens


def taught(cost: StepCost, outliers: bool = False) -> StepCost:
    rng = random.Random(0)
    if outliers:  # a first step that built its matmuls, and one that shared its cores
        cost.observe(0, 512, 9.0)
    for i in range(40):
        decodes, tokens = rng.choice([(0, 512), (0, 128), (1, 0), (4, 0), (8, 64), (2, 300)])
        seconds = cost_of(decodes, tokens) * (1 + rng.uniform(-0.02, 0.02))
        cost.observe(decodes, tokens, seconds * (6 if outliers and i == 20 else 1))
    return cost


@pytest.mark.parametrize("outliers", [False, True])
def test_the_cost_model_recovers_a_models_step_cost(outliers):
    base, per_decode, per_token = taught(StepCost(), outliers).estimate()
    assert base == pytest.approx(BASE, rel=0.1)
    assert per_decode == pytest.approx(PER_DECODE, rel=0.1)
    assert per_token == pytest.approx(PER_TOKEN, rel=0.1)


def test_no_estimate_until_both_kinds_of_step_were_seen():
    cost = StepCost()
    for _ in range(10):
        cost.observe(0, 512, cost_of(0, 512))
    assert cost.estimate() is None and cost.prompt_budget(1, 0.1, 32, 512) is None
    for _ in range(3):
        cost.observe(2, 0, cost_of(2, 0))
    assert cost.prompt_budget(1, 0.1, 32, 512) is not None


def seq(n_prompt: int, rid: str) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(), lambda out: None)


def scheduler(target_s: float | None, budget: int = 512) -> Scheduler:
    settings = SchedulerSettings(
        16, 8, budget, "m", long_prefill_tokens=128, step_target_s=target_s
    )
    s = Scheduler(MemoryPool(4096, 1024), "m", settings)
    taught(s.cost)
    return s


def advance(s: Scheduler) -> None:
    for item in s.schedule().scheduled:
        item.seq.num_computed += item.num_new
        if item.samples:
            item.seq.output_token_ids.append(7)


def decoding_beside_a_long_prompt(s: Scheduler) -> Sequence:
    chat = seq(5, "chat")
    s.add(chat)
    advance(s)  # the chat's prompt: it decodes from now on
    long = seq(3000, "long")
    s.add(long)
    return long


def test_beside_decodes_a_step_carries_what_fits_the_target():
    s = scheduler(target_s=0.100)
    long = decoding_beside_a_long_prompt(s)
    step = s.schedule()
    assert [i.seq.request_id for i in step.decodes] == ["chat"]
    (chunk,) = step.prefills
    assert chunk.seq is long
    # 100 ms - 30 ms - 3 ms for the decode leaves 67 prompt tokens at 1 ms each
    assert chunk.num_new == pytest.approx(67, abs=3)
    assert cost_of(1, chunk.num_new) == pytest.approx(0.100, abs=0.004)


def test_where_the_decodes_alone_pass_the_target_a_step_may_stretch_to_a_multiple_of_theirs():
    s = scheduler(target_s=0.010)  # less than the decode step costs (33 ms)
    decoding_beside_a_long_prompt(s)
    (chunk,) = s.schedule().prefills
    # PROMPT_STRETCH x 33 ms in all: the prompt gets the rest, at 1 ms a token
    alone = cost_of(1, 0)
    assert chunk.num_new == pytest.approx((PROMPT_STRETCH - 1) * alone / PER_TOKEN, abs=3)
    assert cost_of(1, chunk.num_new) == pytest.approx(PROMPT_STRETCH * alone, abs=0.004)


@pytest.mark.parametrize(
    ("target_s", "want"),
    [
        (0.100, (DECODE_SLOWDOWN - 1) * cost_of(1, 0) / PER_TOKEN),  # the slowdown binds: 33
        (0.050, (0.050 - cost_of(1, 0)) / PER_TOKEN),  # the target binds: 17
        (0.036, prompt_floor(1)),  # the floor binds: 9
    ],
)
def test_a_running_prompt_beside_a_stream_slows_it_at_most_to_twice_its_step(target_s, want):
    """Nothing waiting, the long prompt admitted: the step beside the chat takes at most
    DECODE_SLOWDOWN times the chat's own step, at most the target, at least the floor."""
    s = scheduler(target_s=target_s)
    long = decoding_beside_a_long_prompt(s)
    advance(s)  # the long prompt is admitted: it runs, nothing waits
    step = s.schedule()
    assert [i.seq.request_id for i in step.decodes] == ["chat"]
    (chunk,) = step.prefills
    assert chunk.seq is long and not s.waiting
    assert chunk.num_new == pytest.approx(want, abs=3)


def test_a_slow_model_still_moves_a_long_prompt_on():
    cost = taught(StepCost())
    assert cost.prompt_budget(1, 0.010, MIN_PROMPT_CHUNK, 512) == MIN_PROMPT_CHUNK


def test_held_steps_are_priced_from_measured_decode_steps_not_the_fits_intercept():
    """Deep in a long prompt a token costs more than in its first chunks (its attention reads
    the whole context), which no line through all steps fits: the joint fit's base and
    per-token share misprice a step beside a chat. The budget reads the chat's own decode
    steps and the recent steps' marginal cost per prompt token instead, so the held step
    takes DECODE_SLOWDOWN times the chat's step, not more."""
    decode_step = 0.025
    cost = StepCost()
    for _ in range(10):
        cost.observe(1, 0, decode_step)  # the chat alone
    for tokens in (512, 384, 384, 256):  # the long prompt's first chunks, alone: cheap
        cost.observe(0, tokens, 0.010 + tokens * 0.0006)

    def deep(tokens: int) -> float:  # beside the chat, deep in the prompt: 1 ms a token
        return decode_step + tokens * 0.001

    for tokens in (9, 12, 9, 20, 9, 9, 15, 9, 30, 9):
        cost.observe(1, tokens, deep(tokens))
    assert cost.decodes_alone(1) == pytest.approx(decode_step)
    assert cost.per_prompt_token() == pytest.approx(0.001)
    budget = cost.prompt_budget(1, 0.100, prompt_floor(1), 512, slowdown=DECODE_SLOWDOWN)
    assert deep(budget) == pytest.approx(DECODE_SLOWDOWN * decode_step, rel=0.05)
    # what the joint fit alone would have allowed: a step well past the bound
    base, per_decode, per_token = cost.estimate()
    by_fit = int((DECODE_SLOWDOWN * (base + per_decode) - base - per_decode) / per_token)
    assert deep(by_fit) > 1.25 * DECODE_SLOWDOWN * decode_step


def test_steps_beside_decodes_and_steps_alone_are_priced_apart_and_a_free_reading_keeps_the_last_price():
    """A held step's few tokens deep in a prompt cost more each than the prompt's own chunks
    alone: each kind is priced from its own newest steps. Floor steps that read as free (their
    tokens below the noise of the step's base) keep the last price: a free token would open
    the whole budget beside a stream."""
    cost = StepCost()
    for decodes in (1, 2, 1, 2, 1, 2):  # chats alone: 22 ms a step and 3 ms a decode
        cost.observe(decodes, 0, 0.022 + 0.003 * decodes)
    for tokens in (512, 384, 256, 256):
        cost.observe(0, tokens, 0.022 + tokens * 0.0005)  # a prompt alone: 0.5 ms a token
    assert cost.per_prompt_token(beside_decodes=False) == pytest.approx(0.0005, rel=0.05)
    # no step beside decodes seen yet: the other kind's price stands in
    assert cost.per_prompt_token(beside_decodes=True) == pytest.approx(0.0005, rel=0.05)
    for _ in range(4):
        cost.observe(1, 9, 0.025 + 9 * 0.001)  # beside the chat: 1 ms a token
    assert cost.per_prompt_token(beside_decodes=True) == pytest.approx(0.001)
    assert cost.per_prompt_token(beside_decodes=False) == pytest.approx(0.0005, rel=0.05)
    for _ in range(4):
        cost.observe(1, 9, 0.024)  # below the chat's own step: noise
    assert cost.per_prompt_token(beside_decodes=True) == pytest.approx(0.001)
    assert cost.prompt_budget(1, 0.001, prompt_floor(1), 512) == prompt_floor(1)


def test_a_prompt_alone_runs_in_steps_of_a_few_targets_and_without_a_target_whole():
    held = scheduler(target_s=0.200)
    long = seq(3000, "long")
    held.add(long)
    # ALONE_STRETCH x 200 ms, less the 30 ms base, at 1 ms a token: from its first step
    # (admitted from the queue, it cannot finish in one) and while it runs alone
    want = (ALONE_STRETCH * 0.200 - BASE) / PER_TOKEN
    assert want > MIN_ALONE_CHUNK  # the stretch binds, not the floor
    first = held.schedule().prefills[0].num_new
    assert first == pytest.approx(want, abs=4)
    long.num_computed += first
    assert held.schedule().prefills[0].num_new == pytest.approx(want, abs=4)
    slow = scheduler(target_s=0.001)  # a target no chunk fits: still MIN_ALONE_CHUNK
    slow.add(seq(3000, "long"))
    advance(slow)
    assert slow.schedule().prefills[0].num_new == MIN_ALONE_CHUNK
    free = scheduler(target_s=None)
    decoding_beside_a_long_prompt(free)
    assert free.schedule().prefills[0].num_new == 512 - 1  # one token left for the decode


def test_a_burst_with_nothing_decoding_takes_the_whole_budget_for_the_prompts_it_finishes():
    """Prompts that finish in the step get their first tokens from it: a burst of them takes
    the whole budget; only a chunk that leaves its prompt unfinished is held to the steps of
    a prompt alone."""
    s = scheduler(target_s=0.100)
    for i in range(5):
        s.add(seq(100, f"short{i}"))
    s.add(seq(3000, "long"))
    chunks = {i.seq.request_id: i.num_new for i in s.schedule().prefills}
    assert [chunks[f"short{i}"] for i in range(5)] == [100] * 5
    assert chunks["long"] == 512 - 500  # what the budget leaves, under the alone step
    s = scheduler(target_s=0.100)
    for i in range(6):
        s.add(seq(100, f"short{i}"))
    step = s.schedule()
    assert sum(i.num_new for i in step.prefills) == 512  # five finish, the sixth 12 tokens
    assert step.num_tokens == 512


def test_a_held_step_shares_its_prompt_tokens_with_waiting_prompts():
    s = scheduler(target_s=0.100)
    long = decoding_beside_a_long_prompt(s)
    advance(s)  # the long prompt is running, in chunks
    s.add(seq(20, "short"))
    step = s.schedule()
    chunks = {i.seq.request_id: i.num_new for i in step.prefills}
    assert chunks["short"] == 20  # admitted at once, not after 3,000 tokens
    assert 0 < chunks["long"] < 67 and sum(chunks.values()) <= 67 + 3
    assert long.num_uncomputed > 0


@pytest.mark.parametrize("overdue", [False, True])
def test_prompts_that_waited_past_the_admission_bound_go_in_whole_beside_decodes(overdue):
    """A burst beside the stream of its first admitted: a held step takes the target's 67
    tokens; prompts that have waited ADMIT_WAIT times the target take what they need."""
    s = scheduler(target_s=0.100)
    s.add(seq(5, "chat"))
    advance(s)  # the chat decodes from now on
    burst = [seq(100, f"p{i}") for i in range(4)]
    for prompt in burst:
        if overdue:
            prompt.arrival -= ADMIT_WAIT * 0.100 + 0.01
        s.add(prompt)
    step = s.schedule()
    chunks = {i.seq.request_id: i.num_new for i in step.prefills}
    assert [i.seq.request_id for i in step.decodes] == ["chat"]
    if overdue:
        assert chunks == {f"p{i}": 100 for i in range(4)}
    else:
        assert sum(chunks.values()) <= 67 + 3


def test_a_step_that_gives_a_prompt_its_first_token_is_not_topped_up_past_the_target():
    """A short prompt arriving beside a long one alone: the long chunk is cut to let it in,
    and the budget left is not handed back to the long chunk past the target, so the short
    one's first token comes after a short step."""
    # held: the step with the short one's first token is held as one beside a decode, to
    # DECODE_SLOWDOWN x 33 ms; the long chunk gets what the short one's 20 tokens leave
    held = round((DECODE_SLOWDOWN - 1) * cost_of(1, 0) / PER_TOKEN) - 20
    for target, long_chunk in ((0.100, held), (None, 512 - 20)):
        s = scheduler(target_s=target)
        long = seq(3000, "long")
        s.add(long)
        advance(s)  # the long prompt runs alone, whole budgets
        s.add(seq(20, "short"))
        chunks = {i.seq.request_id: i.num_new for i in s.schedule().prefills}
        assert chunks["short"] == 20, target
        assert chunks["long"] == pytest.approx(long_chunk, abs=3), target


def test_a_prompt_left_with_its_last_token_holds_the_step_as_a_longer_one_does():
    """A prompt found in the prefix cache but for its last token is a one-token chunk that
    sits with the decodes: its first token is as much someone's time to first token, so the
    long prompt beside it is held the same way, not topped up to the budget."""
    want = round((DECODE_SLOWDOWN - 1) * cost_of(1, 0) / PER_TOKEN)
    s = scheduler(target_s=0.100)
    long = seq(3000, "long")
    s.add(long)
    advance(s)  # the long prompt runs alone
    cached = seq(20, "cached")
    cached.num_computed = 19  # as if the prefix cache held the rest
    s.add(cached)
    step = s.schedule()
    assert [i.seq.request_id for i in step.decodes] == ["cached"]
    (chunk,) = step.prefills
    assert chunk.seq is long and chunk.num_new == pytest.approx(want, abs=3)


def test_the_engine_learns_its_step_cost_and_holds_prompts_beside_streams(tmp_path, monkeypatch):
    """On a real engine with its loop thread, a target below what any step costs: once the
    engine has measured its steps, every step that carries the long prompt beside the stream
    carries the floor, where without a target it would take the whole budget. (The stretch
    is off: a tiny model's prompt tokens are so cheap beside its step's base that twice a
    decode step holds nothing back.)"""
    monkeypatch.setattr(scheduler_module, "PROMPT_STRETCH", 1.0)
    folder = build_llm(tmp_path / "m", "llama", max_position_embeddings=2048)
    config = EngineConfig(
        pool_bytes=32 << 20, step_time_target_ms=0.001, max_num_batched_tokens=256
    )  # fmt: skip
    engine = LLMEngine({"m": str(folder)}, config).start()
    worker = engine.llm("m")
    steps: list[tuple[int, int]] = []
    observe = worker.scheduler.cost.observe
    worker.scheduler.cost.observe = lambda d, t, s: (steps.append((d, t)), observe(d, t, s))
    try:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for n in (300, 200, 300):  # prompt-only steps of several sizes teach the cost model
            engine.generate([[5] * n], params)
        done = threading.Event()
        stream = SamplingParams(max_tokens=80, ignore_eos=True)
        engine.submit([7, 8, 9], stream, sink=lambda out: out.finished and done.set())
        long = engine.generate([[3 + i % 500 for i in range(1500)]], params)[0]
        assert done.wait(120) and long.finished
    finally:
        engine.shutdown()
    beside = [t for d, t in steps if d and t]  # the long prompt's chunks beside the stream
    # without the target its 1,500 tokens would go in ~6 chunks of the whole budget (256)
    assert len(beside) > 10, steps
    # the first few, before the cost model had seen decodes, may be whole; then the floor.
    # (Whether they were is a race: on a loaded machine the loop may step the stream alone
    # before the long prompt arrives, and the model knows decodes from the first chunk.)
    floor = prompt_floor(1)
    assert all(t <= floor for t in beside[3:]), beside


def test_offline_generate_does_not_hold_prompts(tmp_path):
    folder = build_llm(tmp_path / "m", "llama", max_position_embeddings=2048)
    config = EngineConfig(
        pool_bytes=32 << 20, step_time_target_ms=0.001, max_num_batched_tokens=256
    )
    engine = LLMEngine({"m": str(folder)}, config)
    worker = engine.llm("m")
    sizes: list[tuple[int, int]] = []
    observe = worker.scheduler.cost.observe
    worker.scheduler.cost.observe = lambda d, t, s: (sizes.append((d, t)), observe(d, t, s))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.generate([[5] * 40, [6] * 300, [7] * 600], params)  # inline: no loop thread
    # prompts beside decodes took whole budgets (less one token per decode), never the floor
    beside = [t for d, t in sizes if d and t]
    assert beside and max(beside) >= 256 - 2
    assert worker.scheduler.hold_prompts  # restored for serving


def test_the_cli_flag_sets_the_target_and_zero_turns_it_off():
    from trae_groups import cli
    from trae_groups.engine.config import DEFAULT_STEP_TIME_TARGET_MS

    parser = __import__("argparse").ArgumentParser()
    cli._engine_options(parser)
    for argv, expected in (([], DEFAULT_STEP_TIME_TARGET_MS), (["--step-time-target-ms", "40"], 40.0),
                           (["--step-time-target-ms", "0"], None)):  # fmt: skip
        config = cli._engine_config(parser.parse_args(argv))
        assert config.step_time_target_ms == expected
        assert config.step_target_s == (None if expected is None else expected / 1000)
