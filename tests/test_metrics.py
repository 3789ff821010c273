"""/metrics on a real server: the exposition parses, and counters move with traffic."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from conftest import build_encoder, build_llm
from trae_groups.engine import EngineConfig
from trae_groups.serving.metrics import INFERENCE_MS_BUCKETS
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

SUPPORT = """
name: support
models:
  intent: {{source: {root}/intent, task: classify}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "Intent: {{{{ intent.label }}}}. {{{{ inputs.text }}}}"
    params: {{max_tokens: 5, temperature: 0}}
outputs: {{intent: intent.label, reply: reply.text}}
"""
FAILS = """
name: fails
inputs: {text: str}
nodes:
  explode: {function: "metrics_test_nodes:explode", args: {text: "{{ inputs.text }}"}}
outputs: {never: explode}
"""
ROUTED = """
name: routed
models:
  clf: {{task: classify, versions: {{v1: {root}/intent, v2: {root}/intent2}}, route: {{v1: 50, v2: 50}}}}
inputs: {{text: str}}
nodes:
  label: {{model: clf, input: "{{{{ inputs.text }}}}"}}
outputs: {{label: label.label}}
"""
# long enough to fill whole pages, so a repeat hits the prefix cache
TEXT = "hello world, how are you today? the quick brown fox jumps over the lazy dog " * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("metrics")
    build_llm(root / "dialog", "llama")
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    build_encoder(root / "intent2", "classify", ["greet", "order", "spam"], seed=2)
    (root / "metrics_test_nodes.py").write_text("def explode(text):\n    raise ValueError('no')\n")
    sys.path.insert(0, str(root))
    (root / "support.yaml").write_text(SUPPORT.format(root=root))
    (root / "fails.yaml").write_text(FAILS)
    (root / "routed.yaml").write_text(ROUTED.format(root=root))
    app = create_app(
        [root / "support.yaml", root / "fails.yaml", root / "routed.yaml"],
        ServerConfig(engine=EngineConfig(pool_bytes=8 << 20)),
    )
    with ServerThread(app) as running:
        yield running
    sys.path.remove(str(root))


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels) -> value; parsing is the test."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def names(samples) -> set[str]:
    return {name for name, _ in samples}


def test_counters_move_with_requests(http):
    before = scrape(http)
    for _ in range(3):
        assert http.post("/v1/graphs/support", json={"inputs": {"text": TEXT}}).status_code == 200
    assert http.post("/v1/graphs/support", json={"inputs": {}}).status_code == 422
    assert http.post("/v1/graphs/fails", json={"inputs": {"text": "x"}}).status_code == 500
    after = scrape(http)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("trae_graph_requests_total", graph="support", code="200") == 3
    assert moved("trae_graph_requests_total", graph="support", code="422") == 1
    assert moved("trae_graph_errors_total", graph="support", type="InputError") == 1
    assert moved("trae_graph_errors_total", graph="fails", type="NodeError") == 1
    assert moved("trae_node_errors_total", graph="fails", node="explode") == 1
    assert moved("trae_graph_latency_seconds_count", graph="support") == 3
    for node in ("intent", "reply"):
        labels = {"graph": "support", "node": node, "version": "default"}
        assert moved("trae_node_runs_total", **labels, status="ok") == 3
        assert moved("trae_node_latency_seconds_count", **labels) == 3
        assert moved("trae_node_queue_seconds_count", **labels) == 3
    assert moved("trae_time_to_first_token_seconds_count", replica="local", model="dialog") == 3
    assert moved("trae_inter_token_latency_seconds_count", replica="local", model="dialog") == 3 * 4
    assert moved("trae_llm_generated_tokens_total", replica="local", model="dialog") == 15
    assert moved("trae_llm_batch_tokens_count", replica="local", model="dialog") >= 5
    assert moved("trae_encoder_items_total", replica="local", model="intent") == 3
    assert moved("trae_encoder_batch_size_count", replica="local", model="intent") >= 1
    for model in ("dialog", "intent"):  # each request waited in the engine's queue once
        assert moved("trae_engine_queue_seconds_count", replica="local", model=model) == 3
        waited = moved("trae_engine_queue_seconds_sum", replica="local", model=model)
        assert 0 <= waited <= moved("trae_graph_latency_seconds_sum", graph="support")
    assert moved("trae_prefix_cache_hits_total", replica="local") >= 1
    assert value(after, "trae_graph_inflight_requests", graph="support") == 0


def test_node_series_carry_the_model_version_a_run_used(http):
    before = scrape(http)
    picked = []
    for i in range(24):
        answer = http.post("/v1/graphs/routed", json={"inputs": {"text": f"hello {i}"}})
        assert answer.status_code == 200
        picked.append(answer.json()["versions"]["clf"])
    after = scrape(http)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    for version in ("v1", "v2"):  # each version's series counts exactly its own runs
        labels = {"graph": "routed", "node": "label", "version": version}
        assert moved("trae_node_runs_total", **labels, status="ok") == picked.count(version)
        assert moved("trae_node_latency_seconds_count", **labels) == picked.count(version)
    assert set(picked) == {"v1", "v2"}  # 24 draws of a 50/50 split: both, but for 2**-23


def test_inference_latency_is_a_histogram_in_ms_from_1_ms_to_120_s(http):
    http.post("/v1/graphs/support", json={"inputs": {"text": "hi"}})
    samples = scrape(http)
    buckets = sorted(
        dict(labels)["le"]
        for name, labels in samples
        if name == "inference_latency_bucket" and dict(labels)["graph"] == "support"
    )
    bounds = sorted(float(b) for b in buckets)
    assert bounds == [*INFERENCE_MS_BUCKETS, math.inf]
    assert bounds[0] == 1.0 and bounds[-2] == 120_000.0  # 1 ms to 120 s
    count = value(samples, "inference_latency_count", graph="support")
    assert count >= 1
    assert value(samples, "inference_latency_bucket", graph="support", le="+Inf") == count
    mean_ms = value(samples, "inference_latency_sum", graph="support") / count
    mean_s = value(samples, "trae_graph_latency_seconds_sum", graph="support") / value(
        samples, "trae_graph_latency_seconds_count", graph="support"
    )
    assert mean_ms == pytest.approx(mean_s * 1000)


def test_engine_pool_and_backend_are_reported(http, server):
    samples = scrape(http)
    info = [dict(labels) for name, labels in samples if name == "trae_engine_info"]
    expected = {"attention_backend": "torch", "device": "cpu", "dtype": "float32",
                "kv_cache_dtype": "auto"}  # fmt: skip
    assert info == [{**expected, "replica": "local"}]
    capacity = value(samples, "trae_pool_capacity_pages", replica="local")
    assert capacity == server.state.runtime.engine.pool.num_pages
    states = sum(
        value(samples, "trae_pool_pages", replica="local", state=s)
        for s in ("used", "free", "cached")
    )
    assert states == capacity
    for model in ("dialog", "intent"):
        assert (
            "trae_pool_model_usage_percent",
            (("model", model), ("replica", "local")),
        ) in samples
        assert (
            "trae_pool_model_pages",
            (("model", model), ("replica", "local"), ("state", "used")),
        ) in samples
    assert 0 <= value(samples, "trae_prefix_cache_hit_rate", replica="local") <= 1
    assert {
        "trae_llm_running_requests",
        "trae_llm_waiting_requests",
        "trae_llm_preemptions_total",
        "trae_encoder_queue_items",
        "trae_engine_steps_total",
    } <= names(samples)
    assert value(samples, "trae_ready") == 1
    node_info = {
        dict(labels)["node"]: dict(labels) for name, labels in samples if name == "trae_node_info"
    }
    assert node_info["reply"] == {"graph": "support", "node": "reply", "kind": "generate",
                                  "model": "dialog"}  # fmt: skip
    assert node_info["explode"]["kind"] == "python"


def test_device_utilization_is_a_fraction(http, server):
    http.post("/v1/graphs/support", json={"inputs": {"text": TEXT}})
    utilization = value(scrape(http), "device_utilization", device="cpu", replica="local")
    if hasattr(server.state.runtime.engine.loop, "busy_seconds"):
        assert 0 < utilization <= 1
    else:  # an engine without a busy-time counter reports "unknown"
        assert math.isnan(utilization)


def test_openai_requests_are_counted(http):
    before = scrape(http)
    body = {"model": "support/dialog", "prompt": "hello", "max_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 200
    after = scrape(http)
    labels = {"endpoint": "completions", "model": "support/dialog", "code": "200"}
    assert (
        value(after, "trae_openai_requests_total", **labels)
        - value(before, "trae_openai_requests_total", **labels)
        == 1
    )


def test_each_app_has_its_own_registry(server):
    spec = server.state.graphs["fails"].spec
    other = create_app([spec], ServerConfig())
    mine, theirs = server.state.metrics.registry, other.state.trae.metrics.registry
    assert mine is not theirs and REGISTRY not in (mine, theirs)
    text = other.state.trae.metrics.render().decode()
    assert "trae_ready 0.0" in text  # not started: no models, not ready
    assert not any(name.startswith("trae_") for name in REGISTRY._names_to_collectors)


# ---------------------------------------------------------------- one run scope per request
# trae_groups/serving/run_scope.py: every admitted request records exactly one outcome, whichever
# way it ends, and is released.


def settled(http: httpx.Client, server, before: dict, graphs: dict[str, int]) -> dict:
    """Scrape once every graph has recorded ``graphs[name]`` more requests (any code)
    and nothing is in flight (a stream is released after its last bytes)."""
    for _ in range(3000):  # bounded: the server ends a stream's scope right after it
        after = scrape(http)
        counts = {
            graph: sum(
                v - before.get((name, labels), 0.0)
                for (name, labels), v in after.items()
                if name == "trae_graph_requests_total" and dict(labels)["graph"] == graph
            )
            for graph in graphs
        }
        if counts == graphs and server.state.inflight == 0:
            return after
    raise AssertionError(f"gave up waiting for {graphs} outcomes; saw {counts}")


def test_every_way_a_request_ends_records_one_outcome_and_releases_it(http, server):
    before = scrape(http)
    text = {"inputs": {"text": TEXT}}
    assert http.post("/v1/graphs/support", json=text).status_code == 200
    assert http.post("/v1/graphs/support", json={"inputs": {}}).status_code == 422
    assert http.post("/v1/graphs/fails", json={"inputs": {"text": "x"}}).status_code == 500
    streamed = http.post("/v1/graphs/support", json={**text, "stream": True}).text
    assert "event: result" in streamed and streamed.endswith("event: done\ndata: {}\n\n")
    failed = http.post("/v1/graphs/fails", json={"inputs": {"text": "x"}, "stream": True}).text
    assert '"status":500' in failed and "event: done" in failed
    completion = {"model": "support/dialog", "prompt": "hello", "max_tokens": 2}
    assert http.post("/v1/completions", json=completion).status_code == 200
    refused = {**completion, "prompt": [100000]}  # outside the vocabulary: 422 at submit
    assert http.post("/v1/completions", json=refused).status_code == 422
    after = settled(http, server, before, {"support": 3, "fails": 2})

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("trae_graph_requests_total", graph="support", code="200") == 2
    assert moved("trae_graph_requests_total", graph="support", code="422") == 1
    assert moved("trae_graph_requests_total", graph="fails", code="500") == 2
    assert moved("trae_graph_errors_total", graph="fails", type="NodeError") == 2
    assert moved("trae_graph_latency_seconds_count", graph="support") == 2
    for code in ("200", "422"):  # a model call counts on its endpoint, not as a graph run
        labels = {"endpoint": "completions", "model": "support/dialog", "code": code}
        assert moved("trae_openai_requests_total", **labels) == 1
    assert value(after, "trae_graph_inflight_requests", graph="support") == 0
    assert all(g.inflight == 0 for g in server.state.graphs.values())


def test_a_client_that_leaves_a_stream_is_one_outcome_too(http, server):
    before = scrape(http)
    body = {"inputs": {"text": TEXT}, "stream": True}
    with http.stream("POST", "/v1/graphs/support", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                break  # the client leaves after the first event
    after = settled(http, server, before, {"support": 1})
    gone = value(after, "trae_graph_requests_total", graph="support", code="499")
    answered = value(after, "trae_graph_requests_total", graph="support", code="200")
    before_gone = value(before, "trae_graph_requests_total", graph="support", code="499")
    before_answered = value(before, "trae_graph_requests_total", graph="support", code="200")
    # left before the result (499) or after it (200): one of them, never both
    assert (gone - before_gone) + (answered - before_answered) == 1
