"""End-to-end deadlines: earliest-deadline-first in the workers, work dropped once its
deadline passes (pages back), refusal at admission when the estimate cannot make it,
and the metrics that count misses and goodput."""

from __future__ import annotations

import math
import re
import time

import httpx
import pytest

from conftest import build_encoder, node_module
from trae_groups.dsl import ModelGroup
from trae_groups.engine.batcher import DynamicBatcher
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.deadlines import Deadline, Priority, tightest
from trae_groups.engine.encoder_worker import EncoderWorker
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.errors import DeadlineExceeded
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.protocol import GenerateRequest
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.scheduler import Scheduler, SchedulerSettings
from trae_groups.engine.sequence import Sequence
from trae_groups.engine.weights import WeightStore
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.serving.admission import NodeTimes, ServiceRate, unreachable
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

FAR = 1e12  # an epoch time that never comes


def due(at: float | None, depth: int = 0, arrival: float = 0.0, drop: bool = True) -> Priority:
    return Priority(depth, arrival, None if at is None else Deadline(at, drop))


# ---------------------------------------------------------------- ordering, no model


def test_waiting_work_is_earliest_deadline_then_deeper_then_older():
    s = Scheduler(MemoryPool(64, 1024), "m", SchedulerSettings(4, 1, 64, policy="deadline"))
    order = {
        "none-deep": due(None, depth=5),  # no deadline: after every one with a deadline
        "late-deep": due(FAR - 1, depth=3),
        "soon-shallow": due(FAR - 9, depth=0, arrival=2.0),
        "soon-deep": due(FAR - 9, depth=1, arrival=3.0),  # same deadline: deeper first
        "soon-older": due(FAR - 9, depth=0, arrival=1.0),  # same depth: older first
    }
    for name, priority in order.items():
        s.add(Sequence(name, [1, 2, 3], SamplingParams(), lambda out: None, priority))
    ranked = [q.request_id for q in s.waiting]
    assert ranked == ["soon-deep", "soon-older", "soon-shallow", "late-deep", "none-deep"]


def test_a_running_decode_is_not_starved_by_more_urgent_waiting_work():
    s = Scheduler(MemoryPool(64, 1024), "m", SchedulerSettings(4, 2, 4, policy="deadline"))
    old = Sequence("old", [1, 2, 3], SamplingParams(), lambda out: None, due(FAR))
    s.add(old)
    first = s.schedule()
    old.num_computed, old.output_token_ids = 3, [9]  # prefilled, sampled: now decoding
    assert first.prefills[0].seq is old
    for i in range(3):  # tighter deadlines than the running one, more than the budget
        s.add(Sequence(f"urgent{i}", [1] * 8, SamplingParams(), lambda out: None, due(i + 1.0)))
    out = s.schedule()
    assert [i.seq.request_id for i in out.decodes] == ["old"]
    assert out.prefills[0].seq.request_id == "urgent0"  # the rest of the budget: due first


class Item:
    def __init__(self, name: str, at: float | None, length: int = 4):
        self.name, self.priority, self.length = name, due(at), length
        self.queued_at = 0.0


def test_an_encoder_batch_is_built_around_the_earliest_deadline():
    batcher = DynamicBatcher(max_batch_size=2, preferred_batch_size=1)
    for item in (Item("old", None), Item("loose", FAR), Item("tight", 5.0), Item("tie", 5.0)):
        batcher.add(item)
    first = lambda it: due_of(it)  # noqa: E731
    assert [it.name for it in batcher.take(0.0, first=first)] == ["tight", "tie"]
    assert [it.name for it in batcher.take(0.0)] == ["old", "loose"]  # no key: the oldest


def due_of(item: Item) -> float:
    return item.priority.deadline.at if item.priority.deadline else math.inf


def test_the_tightest_of_a_time_limit_and_an_absolute_deadline_wins():
    assert tightest() is None
    assert tightest(at=123.0) == Deadline(123.0)
    soon = tightest(0.5, FAR, drop=False)
    assert soon.at < FAR and not soon.drop and 0 < soon.remaining() <= 0.5
    assert tightest(1e6, 5.0).at == 5.0


