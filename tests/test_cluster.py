"""Scale-out on Ray Serve: the same graph file on a local Ray cluster, over real HTTP.

One Ray cluster for the session, shared with the other modules that deploy on Ray
(tests/ray_cluster.py); this module's app, ``trae``, is deleted when it ends. Fractional
CPUs, short graceful shutdowns. The support graph runs with its LLM in a group of its
own, two replicas: the same outputs as in one process, SSE, OpenAI, session affinity, a
disconnect that frees the replica's pages, a replica killed mid-stream (clean errors,
recovery); then a redeploy with autoscaling that scales up under load and back down.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from ray_cluster import deployed

from conftest import LORA_VARIANTS, build_encoder, build_llm, build_lora
from trae_groups.engine import EngineConfig
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.timeout(600)

ENGINE = EngineConfig(pool_bytes=8 << 20, fast_linear=False, num_threads=1)
TEXTS = ["hello where is my order", "john wants a refund", "ship to paris please"]
# what most tests ask for (story is 1,500 tokens); tuned runs on a LoRA adapter, whose
# name crosses to the replica inside the GenerateRequest
SHORT = ["intent", "reply", "tuned", "recap", "checked"]


def graph_yaml(root: Path, deploy: str) -> str:
    return f"""
name: support
models:
  intent: {{source: {root / "intent"}, task: classify}}
  dialog: {{source: {root / "dialog"}, task: generate, adapters: {{terse: {root / "terse"}}}}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "Intent: {{{{ intent.label }}}}. User: {{{{ inputs.text }}}}. Assistant:"
    params: {{max_tokens: 8}}
  tuned: {{model: dialog, adapter: terse, prompt: "User: {{{{ inputs.text }}}}", params: {{max_tokens: 8}}}}
  story: {{model: dialog, prompt: "Story: {{{{ inputs.text }}}}", params: {{max_tokens: 1500}}}}
  check:  # a guard on the reply's stream (it holds the reply's tokens until it passes them)
    model: intent
    follows: {{node: reply, tokens: 3}}
    input: "{{{{ reply.piece }}}}"
    cut_when: "check.label == 'never'"
  recap:  # prefilled on the llm group's replica as the reply streams
    model: dialog
    follows: {{node: reply, tokens: 2}}
    prompt: "Intent: {{{{ intent.label }}}}. User: {{{{ inputs.text }}}}. Recap: {{{{ reply.text }}}}"
    params: {{max_tokens: 4}}
outputs: {{intent: intent.label, reply: reply.text, tuned: tuned.text, story: story.text, recap: recap.text,
           checked: check.last.label}}
deploy:
  ingress: {{num_cpus: 0.1}}
{deploy}
"""


TWO_GROUPS = """  groups:
    engine: {num_cpus: 0.2}
    llm: {models: [dialog], replicas: 2, num_cpus: 0.2}
"""
AUTOSCALED = """  groups:
    engine: {num_cpus: 0.2}
    llm:
      models: [dialog]
      num_cpus: 0.2
      autoscaling: {min: 1, max: 2, target_pending: 2, upscale_delay_s: 1, downscale_delay_s: 4}
"""


def wait_until(condition, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cluster_models")
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"], seed=3)
    build_llm(root / "dialog", "llama", max_position_embeddings=4096)  # long generations
    build_lora(root / "terse", root / "dialog", **LORA_VARIANTS["short"])
    return root


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The session's Ray cluster (its Serve proxy's URL), this module's app on it
    deleted when the module ends."""
    with deployed("trae"):
        yield ray_cluster


def deploy(models: Path, tmp: Path, deploy_section: str) -> None:
    from trae_groups.cluster.app import ClusterOptions, build

    path = tmp / "support.yaml"
    path.write_text(graph_yaml(models, deploy_section))
    options = ClusterOptions(
        graceful_shutdown_timeout_s=1, graceful_shutdown_wait_loop_s=0.1,
        health_check_period_s=1, autoscaling_look_back_s=2,
    )  # fmt: skip
    serve.run(build([path], ENGINE, options=options), name="trae", route_prefix="/")


@pytest.fixture(scope="module")
def http(cluster, models, tmp_path_factory):
    started = time.monotonic()
    deploy(models, tmp_path_factory.mktemp("graph"), TWO_GROUPS)
    client = httpx.Client(base_url=cluster, timeout=60)
    wait_until(lambda: client.get("/ready").status_code == 200, "the ingress to be ready")
    wait_until(lambda: len(replicas("llm")) == 2, "both LLM replicas to post stats")
    print(f"deployed in {time.monotonic() - started:.1f} s")
    yield client
    client.close()


def replicas(group: str) -> dict[str, int]:
    """Live engine replicas of a group (replica id -> pid), from the stats board."""
    from trae_groups.cluster.board import board

    posts = ray.get(board("trae").read.remote())
    return {r: pid for r, (g, pid, _stats) in posts.items() if g == group}


def scheduled_replicas(group: str) -> int:
    """Replicas of a group that Serve is starting or running: the autoscaler's decision, seen
    before the new replica has loaded its model (which takes minutes on a loaded machine)."""
    from ray import serve

    from trae_groups.cluster.app import APP_NAME

    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return 0
    return sum(
        count
        for name, deployment in app.deployments.items()
        if name.endswith(f"-{group}")
        for state, count in deployment.replica_states.items()
        if str(getattr(state, "value", state)) in ("STARTING", "RUNNING", "UPDATING")
    )


def board_stats() -> dict:
    from trae_groups.cluster.board import board

    return {r: stats for r, (_g, _pid, stats) in ray.get(board("trae").read.remote()).items()}


def sse(response) -> list[tuple[str, dict]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[len("data: ") :])))
    return events


