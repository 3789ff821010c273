"""The scheduler and the engine loop's policy, with no model: plain objects in and out."""

from __future__ import annotations

import math

from trae_groups.engine.deadlines import Priority
from trae_groups.engine.loop import EngineLoop
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.scheduler import Scheduler, SchedulerSettings
from trae_groups.engine.sequence import Sequence, Status
from trae_groups.engine.worker import Urgency, Worker


def seq(n_prompt: int, rid: str = "r", depth: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(), lambda out: None,
                    Priority(depth=depth, arrival=arrival))  # fmt: skip


def scheduler(pages=64, budget=64, max_seqs=8, policy="graph", cache=True) -> Scheduler:
    settings = SchedulerSettings(4, max_seqs, budget, "m" if cache else None, policy)
    return Scheduler(MemoryPool(pages, 1024), "m", settings)


def run_step(s: Scheduler, token: int = 7) -> None:
    """What the worker does after the model ran: count computed tokens, append samples."""
    out = s.schedule()
    for item in out.scheduled:
        item.seq.num_computed += item.num_new
        s.publish_full_pages(item.seq)
        if item.samples:
            item.seq.output_token_ids.append(token)


def test_decodes_go_before_new_prompts_and_the_budget_holds():
    s = scheduler(budget=10)
    a = seq(5, "a")
    s.add(a)
    first = s.schedule()
    assert [(i.seq.request_id, i.num_new, i.samples) for i in first.prefills] == [("a", 5, True)]
    a.num_computed, a.output_token_ids = 5, [9]
    s.add(seq(30, "b"))
    out = s.schedule()
    assert [i.seq.request_id for i in out.decodes] == ["a"]
    assert [(i.seq.request_id, i.num_new, i.samples) for i in out.prefills] == [("b", 9, False)]
    assert out.num_tokens == 10


def test_long_prompt_is_chunked_across_steps():
    s = scheduler(budget=8)
    b = seq(20, "b")
    s.add(b)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append(out.prefills[0].num_new)
        b.num_computed += out.prefills[0].num_new
    assert chunks == [8, 8, 4] and b.num_computed == 20 and len(b.pages) == 5


def test_waiting_order_follows_the_policy():
    graph = scheduler(max_seqs=1)
    fifo = scheduler(max_seqs=1, policy="fifo")
    for s in (graph, fifo):
        s.add(seq(3, "old-shallow", depth=0, arrival=1.0))
        s.add(seq(3, "new-deep", depth=2, arrival=2.0))
    assert graph.schedule().prefills[0].seq.request_id == "new-deep"
    assert fifo.schedule().prefills[0].seq.request_id == "old-shallow"


def test_out_of_pages_preempts_the_newest_and_recomputes_it():
    s = scheduler(pages=4, budget=64, cache=False)
    a, b = seq(8, "a"), seq(7, "b")
    s.add(a)
    s.add(b)
    run_step(s)  # a: 2 pages, b: 2 pages (7 prompt tokens + room), pool full
    assert s.pool.num_free == 0
    run_step(s)  # a needs a 3rd page for its 9th token: b (newest) is preempted
    assert b.status is Status.WAITING and b.num_computed == 0 and b.pages == []
    assert s.num_preemptions == 1 and a.num_computed == 9
    s.finish(a, "stop")
    out = s.schedule()  # b comes back and recomputes prompt + its generated token
    assert out.prefills[0].seq is b and out.prefills[0].num_new == 8


def test_prefix_cache_skips_full_shared_pages():
    s = scheduler()
    first = seq(10, "first")
    s.add(first)
    run_step(s)
    s.finish(first, "stop")
    again = seq(10, "again")
    s.add(again)
    out = s.schedule()
    # two full pages (8 tokens) came from the cache; the rest is computed
    assert again.num_cached_tokens == 8 and out.prefills[0].num_new == 2
    assert s.pool.stats().prefix_hits == 2


def test_finish_and_abort_free_every_page():
    s = scheduler()
    a, b = seq(9, "a"), seq(3, "b")
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(a, "abort")
    s.finish(b, "stop")
    s.pool.clear_cache()
    assert s.pool.stats().free_pages == 64 and not s.has_work()


class Fixed(Worker):
    """A worker that always wants to run with a fixed urgency (policy tests only)."""

    def __init__(self, name: str, urgency: Urgency | None):
        self.name, self._urgency, self.steps = name, urgency, 0

    def urgency(self, now):
        return self._urgency

    def next_wakeup(self, now):
        return None

    def step(self):
        self.steps += 1

    def abort(self, request_id):
        pass

    def close(self):
        pass


NONE = -math.inf  # Urgency.neg_due of work without a deadline


def test_loop_steps_overdue_then_due_then_deeper_then_older():
    loop = EngineLoop()
    shallow_old = Fixed("shallow_old", Urgency(False, NONE, 0, -1.0))
    deep_new = Fixed("deep_new", Urgency(False, NONE, 2, -5.0))
    idle = Fixed("idle", None)
    for w in (shallow_old, deep_new, idle):
        loop.add_worker(w)
    assert loop.pick(0.0) is deep_new
    due_soon = Fixed("due_soon", Urgency(False, -100.0, 0, -7.0))
    loop.add_worker(due_soon)
    assert loop.pick(0.0) is due_soon  # a deadline beats depth and age
    overdue = Fixed("overdue", Urgency(True, NONE, 0, -9.0))
    loop.add_worker(overdue)
    assert loop.pick(0.0) is overdue
    graph = EngineLoop(policy="graph")  # deadlines ignored
    for w in (shallow_old, deep_new, due_soon):
        graph.add_worker(w)
    assert graph.pick(0.0) is deep_new
    fifo = EngineLoop(policy="fifo")
    for w in (shallow_old, deep_new, due_soon):
        fifo.add_worker(w)
    assert fifo.pick(0.0) is shallow_old