# ---------------------------------------------------------------- the admission estimate


def test_admission_estimate_is_the_critical_path_or_the_queue_in_flight():
    times = NodeTimes()
    for node, seconds in (("a", 0.1), ("b", 0.3), ("c", 0.2)):
        times.observe(node, seconds)
    parents = {"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")}.__getitem__
    path = times.critical_path(["a", "b", "c", "d"], parents)
    assert path == pytest.approx(0.4)  # a then b; d not measured yet
    rate = ServiceRate()  # no completions measured: the path alone
    assert unreachable(rate, 50, path, left=0.5) is None
    refusal = unreachable(rate, 0, path, left=0.25)
    assert refusal.retry_after == 1 and "critical path 0.40 s" in refusal.reason
    rate = ServiceRate()
    rate.samples, rate.completed, rate.busy = 10, 10.0, 1.0  # 10 requests/s measured
    assert unreachable(rate, 3, path, left=0.5) is None  # 0.3 s of queue, 0.4 s of path
    assert unreachable(rate, 8, path, left=0.5).estimate == pytest.approx(0.8)


# ---------------------------------------------------------------- in a real worker


def _engine(path, **cfg) -> LLMEngine:
    """An engine whose loop the test steps itself (nothing runs between steps)."""
    return LLMEngine({"m": path}, EngineConfig(pool_bytes=8 << 20, fast_linear=False, **cfg))


@pytest.mark.parametrize(
    ("scheduling", "finish_order"),
    [("deadline", ["tight", "loose", "none"]), ("graph", ["none", "loose", "tight"])],
)
def test_an_llm_worker_admits_by_deadline_under_its_scheduling(llama_dir, scheduling, finish_order):
    eng = _engine(llama_dir, max_num_seqs=1, scheduling=scheduling)
    worker, done = eng.llms["m"], []
    submitted = {"none": due(None, depth=9), "loose": due(FAR, depth=5), "tight": due(FAR - 1)}
    for name, priority in submitted.items():
        sink = lambda out, name=name: done.append(name) if out.finished else None  # noqa: E731
        params = SamplingParams(max_tokens=3)
        worker.submit(GenerateRequest(name, params, prompt=(5, 6, 7), priority=priority), sink)
    eng.loop.run_until(lambda: len(done) == 3)
    assert done == finish_order
    eng.shutdown()


@pytest.mark.parametrize("drop", [True, False])
def test_work_past_its_deadline_is_dropped_and_its_pages_freed(llama_dir, drop):
    eng = _engine(llama_dir)
    worker, outs = eng.llms["m"], []
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    deadline = Deadline(time.time() + 1.0, drop)
    request = GenerateRequest(
        "r", params, prompt=(5, 6, 7, 8), priority=Priority(deadline=deadline)
    )
    worker.submit(request, outs.append)
    for _ in range(100):  # a few tokens, well within the second
        eng.loop.run_once()
        if outs and len(outs[-1].token_ids) >= 3:
            break
    assert eng.pool.stats().used_pages > 0 and not deadline.passed()
    time.sleep(max(0.0, deadline.remaining()) + 0.01)
    eng.loop.run_until(lambda: outs[-1].finished)
    last = outs[-1]
    if drop:
        assert last.finish_reason == "deadline" and len(last.token_ids) < 40
        assert worker.model_stats().counters["deadline_drops"] == 1
    else:  # on_deadline: finish
        assert last.finish_reason == "length" and len(last.token_ids) == 40
    assert eng.pool.stats().used_pages == 0
    eng.shutdown()


def test_an_encoder_item_past_its_deadline_fails_unrun(tmp_path):
    folder = build_encoder(tmp_path / "clf", "classify", ["a", "b"])
    worker = EncoderWorker("clf", WeightStore().load(folder, "classify"))
    late = worker.submit("hello world", priority=due(time.time() - 1))
    kept = worker.submit("hello world", priority=due(FAR))
    worker.step()
    with pytest.raises(DeadlineExceeded):
        late.result(timeout=0)
    assert kept.result(timeout=0)["label"] in ("a", "b")
    stats = worker.model_stats()
    assert stats.counters["deadline_drops"] == 1 and stats.counters["items"] == 1