# ---------------------------------------------------------------- no cluster needed


def test_deploy_section_is_checked_at_load(models):
    bad = graph_yaml(
        models,
        "  groups:\n    llm: {models: [dialgo]}\n    two: {models: [dialog]}\n    three: {models: [dialog]}\n",
    )
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(bad, "g.yaml")
    messages = [i.message for i in err.value.issues]
    assert any("unknown model 'dialgo' (did you mean 'dialog'?)" in m for m in messages)
    assert any("model 'dialog' is in groups 'two' and 'three'" in m for m in messages)
    both = graph_yaml(
        models, "  groups:\n    llm: {models: [dialog], replicas: 2, autoscaling: {}}\n"
    )
    with pytest.raises(GraphValidationError, match="'replicas' or 'autoscaling'"):
        load_graph_text(both, "g.yaml")
    spec = load_graph_text(graph_yaml(models, TWO_GROUPS), "g.yaml")
    assert spec.deploy.group_of(["intent", "dialog"]) == {"intent": "engine", "dialog": "llm"}


def test_serve_config_lists_each_group(models, tmp_path):
    from trae_groups.cluster.app import ClusterOptions, group_options, serve_config

    path = tmp_path / "g.yaml"
    path.write_text(graph_yaml(models, AUTOSCALED))
    config = serve_config([path], "127.0.0.1", 8000)
    app = config["applications"][0]
    assert app["import_path"] == "trae_groups.cluster.app:app_builder"
    assert app["args"] == {"graphs": [str(path.resolve())]}
    assert [d["name"] for d in app["deployments"]] == ["support-engine", "support-llm"]
    spec = load_graph_text(path.read_text(), str(path))
    options = group_options(spec.deploy.group("llm"), ClusterOptions())
    scaling = options["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 2)
    assert scaling.target_ongoing_requests == 2
    assert scaling.policy.policy_function == "trae_groups.cluster.policy:PendingWorkPolicy"
    assert options["ray_actor_options"] == {"num_cpus": 0.2}


def test_kuberay_example_is_a_valid_graph_and_serve_config():
    import yaml

    examples = Path(__file__).resolve().parents[1] / "examples" / "kuberay"
    spec = load_graph_text((examples / "support.yaml").read_text(), "support.yaml")
    assert spec.deploy.group_of(list(spec.models))["dialog"] == "llm"
    service = yaml.safe_load((examples / "rayservice.yaml").read_text())
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "trae_groups.cluster.app:app_builder"
    from trae_groups.cluster import app as cluster_app

    assert callable(cluster_app.app_builder)


def test_cli_prints_the_serve_config(models, tmp_path):
    import subprocess
    import sys

    import yaml

    path = tmp_path / "g.yaml"
    path.write_text(graph_yaml(models, TWO_GROUPS))
    done = subprocess.run(
        [sys.executable, "-m", "trae_groups.cli", "serve", str(path), "--ray-config", "--port", "9001"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    assert config["http_options"]["port"] == 9001
    replicas = {d["name"]: d.get("num_replicas") for d in config["applications"][0]["deployments"]}
    assert replicas == {"support-engine": 1, "support-llm": 2}


# ---------------------------------------------------------------- on the cluster


def test_same_outputs_as_in_one_process(http, models, tmp_path):
    from trae_groups.local import LocalGraph

    path = tmp_path / "support.yaml"
    path.write_text(graph_yaml(models, TWO_GROUPS))
    with LocalGraph(path, ENGINE) as local:
        for text in TEXTS:
            body = {"inputs": {"text": text}, "outputs": SHORT}
            remote = http.post("/v1/graphs/support", json=body)
            assert remote.status_code == 200, remote.text
            assert remote.json()["outputs"] == local.run({"text": text}, outputs=SHORT).outputs


def test_streaming_and_openai(http):
    whole = http.post(
        "/v1/graphs/support", json={"inputs": {"text": TEXTS[0]}, "outputs": SHORT}
    ).json()
    body = {"inputs": {"text": TEXTS[0]}, "outputs": SHORT, "stream": True}
    with http.stream("POST", "/v1/graphs/support", json=body) as response:
        assert response.status_code == 200
        events = sse(response)
    kinds = [k for k, _ in events]
    assert kinds[-2:] == ["result", "done"] and "token" in kinds
    reply = "".join(d["text"] for k, d in events if k == "token" and d["node"] == "reply")
    assert reply == whole["outputs"]["reply"]
    recap = "".join(d["text"] for k, d in events if k == "token" and d["node"] == "recap")
    assert recap == whole["outputs"]["recap"]
    assert {d["node"] for k, d in events if k == "piece"} == {"check"}  # the guard ran
    assert events[-2][1]["outputs"] == whole["outputs"]
    done = http.post(
        "/v1/completions",
        json={"model": "support/dialog", "prompt": "hello world", "max_tokens": 6},
    )
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] >= 1
    bad = http.post("/v1/completions", json={"model": "support/dialog", "prompt": "hi", "top_p": 0})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "top_p"
    empty = http.post("/v1/completions", json={"model": "support/dialog", "prompt": ""})
    assert empty.status_code == 422  # the replica's RequestError crosses as itself


def test_metrics_carry_each_replica(http):
    text = http.get("/metrics").text
    used = [line for line in text.splitlines() if line.startswith("trae_pool_pages{")]
    labelled = {line.split('replica="')[1].split('"')[0] for line in used}
    assert len(labelled) == 3  # the encoder group's replica and both LLM replicas
    assert "trae_graph_requests_total" in text


def llm_steps() -> dict[str, int]:
    return {
        r: int(s.models["dialog"].counters["steps"])
        for r, s in board_stats().items()
        if "dialog" in s.models
    }


def test_a_session_stays_on_one_replica(http):
    time.sleep(1.5)  # the board holds posts at most a second old
    before = llm_steps()
    for i in range(6):
        answer = http.post(
            "/v1/graphs/support",
            json={"inputs": {"text": f"{TEXTS[1]} {i}"}, "outputs": SHORT},
            headers={"X-Session-ID": "user-42"},
        )
        assert answer.status_code == 200
    time.sleep(2.5)
    after = llm_steps()
    moved = {r: after[r] - before.get(r, 0) for r in after}
    assert sorted(v > 0 for v in moved.values()) == [False, True], moved


def test_disconnect_frees_the_replicas_pages(http):
    time.sleep(1.5)
    before = sum(int(s.models["dialog"].counters["generated_tokens"])
                 for s in board_stats().values() if "dialog" in s.models)  # fmt: skip
    body = {"model": "support/dialog", "prompt": "hello world", "max_tokens": 200,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the client goes away after the first chunk

    def freed() -> bool:
        stats = board_stats().values()
        return all(s.pool.used_pages == 0 for s in stats) and all(
            m.running == 0 for s in stats for m in s.models.values()
        )

    wait_until(freed, "every replica's pages back in its pool", 30)
    after = sum(int(s.models["dialog"].counters["generated_tokens"])
                for s in board_stats().values() if "dialog" in s.models)  # fmt: skip
    assert after - before < 200  # the generation stopped early


def test_a_killed_replica_gives_clean_errors_and_serving_goes_on(http):
    from trae_groups.cluster.policy import _score

    session = "kill-me"
    live = replicas("llm")
    victim = max(live, key=lambda r: _score(session, r))  # where the router sends the session
    long = {"model": "support/dialog", "prompt": "hello", "max_tokens": 3000,
            "ignore_eos": True, "user": session}  # fmt: skip
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.update(plain=http.post("/v1/completions", json=long))
    )
    thread.start()

    def generating() -> bool:
        stats = board_stats().get(victim)
        return stats is not None and stats.models["dialog"].running >= 1

    wait_until(generating, "the long completion to run on the session's replica", 60)
    body = {"inputs": {"text": TEXTS[2]}, "outputs": ["story"], "stream": True}
    events, kind = [], None
    with http.stream(
        "POST", "/v1/graphs/support", json=body, headers={"X-Session-ID": session}
    ) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[len("data: ") :])))
                if kind == "token" and sum(k == "token" for k, _ in events) == 1:
                    os.kill(live[victim], signal.SIGKILL)  # mid-stream
    thread.join(60)
    # the stream ends with an error event naming the node, then done: never a cut 200
    kinds = [k for k, _ in events]
    assert kinds[-2:] == ["error", "done"], kinds[-5:]
    error = events[-2][1]
    assert error["status"] == 503 and error["error"]["node"] == "story", error
    # a non-streamed request on the same replica: 503 with Retry-After, not a hang
    plain = outcome["plain"]
    assert plain.status_code == 503, plain.text
    assert plain.headers["retry-after"]
    # new requests keep succeeding while Serve replaces the replica, the session's too
    for text in TEXTS:
        for headers in ({}, {"X-Session-ID": session}):
            body = {"inputs": {"text": text}, "outputs": SHORT}
            answer = http.post("/v1/graphs/support", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
    wait_until(
        lambda: len(replicas("llm")) == 2 and victim not in replicas("llm"),
        "Serve to replace the killed replica",
        120,
    )


def test_autoscaling_follows_pending_work(cluster, models, tmp_path):
    deploy(models, tmp_path, AUTOSCALED)
    http = httpx.Client(base_url=cluster, timeout=120)
    wait_until(lambda: http.get("/ready").status_code == 200, "the ingress to be ready")
    wait_until(lambda: len(replicas("llm")) == 1, "one LLM replica")
    stop = threading.Event()
    body = {"model": "support/dialog", "prompt": "hello", "max_tokens": 64, "ignore_eos": True}

    def load() -> None:
        for _ in range(200):  # bounded
            if stop.is_set():
                return
            http.post("/v1/completions", json=body)

    workers = [threading.Thread(target=load) for _ in range(8)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: scheduled_replicas("llm") == 2, "a second replica under load", 90)
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    wait_until(lambda: scheduled_replicas("llm") == 1, "back to one replica after the load", 120)
    http.close()


@pytest.mark.parametrize(
    "field, value, where",
    [
        ("num_cpus", 0.3, lambda o: o["ray_actor_options"]["num_cpus"]),
        ("num_gpus", 1.0, lambda o: o["ray_actor_options"]["num_gpus"]),
        ("memory", 10**9, lambda o: o["ray_actor_options"]["memory"]),
        ("replicas", 3, lambda o: o["num_replicas"]),
        ("max_ongoing_requests", 7, lambda o: o["max_ongoing_requests"]),
        ("autoscaling.min", 2, lambda o: o["autoscaling_config"].min_replicas),
        ("autoscaling.max", 9, lambda o: o["autoscaling_config"].max_replicas),
        ("autoscaling.target_pending", 3.0, lambda o: o["autoscaling_config"].target_ongoing_requests),
        ("autoscaling.target_utilization", 0.5,
         lambda o: o["autoscaling_config"].policy.policy_kwargs["target_utilization"]),
        ("autoscaling.upscale_delay_s", 4.0, lambda o: o["autoscaling_config"].upscale_delay_s),
        ("autoscaling.downscale_delay_s", 8.0, lambda o: o["autoscaling_config"].downscale_delay_s),
    ],
)  # fmt: skip
def test_every_group_option_reaches_serve(field, value, where):
    from trae_groups.cluster.app import ClusterOptions, group_options
    from trae_groups.graphs.deploy import Autoscaling, GroupSpec

    if field.startswith("autoscaling."):
        group = GroupSpec(autoscaling=Autoscaling(**{field.split(".")[1]: value, "max": 9}))
    else:
        group = GroupSpec(**{field: value})
    assert where(group_options(group, ClusterOptions())) == value


def test_every_group_and_autoscaling_field_has_a_row():
    from trae_groups.graphs.deploy import Autoscaling, GroupSpec

    # a field added to the deploy section needs a row in the table above
    named = {
        "num_cpus", "num_gpus", "memory", "replicas", "max_ongoing_requests", "models",
        "autoscaling",
    }  # fmt: skip
    assert set(GroupSpec.model_fields) == named
    assert set(Autoscaling.model_fields) == {
        "min", "max", "target_pending", "target_utilization", "upscale_delay_s",
        "downscale_delay_s",
    }  # fmt: skip
