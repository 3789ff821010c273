"""The HTTP server end to end: a real uvicorn on 127.0.0.1, real tiny models, httpx.

One server serves every graph of this module; tests that stop a server build their
own small one (python nodes only, so it starts at once).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import importlib
import json
import random
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest

from conftest import build_encoder, build_llm, parse_sse, wait_until
from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

TOKEN = "test-admin-token"
NODES_MODULE = "server_test_nodes"
NODES_SOURCE = '''
"""Python nodes the server tests drive: gates the test opens, a failing node."""
import threading

import anyio

GATES = {}


def gate(key):
    return GATES.setdefault(key, threading.Event())


async def held(key: str) -> dict:
    event = gate(key)
    for _ in range(100_000):  # bounded: a test that forgets to open the gate fails
        if event.is_set():
            return {"released": key}
        await anyio.sleep(0.005)
    raise TimeoutError(f"gate {key!r} never opened")


def explode(text: str) -> dict:
    raise ValueError(f"cannot handle {text!r}")


def echo(text: str) -> dict:
    return {"echo": text}
'''

SUPPORT = """
name: support
models:
  intent: {{source: {root}/intent, task: classify}}
  ner: {{source: {root}/ner, task: tag}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  entities: {{model: ner, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "Intent: {{{{ intent.label }}}}. User: {{{{ inputs.text }}}}\\nAssistant:"
    params: {{max_tokens: 6, temperature: 0}}
outputs: {{intent: intent.label, entities: entities.spans, reply: reply.text}}
"""
STORY = """
name: story
models:
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str}}
nodes:
  tell: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 900, temperature: 0, ignore_eos: true}}}}
outputs: {{story: tell.text}}
"""
HELD = """
name: held
inputs: {key: str}
nodes:
  wait: {function: "server_test_nodes:held", args: {key: "{{ inputs.key }}"}}
outputs: {done: wait}
"""
FAILS = """
name: fails
inputs: {text: str}
nodes:
  explode: {function: "server_test_nodes:explode", args: {text: "{{ inputs.text }}"}}
outputs: {never: explode}
"""
AB = """
name: ab
models:
  intent:
    versions: {{v1: {root}/intent, v2: {root}/intent2}}
    route: {{v1: 100}}
    task: classify
inputs: {{text: str}}
nodes:
  c: {{model: intent, input: "{{{{ inputs.text }}}}"}}
outputs: {{label: c.label}}
"""
ECHO = """
name: echo
inputs: {text: str}
nodes:
  say: {function: "server_test_nodes:echo", args: {text: "{{ inputs.text }}"}}