# ---------------------------------------------------------------- the graph file


def _one_node(group: ModelGroup) -> ModelGroup:
    text = group.input("t", str)
    group.output("t", group.python("say", function="graph_functions:shout", args={"text": text}))
    return group


def test_on_deadline_in_the_dsl_and_its_default():
    assert _one_node(ModelGroup("g")).spec().on_deadline == "drop"
    finish = _one_node(ModelGroup("g", timeout=1, on_deadline="finish")).spec()
    assert finish.on_deadline == "finish"


def test_on_deadline_is_checked_at_load_with_file_and_line():
    text = "name: g\ntimeout: 1s\non_deadline: later\ninputs: {t: str}\nnodes: {}\noutputs: {}\n"
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(text, "g.yaml")
    issue = err.value.issues[0]
    assert (issue.file, issue.line) == ("g.yaml", 3) and "drop" in issue.message


# ---------------------------------------------------------------- over HTTP

MODULE = "deadline_test_nodes"
SOURCE = """
import anyio


async def nap(seconds: float) -> dict:
    await anyio.sleep(seconds)
    return {"slept": seconds}
"""
GRAPHS = {
    # refused at admission when the measured critical path cannot fit
    "napping": """
name: napping
timeout: 5s
inputs: {s: float}
nodes:
  nap: {function: "deadline_test_nodes:nap", args: {seconds: "{{ inputs.s }}"}}
outputs: {slept: nap.slept}
""",
    # dropped at its deadline: a node that never ends beside an LLM node
    "hang": """
name: hang
models:
  dialog: {source: LLAMA, task: generate}
inputs: {text: str}
nodes:
  stuck: {function: "deadline_test_nodes:nap", args: {seconds: 30}}
  reply: {model: dialog, prompt: "{{ inputs.text }}", params: {max_tokens: 200}}
outputs: {reply: reply.text, stuck: stuck.slept}
""",
    # a chat graph (served on /v1/chat/completions) whose critical path is a nap
    "chatnap": """
name: chatnap
models:
  dialog: {source: LLAMA, task: generate}
inputs: {history: messages}
nodes:
  nap: {function: "deadline_test_nodes:nap", args: {seconds: 0.3}}
  reply: {model: dialog, messages: "{{ inputs.history }}", after: [nap], params: {max_tokens: 3}}
outputs: {reply: reply.text}
""",
    # finished late: the deadline orders and counts, it does not cut
    "late": """
name: late
timeout: 0.05s
on_deadline: finish
inputs: {s: float}
nodes:
  nap: {function: "deadline_test_nodes:nap", args: {seconds: "{{ inputs.s }}"}}
outputs: {slept: nap.slept}
""",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("deadlines")
    paths = []
    for name, text in GRAPHS.items():
        (root / f"{name}.yaml").write_text(text.replace("LLAMA", str(llama_dir)))
        paths.append(root / f"{name}.yaml")
    config = ServerConfig(engine=EngineConfig(pool_bytes=8 << 20, fast_linear=False))
    with node_module(root, MODULE, SOURCE), ServerThread(create_app(paths, config)) as running:
        yield running


def metric(server, line: str) -> float:
    for row in httpx.get(f"{server.url}/metrics").text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_that_cannot_make_its_deadline_is_refused_with_503(server):
    url = f"{server.url}/v1/graphs/napping"
    assert httpx.post(url, json={"inputs": {"s": 0.2}}).status_code == 200  # measured: 0.2 s
    goodput = metric(server, 'trae_graph_goodput_total{graph="napping"}')
    assert goodput == 1.0
    refused = httpx.post(url, json={"inputs": {"s": 0.2}, "timeout": 0.05})
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "DeadlineUnreachable"
    path = float(re.search(r"critical path ([0-9.]+) s", error["reason"]).group(1))
    assert 0.2 <= path < 1.0  # the nap measured by the first request
    header = {"X-Request-Deadline": f"{time.time() + 0.05:.3f}"}
    assert httpx.post(url, json={"inputs": {"s": 0.2}}, headers=header).status_code == 503
    assert metric(server, 'trae_graph_rejected_total{graph="napping",reason="deadline"}') == 2
    roomy = {"X-Request-Deadline": f"{time.time() + 3:.3f}"}
    assert httpx.post(url, json={"inputs": {"s": 0.2}}, headers=roomy).status_code == 200
    bad = httpx.post(url, json={"inputs": {"s": 0.2}}, headers={"X-Request-Deadline": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "X-Request-Deadline"


def test_without_deadline_admission_the_same_request_is_admitted_and_misses(tmp_path):
    (tmp_path / "napping.yaml").write_text(GRAPHS["napping"])
    config = ServerConfig(deadline_admission=False)
    with (
        node_module(tmp_path, MODULE, SOURCE),
        ServerThread(create_app([tmp_path / "napping.yaml"], config)) as running,
    ):
        url = f"{running.url}/v1/graphs/napping"
        assert httpx.post(url, json={"inputs": {"s": 0.2}}).status_code == 200
        missed = httpx.post(url, json={"inputs": {"s": 0.2}, "timeout": 0.05})
    assert missed.status_code == 504  # admitted, then dropped at its deadline


def test_a_missed_deadline_drops_every_node_and_frees_the_pool(server):
    pool = server.state.runtime.engine.pool
    header = {"X-Request-Deadline": f"{time.time() + 0.3:.3f}"}
    body = {"inputs": {"text": "hello world"}}
    answer = httpx.post(f"{server.url}/v1/graphs/hang", json=body, headers=header, timeout=10)
    assert answer.status_code == 504
    assert metric(server, 'trae_graph_deadline_misses_total{action="dropped",graph="hang"}') == 1
    dropped = 'trae_node_deadline_misses_total{action="dropped",graph="hang",node="stuck"}'
    assert metric(server, dropped) == 1
    for _ in range(500):  # the abort reaches the engine thread at its next step
        if pool.stats().used_pages == 0:
            break
        time.sleep(0.01)
    assert pool.stats().used_pages == 0


def test_on_deadline_finish_answers_late_and_counts_the_miss(server):
    answer = httpx.post(f"{server.url}/v1/graphs/late", json={"inputs": {"s": 0.2}})
    assert answer.status_code == 200 and answer.json()["outputs"] == {"slept": 0.2}
    assert metric(server, 'trae_graph_deadline_misses_total{action="late",graph="late"}') == 1
    late = 'trae_node_deadline_misses_total{action="late",graph="late",node="nap"}'
    assert metric(server, late) == 1
    assert metric(server, 'trae_graph_goodput_total{graph="late"}') == 0


def test_an_openai_chat_on_a_graph_is_refused_at_admission_too(server):
    url = f"{server.url}/v1/chat/completions"
    body = {"model": "chatnap", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url, json=body, timeout=10).status_code == 200  # measures the nap
    header = {"X-Request-Deadline": f"{time.time() + 0.05:.3f}"}
    refused = httpx.post(url, json=body, headers=header, timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "DeadlineUnreachable"
    assert metric(server, 'trae_graph_rejected_total{graph="chatnap",reason="deadline"}') == 1
    roomy = {"X-Request-Deadline": f"{time.time() + 5:.3f}"}
    assert httpx.post(url, json=body, headers=roomy, timeout=10).status_code == 200


def test_the_openai_timeout_extension_drops_a_generation_at_its_deadline(server):
    body = {"model": "dialog", "prompt": "hello", "max_tokens": 200, "ignore_eos": True,
            "timeout": 0.001}  # fmt: skip
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert answer.status_code == 504
    assert answer.json()["error"]["type"] == "DeadlineExceeded"
    assert server.state.runtime.engine.pool.stats().used_pages == 0
    rows = httpx.get(f"{server.url}/metrics").text.splitlines()
    drops = [r for r in rows if r.startswith("trae_llm_deadline_drops_total{")]
    assert drops and float(drops[0].rsplit(" ", 1)[1]) >= 1  # the engine dropped it itself