outputs: {said: say.echo}
"""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_nodes")
    (folder / f"{NODES_MODULE}.py").write_text(NODES_SOURCE)
    sys.path.insert(0, str(folder))
    yield importlib.import_module(NODES_MODULE)
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def root(tmp_path_factory, nodes) -> Path:
    root = tmp_path_factory.mktemp("server")
    build_llm(root / "dialog", "llama", max_position_embeddings=1024)
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    build_encoder(root / "ner", "tag", ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"], seed=1)
    build_encoder(root / "intent2", "classify", ["greet", "order", "spam"], seed=2)
    for name, text in {"support": SUPPORT, "story": STORY, "ab": AB}.items():
        (root / f"{name}.yaml").write_text(text.format(root=root))
    for name, text in {"held": HELD, "fails": FAILS, "echo": ECHO}.items():
        (root / f"{name}.yaml").write_text(text)
    return root


@pytest.fixture(scope="module")
def server(root):
    names = ("support", "story", "held", "fails", "echo", "ab")
    graphs = [root / f"{n}.yaml" for n in names]
    config = ServerConfig(
        engine=EngineConfig(pool_bytes=16 << 20),
        graph_limits={"held": 1},
        max_body_bytes=1 << 16,
        admin_token=TOKEN,
    )
    with ServerThread(create_app(graphs, config)) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert {"type", "message"} <= set(body["error"])
    return body["error"]


# ---------------------------------------------------------------- operations


def test_health_and_ready(client):
    assert client.get("/health").json() == {"status": "ok", "draining": False}
    ready = client.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["graphs"] == ["ab", "echo", "fails", "held", "story", "support"]


def test_list_graphs(client):
    graphs = {g["name"]: g for g in client.get("/v1/graphs").json()["graphs"]}
    assert set(graphs) == {"support", "story", "held", "fails", "echo", "ab"}
    assert graphs["support"]["inputs"] == {"text": "str"}
    assert graphs["support"]["outputs"] == ["intent", "entities", "reply"]
    assert graphs["support"]["models"] == ["dialog", "intent", "ner"]


def test_describe_graph_has_schemas_nodes_edges_models(client):
    graph = client.get("/v1/graphs/support").json()
    assert graph["inputs"]["required"] == ["text"]
    assert graph["inputs"]["properties"]["text"]["type"] == "string"
    assert graph["outputs"]["properties"]["intent"] == {
        "anyOf": [{"type": "string"}, {"type": "null"}]
    }
    nodes = {n["name"]: n for n in graph["nodes"]}
    assert nodes["reply"]["parents"] == ["intent"]
    assert nodes["reply"]["depth"] == 1
    assert {"from": "intent", "to": "reply", "via": "reference"} in graph["edges"]
    assert graph["models"]["dialog"]["task"] == "generate"
    assert graph["max_inflight"] == 256


# ---------------------------------------------------------------- running


def test_run_returns_outputs_and_node_timings(client):
    response = client.post("/v1/graphs/support", json={"inputs": {"text": "where is my order"}})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"request_id", "outputs", "nodes", "ms"}
    assert response.headers["x-request-id"] == body["request_id"]
    assert body["outputs"]["intent"] in {"greet", "order", "spam"}
    assert isinstance(body["outputs"]["entities"], list)
    assert isinstance(body["outputs"]["reply"], str)
    assert {n: v["status"] for n, v in body["nodes"].items()} == {
        "intent": "ok",
        "entities": "ok",
        "reply": "ok",
    }
    assert all(v["ms"] >= 0 for v in body["nodes"].values())


def test_asking_for_some_outputs_runs_only_their_nodes(client):
    body = client.post(
        "/v1/graphs/support", json={"inputs": {"text": "hello"}, "outputs": ["intent"]}
    ).json()
    assert list(body["outputs"]) == ["intent"]
    assert list(body["nodes"]) == ["intent"]


def test_stream_sends_node_events_tokens_result_then_done(client):
    with client.stream(
        "POST", "/v1/graphs/support", json={"inputs": {"text": "hello john"}, "stream": True}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read().decode())
    kinds = [kind for kind, _ in events]
    assert kinds[-2:] == ["result", "done"]
    assert kinds.count("node_started") == 3 and kinds.count("node_finished") == 3
    tokens = [data for kind, data in events if kind == "token"]
    assert tokens and all(t["node"] == "reply" for t in tokens)
    result = events[-2][1]
    assert "".join(t["text"] for t in tokens) == result["outputs"]["reply"]
    assert set(result["nodes"]) == {"intent", "entities", "reply"}
    reply_started = kinds.index("node_started", kinds.index("node_finished"))
    assert kinds.index("token") > reply_started


def test_stream_of_a_failing_graph_ends_with_error_then_done(client):
    response = client.post("/v1/graphs/fails", json={"inputs": {"text": "x"}, "stream": True})
    events = parse_sse(response.text)
    assert [kind for kind, _ in events][-2:] == ["error", "done"]
    error = events[-2][1]
    assert error["status"] == 500
    assert error["error"]["node"] == "explode"


# ---------------------------------------------------------------- errors


def test_unknown_graph_is_404(client):
    response = client.post("/v1/graphs/nope", json={"inputs": {}})
    assert response.status_code == 404
    assert "nope" in error_of(response)["message"]
    assert client.get("/v1/graphs/nope").status_code == 404
    assert error_of(client.get("/no/such/route"))["type"] == "NotFound"


def test_wrong_method_is_405_with_the_error_body(client):
    assert error_of(client.put("/v1/graphs/support"))["type"] == "MethodNotAllowed"


@pytest.mark.parametrize(
    ("content", "field"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'{"inputs": "text"}', "inputs"),
        (b'{"inputs": {}, "stream": "yes"}', "stream"),
        (b'{"inputs": {}, "timeout": -1}', "timeout"),
        (b'{"inputs": {}, "colour": "red"}', "colour"),
    ],
)
def test_bad_body_is_400(client, content, field):
    response = client.post(
        "/v1/graphs/support", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert error_of(response).get("field") == field


def test_body_over_the_limit_is_413(client):
    big = json.dumps({"inputs": {"text": "x" * (1 << 16)}}).encode()
    assert client.post("/v1/graphs/support", content=big).status_code == 413

    def chunks():  # no Content-Length: the limit holds while streaming the body in
        for _ in range(20):
            yield b" " * 4096

    response = client.post("/v1/graphs/support", content=chunks())
    assert response.status_code == 413
    assert error_of(response)["type"] == "PayloadTooLarge"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"inputs": {}}, "inputs.text"),
        ({"inputs": {"text": 5}}, "inputs.text"),
        ({"inputs": {"text": "hi", "extra": 1}}, "inputs.extra"),
        ({"inputs": {"text": "hi"}, "outputs": ["nope"]}, "outputs"),
    ],
)
def test_invalid_inputs_are_422_naming_the_field(client, body, field):
    response = client.post("/v1/graphs/support", json=body)
    assert response.status_code == 422
    assert error_of(response)["field"] == field


def test_a_prompt_the_model_cannot_take_is_422_naming_node_and_field(client):
    response = client.post("/v1/graphs/story", json={"inputs": {"text": ""}})
    assert response.status_code == 422
    error = error_of(response)
    assert (error["node"], error["field"]) == ("tell", "prompt")


def test_node_failure_is_500_naming_the_node(client):
    response = client.post("/v1/graphs/fails", json={"inputs": {"text": "boom"}})
    assert response.status_code == 500
    error = error_of(response)
    assert error["node"] == "explode"
    assert "cannot handle 'boom'" in error["message"]


def test_timeout_is_504(client):
    response = client.post("/v1/graphs/held", json={"inputs": {"key": "never"}, "timeout": 0.1})
    assert response.status_code == 504
    assert error_of(response)["type"] == "GraphTimeout"


def test_more_than_max_inflight_is_429_with_retry_after(server, client, nodes):
    served = server.state.graphs["held"]
    first: dict = {}
    worker = threading.Thread(
        target=lambda: first.update(
            r=client.post("/v1/graphs/held", json={"inputs": {"key": "429"}})
        )
    )
    worker.start()
    try:
        wait_until(lambda: served.inflight == 1, "the first request to be admitted")
        with httpx.Client(base_url=server.url, timeout=60) as other:
            refused = other.post("/v1/graphs/held", json={"inputs": {"key": "other"}})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert error_of(refused)["type"] == "QueueFull"
    finally:
        nodes.gate("429").set()
        worker.join(60)
    assert first["r"].status_code == 200
    assert first["r"].json()["outputs"]["done"] == {"released": "429"}
    assert served.inflight == 0


# ---------------------------------------------------------------- disconnects


def _llm(server):
    engine = server.state.runtime.engine
    return engine, engine.llms["dialog"]


def test_client_leaving_mid_stream_cancels_and_frees_pages(server, client):
    engine, worker = _llm(server)
    wait_until(lambda: engine.pool.stats().used_pages == 0, "an idle pool")
    generated = worker.counters.generated
    with client.stream(
        "POST", "/v1/graphs/story", json={"inputs": {"text": "Once upon a time"}, "stream": True}
    ) as response:
        # the iterator held: a `for` over a temporary one closes it at `break`, and
        # httpx then drops the connection, so the server may abort before the check
        lines = response.iter_lines()
        for line in lines:
            if line == "event: token":
                break
        assert engine.pool.stats().used_pages > 0
    # leaving the block closed the connection mid-stream
    wait_until(lambda: worker.stats()["running"] == 0, "the request to be aborted")
    wait_until(lambda: engine.pool.stats().used_pages == 0, "pages back in the pool")
    assert worker.counters.generated - generated < 900
    assert server.state.graphs["story"].inflight == 0


def test_client_leaving_a_plain_request_cancels_and_frees_pages(server):
    engine, worker = _llm(server)
    wait_until(lambda: engine.pool.stats().used_pages == 0, "an idle pool")
    generated = worker.counters.generated
    body = json.dumps({"inputs": {"text": "hello where is my order to paris"}}).encode()
    head = (
        f"POST /v1/graphs/story HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((server.host, server.port)) as raw:
        raw.sendall(head + body)
        wait_until(lambda: worker.stats()["running"] == 1, "generation to start")
    wait_until(lambda: worker.stats()["running"] == 0, "the request to be aborted")
    wait_until(lambda: engine.pool.stats().used_pages == 0, "pages back in the pool")
    assert worker.counters.generated - generated < 900
    assert server.state.graphs["story"].inflight == 0


def test_mixed_load_with_faults_loses_nothing_and_leaks_no_pages(server):
    """32 concurrent clients, 4 requests each, a seeded mix of good runs, streams left
    after their first token, plain requests dropped mid-run, and bad bodies: every good
    request gets its answer, every bad one its 4xx, and afterwards no page, admission
    or engine request is left behind and the server still answers."""
    engine, worker = _llm(server)
    wait_until(lambda: engine.pool.stats().used_pages == 0, "an idle pool")
    generated = worker.counters.generated
    rng = random.Random(7)
    kinds = ["ok", "ok", "ok", "leave_stream", "drop", "bad_json", "bad_input", "too_big"]
    plan = [[rng.choice(kinds) for _ in range(4)] for _ in range(32)]
    seen: collections.Counter[str] = collections.Counter()

    async def request(http: httpx.AsyncClient, kind: str, i: int) -> None:
        text = f"hello {i}, where is my order to paris"
        if kind == "ok":
            r = await http.post("/v1/graphs/support", json={"inputs": {"text": text}})
            assert r.status_code == 200, r.text
            assert set(r.json()["outputs"]) == {"intent", "entities", "reply"}
        elif kind == "leave_stream":
            body = {"inputs": {"text": text}, "stream": True}
            async with http.stream("POST", "/v1/graphs/story", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line == "event: token":
                        break  # leaving the block closes the connection mid-stream
        elif kind == "drop":
            try:  # gone after 30 ms, mid-generation or before: either must leak nothing
                await http.post("/v1/graphs/story", json={"inputs": {"text": text}}, timeout=0.03)
            except httpx.TimeoutException:
                kind = "dropped"
        else:
            content = {"bad_json": b"{not json", "too_big": b"x" * ((1 << 16) + 1)}.get(kind)
            if content is not None:
                r = await http.post("/v1/graphs/support", content=content)
            else:
                r = await http.post("/v1/graphs/support", json={"inputs": {}})
            assert r.status_code == {"bad_json": 400, "too_big": 413, "bad_input": 422}[kind]
            assert "error" in r.json()
        seen[kind] += 1

    async def client(steps: list[str], n: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            for j, kind in enumerate(steps):
                await request(http, kind, n * 10 + j)

    async def everyone() -> None:
        await asyncio.gather(*(client(steps, n) for n, steps in enumerate(plan)))

    asyncio.run(everyone())
    assert sum(seen.values()) == 32 * 4 and seen["ok"] > 0 and seen["leave_stream"] > 0
    wait_until(lambda: all(g.inflight == 0 for g in server.state.graphs.values()), "no admissions")
    wait_until(lambda: worker.stats()["running"] + worker.stats()["waiting"] == 0, "an idle LLM")
    wait_until(lambda: engine.pool.stats().used_pages == 0, "every page back in the pool")
    # the story graph asks for 900 tokens: left and dropped requests were aborted early
    gone = seen["leave_stream"] + seen["drop"] + seen["dropped"]
    assert worker.counters.generated - generated < 6 * seen["ok"] + 450 * gone
    after = httpx.post(
        f"{server.url}/v1/graphs/support", json={"inputs": {"text": "hi"}}, timeout=120
    )
    assert after.status_code == 200


# ---------------------------------------------------------------- admin


def test_admin_needs_the_bearer_token(client):
    assert client.post("/admin/graphs/echo/reload").status_code == 401
    wrong = client.post("/admin/graphs/echo/reload", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.headers["www-authenticate"] == "Bearer"


def test_reload_swaps_the_graph_and_keeps_it_when_the_file_is_broken(client, root):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    path = root / "echo.yaml"
    original = path.read_text()
    try:
        path.write_text(original.replace("said: say.echo", "said: say.echo, again: say.echo"))
        response = client.post("/admin/graphs/echo/reload", headers=auth)
        assert response.status_code == 200, response.text
        run = client.post("/v1/graphs/echo", json={"inputs": {"text": "hi"}}).json()
        assert run["outputs"] == {"said": "hi", "again": "hi"}

        path.write_text(original.replace("say.echo", "sya.echo"))
        broken = client.post("/admin/graphs/echo/reload", headers=auth)
        assert broken.status_code == 422
        issues = error_of(broken)["issues"]
        assert issues and issues[0]["line"] == 6 and "sya" in issues[0]["message"]
        run = client.post("/v1/graphs/echo", json={"inputs": {"text": "hi"}}).json()
        assert run["outputs"] == {"said": "hi", "again": "hi"}  # the last good graph
    finally:
        path.write_text(original)
        client.post("/admin/graphs/echo/reload", headers=auth)


def test_a_reload_does_not_silently_drop_a_live_split(client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    route, reload = "/admin/graphs/ab/models/intent/route", "/admin/graphs/ab/reload"
    try:
        assert client.post(route, headers=auth, json={"split": "v2:100%"}).status_code == 200
        refused = client.post(reload, headers=auth)
        assert refused.status_code == 409 and error_of(refused)["type"] == "LiveRoutes"
        assert "intent" in error_of(refused)["message"]
        assert client.get(route, headers=auth).json()["route"]["v2"] == 100.0  # kept
        done = client.post(f"{reload}?discard_live_routes=true", headers=auth)
        assert done.status_code == 200
        assert client.get(route, headers=auth).json()["route"] == {"v1": 100.0, "v2": 0.0}
    finally:
        client.post(route, headers=auth, json={"split": {"v1": 100}})


def test_reloading_keeps_the_models_that_are_still_used(server, client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    engine = server.state.runtime.engine
    workers = set(engine.loop.workers)
    for _ in range(2):
        assert client.post("/admin/graphs/story/reload", headers=auth).status_code == 200
    body = {"inputs": {"text": "hello"}, "outputs": ["intent"]}
    assert client.post("/v1/graphs/support", json=body).status_code == 200
    story = client.post("/v1/graphs/story", json={"inputs": {"text": "hi"}, "timeout": 60})
    assert story.status_code == 200
    wait_until(lambda: set(engine.loop.workers) == workers, "the same workers")


def test_in_flight_requests_finish_on_the_graph_they_started_on(server, client, root, nodes):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    path = root / "held.yaml"
    original = path.read_text()
    served = server.state.graphs["held"]
    first: dict = {}
    worker = threading.Thread(
        target=lambda: first.update(
            r=client.post("/v1/graphs/held", json={"inputs": {"key": "reload"}})
        )
    )
    worker.start()
    try:
        wait_until(lambda: served.inflight == 1, "a request in flight")
        path.write_text(original.replace("done: wait", "finished: wait"))
        assert client.post("/admin/graphs/held/reload", headers=auth).status_code == 200
        assert client.get("/v1/graphs/held").json()["outputs"]["required"] == ["finished"]
    finally:
        nodes.gate("reload").set()
        worker.join(60)
        path.write_text(original)
    assert list(first["r"].json()["outputs"]) == ["done"]  # the graph it was admitted on
    assert client.post("/admin/graphs/held/reload", headers=auth).status_code == 200


def test_admin_sets_the_split_between_model_versions(client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    path = "/admin/graphs/ab/models/intent/route"
    assert client.get(path).status_code == 401
    assert client.get(path, headers=auth).json()["route"] == {"v1": 100.0, "v2": 0.0}
    run = client.post("/v1/graphs/ab", json={"inputs": {"text": "hello"}}).json()
    assert run["versions"] == {"intent": "v1"}
    try:
        moved = client.post(path, headers=auth, json={"split": "v1:0%, v2:100%"})
        assert moved.json()["route"] == {"v1": 0.0, "v2": 100.0}
        run = client.post("/v1/graphs/ab", json={"inputs": {"text": "hello"}}).json()
        assert run["versions"] == {"intent": "v2"}
        bad = client.post(path, headers=auth, json={"split": {"v1": 50}})
        assert (bad.status_code, error_of(bad)["field"]) == (422, "split")
        assert client.get(path, headers=auth).json()["route"] == {"v1": 0.0, "v2": 100.0}
    finally:
        client.post(path, headers=auth, json={"split": {"v1": 100}})
    missing = client.get("/admin/graphs/ab/models/nope/route", headers=auth)
    assert missing.status_code == 404


def test_admin_uploads_rolls_out_and_unloads_a_version(client, root, tmp_path):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    versions = "/admin/graphs/ab/models/intent/versions"
    route = "/admin/graphs/ab/models/intent/route"
    v3 = build_encoder(tmp_path / "intent3", "classify", ["greet", "order", "spam"], seed=3)
    assert client.post(versions, json={"version": "v3", "path": str(v3)}).status_code == 401
    missing = client.post(
        versions, headers=auth, json={"version": "v3", "path": str(tmp_path / "no")}
    )
    assert missing.status_code == 422 and "no" in error_of(missing)["message"]
    loaded = client.post(versions, headers=auth, json={"version": "v3", "path": str(v3)})
    assert loaded.status_code == 200 and loaded.json()["route"]["v3"] == 0.0
    try:
        rollout = client.post(route, headers=auth, json={"version": "v3", "weight": "100%"})
        assert rollout.json()["route"] == {"v1": 0.0, "v2": 0.0, "v3": 100.0}
        run = client.post("/v1/graphs/ab", json={"inputs": {"text": "hello"}}).json()
        assert run["versions"] == {"intent": "v3"}
        live = client.get("/v1/graphs/ab").json()["models"]["intent"]  # as served, not the file
        assert live["versions"]["v3"] == str(v3)
        assert live["route"] == {"v1": 0.0, "v2": 0.0, "v3": 100.0}
        busy = client.delete(versions + "/v3", headers=auth)
        assert busy.status_code == 422 and "traffic" in error_of(busy)["message"]
    finally:
        client.post(route, headers=auth, json={"split": {"v1": 100}})
    gone = client.delete(versions + "/v3", headers=auth)
    assert gone.status_code == 200 and gone.json()["versions"] == ["v1", "v2"]
    assert set(client.get("/v1/graphs/ab").json()["models"]["intent"]["versions"]) == {"v1", "v2"}
    assert client.post("/v1/graphs/ab", json={"inputs": {"text": "hi"}}).json()["versions"] == {
        "intent": "v1"
    }


# ---------------------------------------------------------------- a server of its own


def test_admin_is_404_when_no_token_is_configured(monkeypatch, root):
    monkeypatch.delenv("TRAE_ADMIN_TOKEN", raising=False)
    with (
        ServerThread(create_app([root / "echo.yaml"], ServerConfig())) as running,
        httpx.Client(base_url=running.url) as c,
    ):
        response = c.post("/admin/graphs/echo/reload", headers={"Authorization": "Bearer x"})
        assert response.status_code == 404
        assert "TRAE_ADMIN_TOKEN" in error_of(response)["message"]


@pytest.mark.parametrize("freeze", [True, False])
def test_loaded_models_are_frozen_out_of_the_garbage_collector(root, freeze):
    gc.unfreeze()  # this test process: start from a heap nothing froze
    try:
        config = ServerConfig(freeze_gc=freeze)
        with ServerThread(create_app([root / "echo.yaml"], config)) as running:
            assert running.state.ready
            frozen = gc.get_freeze_count()
            with httpx.Client(base_url=running.url) as c:  # still serving
                assert c.post("/v1/graphs/echo", json={"inputs": {"text": "x"}}).status_code == 200
        assert (frozen > 0) == freeze
    finally:
        gc.unfreeze()


def test_graceful_shutdown_finishes_in_flight_requests(root, nodes):
    config = ServerConfig(shutdown_grace_s=120)
    running = ServerThread(create_app([root / "held.yaml"], config)).start()
    state = running.state
    results: dict = {}

    def call(key: str) -> None:
        with httpx.Client(base_url=running.url, timeout=120) as c:
            results[key] = c.post("/v1/graphs/held", json={"inputs": {"key": key}})

    workers = [threading.Thread(target=call, args=(k,)) for k in ("drain-1", "drain-2")]
    for w in workers:
        w.start()
    wait_until(lambda: state.inflight == 2, "two requests in flight")
    stopper = threading.Thread(target=running.stop)
    stopper.start()
    wait_until(lambda: state.draining, "draining to start")
    with httpx.Client(base_url=running.url, timeout=60) as c:
        refused = c.post("/v1/graphs/held", json={"inputs": {"key": "late"}})
        assert refused.status_code == 503
        assert error_of(refused)["type"] == "ShuttingDown"
        assert "retry-after" in refused.headers
        assert c.get("/ready").status_code == 503
        assert c.get("/health").json() == {"status": "ok", "draining": True}
    assert running.thread.is_alive()
    nodes.gate("drain-1").set()
    nodes.gate("drain-2").set()
    for w in workers:
        w.join(60)
    stopper.join(60)
    assert not running.thread.is_alive()
    assert [results[k].status_code for k in ("drain-1", "drain-2")] == [200, 200]
    assert results["drain-1"].json()["outputs"]["done"] == {"released": "drain-1"}
    assert not state.runtime.engine.loop.running


def test_models_that_fail_to_load_leave_the_server_alive_but_not_ready(tmp_path):
    (tmp_path / "empty").mkdir()
    graph = tmp_path / "g.yaml"
    graph.write_text(
        "name: g\nmodels: {m: {source: ./empty, task: classify}}\ninputs: {text: str}\n"
        'nodes: {c: {model: m, input: "{{ inputs.text }}"}}\noutputs: {label: c.label}\n'
    )
    running = ServerThread(create_app([graph], ServerConfig()))
    running.thread.start()
    try:
        wait_until(lambda: running.state.load_error and running.server.started, "the failure")
        with httpx.Client(base_url=running.url) as c:
            assert c.get("/health").status_code == 200
            not_ready = c.get("/ready")
            assert not_ready.status_code == 503
            assert "failed to load" in error_of(not_ready)["message"]
            refused = c.post("/v1/graphs/g", json={"inputs": {"text": "hi"}})
            assert (refused.status_code, error_of(refused)["type"]) == (503, "NotReady")
    finally:
        running.stop()
    assert not running.thread.is_alive()
