"""The engine core in its own process (trae_groups/engine_process/): real HTTP against a
real uvicorn on 127.0.0.1, the models in a real child process, tiny real models.

The split must answer exactly what one process answers (greedy tokens, streams,
errors), free a request's pages when its client leaves, turn an engine process that
dies into 503s with the reason and then recover, and leave no process behind when
``trae serve`` is stopped (SIGTERM) or killed (SIGKILL). Loops are bounded; nothing
asserts a duration.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import build_encoder, build_llm, parse_sse
from conftest import wait_until as _wait_until
from trae_groups.engine import EngineConfig, SamplingParams
from trae_groups.engine.protocol import EncodeRequest, GenerateRequest
from trae_groups.engine_process import EngineProcessRuntime
from trae_groups.graphs.loader import load_graph
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

TOKEN = "test-admin-token"
CHILD_MODULE = "trae_groups.engine_process.child"
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
    prompt: "Intent: {{{{ intent.label }}}}. User: {{{{ inputs.text }}}}\\nAssistant:"
    params: {{max_tokens: 12, temperature: 0}}
outputs: {{intent: intent.label, reply: reply.text, tokens: reply.tokens}}
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
# A generation far longer than a client's reaction to its first token, even on a loaded
# machine: the engine does not wait for a slow reader, so a short one can end before the
# client leaves (900 tokens of the tiny model take about a second). ignore_eos: a random
# tiny model's greedy text may reach EOS early on another CPU's kernels.
SAGA = STORY.replace("name: story", "name: saga").replace("max_tokens: 900", "max_tokens: 4000")
SAGA_TOKENS = 4000
# What the `trae serve` subprocess tests serve: their requests only need an answer.
TALE = STORY.replace("name: story", "name: tale").replace("max_tokens: 900", "max_tokens: 8")
PROMPTS = ["hello where is my order", "I would like to book a flight to Paris", "refund me"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("engine_process")
    build_llm(root / "dialog", "llama", max_position_embeddings=4200)
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    for name, text in {"support": SUPPORT, "story": STORY, "saga": SAGA, "tale": TALE}.items():
        (root / f"{name}.yaml").write_text(text.format(root=root))
    return root


def config(**kwargs) -> ServerConfig:
    return ServerConfig(engine=EngineConfig(pool_bytes=16 << 20), admin_token=TOKEN, **kwargs)


@pytest.fixture(scope="module")
def split(root):
    graphs = [root / "support.yaml", root / "story.yaml", root / "saga.yaml"]
    with ServerThread(create_app(graphs, config(engine_process=True))) as running:
        yield running


@pytest.fixture(scope="module")
def local(root):
    """The same graphs in one process: what the split must answer too."""
    graphs = [root / "support.yaml", root / "story.yaml"]
    with ServerThread(create_app(graphs, config())) as running:
        yield running


def wait_until(condition, what: str) -> None:
    """Poll up to 120 s, 20 ms apart: an engine process restarts within that."""
    _wait_until(condition, what, seconds=120.0, interval=0.02)


def engine_of(server: ServerThread) -> EngineProcessRuntime:
    runtime = server.state.runtime
    assert isinstance(runtime, EngineProcessRuntime)
    return runtime


def dialog_idle(runtime: EngineProcessRuntime) -> bool:
    stats = runtime.stats()
    return stats is not None and stats.pool.used_pages == 0 and stats.models["dialog"].running == 0


# ---------------------------------------------------------------- the same answers


def test_the_models_run_in_a_child_process(split):
    runtime = engine_of(split)
    child = psutil.Process(runtime.pid)
    assert runtime.pid != os.getpid()
    assert child.ppid() == os.getpid()
    assert CHILD_MODULE in " ".join(child.cmdline())
    with httpx.Client(base_url=split.url) as c:
        assert c.get("/health").json() == {"status": "ok", "draining": False}
        assert c.get("/ready").status_code == 200
        metrics = c.get("/metrics").text
    assert (
        'trae_pool_pages{replica="local",state="free"}' in metrics
    )  # the child's engine, read at scrape
    assert runtime.stats().models.keys() == {"intent", "dialog"}


def test_greedy_answers_are_the_same_as_in_one_process(split, local):
    with (
        httpx.Client(base_url=split.url, timeout=120) as a,
        httpx.Client(base_url=local.url, timeout=120) as b,
    ):
        for text in PROMPTS:
            body = {"inputs": {"text": text}}
            ours, theirs = (
                a.post("/v1/graphs/support", json=body),
                b.post("/v1/graphs/support", json=body),
            )
            assert (ours.status_code, theirs.status_code) == (200, 200)
            assert ours.json()["outputs"] == theirs.json()["outputs"]
            assert ours.json()["outputs"]["tokens"] == 12


def test_logprobs_echo_and_n_cross_the_split_as_in_one_process(split, local):
    """Every chunk field crosses the wire: token and prompt logprobs, and each of a
    prompt's ``n`` sequences (the stream ends when all have finished)."""
    body = {"model": "support/dialog", "prompt": [[5, 17, 42], [7, 8, 9, 10]], "n": 2,
            "max_tokens": 4, "echo": True, "logprobs": 2, "ignore_eos": True}  # fmt: skip

    def answer(server, stream: bool) -> list[dict]:
        reply = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream},
                           timeout=120)  # fmt: skip
        assert reply.status_code == 200, reply.text
        if not stream:
            return reply.json()["choices"]
        events = parse_sse(reply.text.rsplit("data: [DONE]", 1)[0])  # [DONE] is not JSON
        return [data["choices"][0] for _, data in events if data.get("choices")]

    for stream in (False, True):
        ours, theirs = answer(split, stream), answer(local, stream)
        assert [(c["index"], c["text"]) for c in ours] == [(c["index"], c["text"]) for c in theirs]
        tokens = [c["logprobs"]["tokens"] for c in ours if c["logprobs"]]
        assert tokens == [c["logprobs"]["tokens"] for c in theirs if c["logprobs"]]
    assert sorted(c["index"] for c in answer(split, False)) == [0, 1, 2, 3]


def test_greedy_token_ids_are_the_same_through_the_clients(root):
    """Below HTTP: the split's ModelClients against ModelRuntime's, token id by token id,
    and an encoder's result whole."""
    specs = [load_graph(root / "support.yaml")]
    engine = EngineConfig(pool_bytes=16 << 20)
    here = ModelRuntime.for_specs(specs, engine)
    there = EngineProcessRuntime.for_specs(specs, engine)
    try:
        executors = [runtime.bind(specs[0]) for runtime in (here, there)]
        here.start()
        there.start()

        async def run(executor) -> tuple[list, list]:
            llm = executor.clients["dialog"]
            params = SamplingParams(max_tokens=16, temperature=0)
            ids = []
            for i, text in enumerate(PROMPTS):
                tokens: list[int] = []
                async for chunk in llm.generate(GenerateRequest(f"r{i}", params, prompt=text)):
                    tokens.extend(chunk.token_ids)
                ids.append(tokens)
            labels = [
                await executor.clients["intent"].encode(EncodeRequest(text, f"e{i}"))
                for i, text in enumerate(PROMPTS)
            ]
            return ids, labels

        in_one_process, split = (asyncio.run(run(executor)) for executor in executors)
        assert split[0] == in_one_process[0]
        assert all(len(ids) == 16 for ids in split[0])
        # an encoder's label whole; its scores to float noise: the engine process may sum in
        # another order (its own thread pool), which moved them by ~1e-5 on an AVX-512 host
        for theirs, ours in zip(split[1], in_one_process[1], strict=True):
            assert (theirs["label"], theirs["truncated"]) == (ours["label"], ours["truncated"])
            assert theirs["scores"] == pytest.approx(ours["scores"], abs=1e-4)
    finally:
        there.shutdown()
        here.shutdown()
    assert not psutil.pid_exists(there.pid) or psutil.Process(there.pid).status() == "zombie"


def test_a_stream_through_the_split_is_the_stream_of_one_process(split, local):
    body = {"inputs": {"text": "hello where is my order"}, "stream": True}
    streams = []
    for server in (split, local):
        with httpx.Client(base_url=server.url, timeout=120) as c:
            response = c.post("/v1/graphs/support", json=body)
        assert response.status_code == 200
        events = parse_sse(response.text)
        assert [e for e, _ in events][-2:] == ["result", "done"]
        text = "".join(d["text"] for e, d in events if e == "token")
        assert text == events[-2][1]["outputs"]["reply"]
        streams.append(text)
    assert streams[0] == streams[1]


def test_a_bad_request_gets_the_same_error(split, local):
    answers = []
    for server in (split, local):
        with httpx.Client(base_url=server.url, timeout=120) as c:
            answers.append(c.post("/v1/graphs/story", json={"inputs": {"text": ""}}))
    ours, theirs = answers
    assert ours.status_code == theirs.status_code == 422
    assert ours.json() == theirs.json()
    assert (ours.json()["error"]["node"], ours.json()["error"]["field"]) == ("tell", "prompt")


def test_a_client_leaving_mid_stream_frees_the_pages_in_the_engine_process(split):
    runtime = engine_of(split)
    wait_until(lambda: dialog_idle(runtime), "an idle engine")
    before = runtime.stats().models["dialog"].counters.get("generated_tokens", 0)
    pid = runtime.pid
    with httpx.Client(base_url=split.url, timeout=120) as c:
        body = {"inputs": {"text": "Once upon a time"}, "stream": True}
        with c.stream("POST", "/v1/graphs/saga", json=body) as response:
            # the iterator held: a `for` over a temporary one closes it at `break`, and
            # httpx then drops the connection, so the server may abort before the check
            lines = response.iter_lines()
            for line in lines:
                if line == "event: token":
                    break
            stats = runtime.stats()
            assert runtime.pid == pid, "the engine process restarted mid-test"
            assert stats.pool.used_pages > 0, stats
    wait_until(lambda: dialog_idle(runtime), "the request aborted and its pages freed")
    after = runtime.stats().models["dialog"].counters.get("generated_tokens", 0)
    assert after - before < SAGA_TOKENS  # it did not run to its end
    assert split.state.graphs["saga"].inflight == 0


def test_admin_versions_load_and_unload_in_the_engine_process(split, root):
    runtime = engine_of(split)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    path = "/admin/graphs/support/models/intent/versions"
    with httpx.Client(base_url=split.url, timeout=120, headers=auth) as c:
        added = c.post(path, json={"version": "v2", "path": str(root / "intent")})
        assert added.status_code == 200, added.text
        assert added.json()["versions"] == ["default", "v2"]
        routed = c.post(
            "/admin/graphs/support/models/intent/route", json={"split": "default:0%,v2:100%"}
        )
        assert routed.status_code == 200
        run = c.post("/v1/graphs/support", json={"inputs": {"text": "refund me"}})
        assert run.status_code == 200
        assert run.json()["versions"] == {"intent": "v2"}
        busy = c.delete(f"{path}/v2")
        assert busy.status_code == 422  # a route still sends it traffic
        c.post("/admin/graphs/support/models/intent/route", json={"split": "default:100%"})
        assert c.delete(f"{path}/v2").status_code == 200
    assert runtime.graphs["support"].models["intent"].clients.keys() == {"default"}


# ---------------------------------------------------------------- death and recovery


class HeldRestart(EngineProcessRuntime):
    """The real runtime, whose restart of a dead engine process waits for the test to
    have seen the server while it is down."""

    go = threading.Event()

    def _restart(self) -> None:
        self.go.wait(300)
        super()._restart()


def test_a_dead_engine_process_answers_503_with_the_reason_then_recovers(root):
    app = create_app(
        [root / "saga.yaml", root / "tale.yaml"], config(), runtime=HeldRestart.for_specs
    )
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=120) as c:
        engine = engine_of(server)
        first = engine.pid
        before = c.post("/v1/graphs/tale", json={"inputs": {"text": "hello world"}})
        assert before.status_code == 200
        events: list = []

        def stream() -> None:
            body = {"inputs": {"text": "Once upon a time"}, "stream": True}
            with c.stream("POST", "/v1/graphs/saga", json=body) as response:
                events.append(("status", response.status_code))
                for line in response.iter_lines():
                    events.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_until(lambda: "event: token" in events, "the stream's first token")
        os.kill(first, signal.SIGKILL)
        reader.join(120)
        assert not reader.is_alive()  # the stream ended: no hang
        last = parse_sse("\n".join(str(e) for e in events[1:]))
        kinds = [kind for kind, _ in last]
        assert kinds[-2:] == ["error", "done"]
        error = last[-2][1]
        assert error["status"] == 503
        assert "engine process exited (killed by SIGKILL)" in error["error"]["message"]

        health = c.get("/health")  # the restart is held until the test lets it go
        assert health.status_code == 503
        assert "killed by SIGKILL" in health.json()["reason"]
        refused = c.post("/v1/graphs/tale", json={"inputs": {"text": "hello world"}})
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "EngineUnavailable"
        assert c.get("/ready").status_code == 503
        assert engine.restarts == 0

        HeldRestart.go.set()
        wait_until(lambda: c.get("/health").status_code == 200, "the engine restarted")
        assert engine.pid != first and engine.restarts == 1
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
        after = c.post("/v1/graphs/tale", json={"inputs": {"text": "hello world"}})
        assert after.status_code == 200
        assert after.json()["outputs"] == before.json()["outputs"]
        assert c.get("/ready").status_code == 200
    assert server.state.graphs["saga"].inflight == 0


def test_models_that_fail_to_load_in_the_engine_process_leave_the_server_not_ready(tmp_path):
    (tmp_path / "empty").mkdir()
    graph = tmp_path / "g.yaml"
    graph.write_text(
        "name: g\nmodels: {m: {source: ./empty, task: classify}}\ninputs: {text: str}\n"
        'nodes: {c: {model: m, input: "{{ inputs.text }}"}}\noutputs: {label: c.label}\n'
    )
    running = ServerThread(create_app([graph], ServerConfig(engine_process=True)))
    running.thread.start()
    try:
        wait_until(lambda: running.state.load_error and running.server.started, "the failure")
        assert "ModelLoadError" in running.state.load_error  # the child's error, as itself
        with httpx.Client(base_url=running.url) as c:
            not_ready = c.get("/ready")
            assert not_ready.status_code == 503
            assert "failed to load" in not_ready.json()["error"]["message"]
        pid = running.state.runtime.pid
    finally:
        running.stop()
    assert not running.thread.is_alive()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


# ---------------------------------------------------------------- trae serve, no orphans


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(root: Path, *args: str, log=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """``trae serve`` in a subprocess (its own session) on a free port, once /ready says so."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    paths = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    server = subprocess.Popen(
        [sys.executable, "-m", "trae_groups.cli", "serve", "tale.yaml", *args,
         "--port", str(port), "--pool-bytes", "16MiB", "--grace", "30"],
        cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    for _ in range(1200):  # bounded: a few minutes on a loaded machine
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            raise AssertionError(f"trae serve exited with {server.returncode}")
        time.sleep(0.2)
    server.kill()
    raise AssertionError("trae serve never got ready")


def family(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_process_outlives_trae_serve(root, sig):
    server, url = start_serve(root)
    try:
        processes = family(server.pid)
        engines = [p for p in processes if CHILD_MODULE in " ".join(p.cmdline())]
        assert len(engines) == 1  # the split is the default of `trae serve`
        answer = httpx.post(f"{url}/v1/graphs/tale", json={"inputs": {"text": "hi"}}, timeout=120)
        assert answer.status_code == 200
        os.kill(server.pid, sig)
        code = server.wait(120)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        _, alive = psutil.wait_procs(processes, timeout=120)
        assert alive == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


def test_trae_serve_without_the_split_has_no_engine_process(root):
    server, url = start_serve(root, "--no-engine-process")
    try:
        assert psutil.Process(server.pid).children(recursive=True) == []
        answer = httpx.post(f"{url}/v1/graphs/tale", json={"inputs": {"text": "hi"}}, timeout=120)
        assert answer.status_code == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_api_workers_share_one_engine_and_no_process_outlives_them(root, tmp_path, sig):
    log = (tmp_path / "serve.log").open("w")
    server, url = start_serve(root, "--api-workers", "2", "--admin-token", TOKEN, log=log)
    try:
        processes = family(server.pid)
        kinds = sorted(
            "engine" if CHILD_MODULE in " ".join(p.cmdline()) else "front" for p in processes
        )
        assert kinds == ["engine", "front", "front"]  # two fronts, one engine
        worker = next(p for p in processes[1:] if "api_workers" in " ".join(p.cmdline()))
        wait_until(  # both fronts answer on the port: each must be ready, not just one
            lambda: (
                f"[api {worker.pid}]: ready" in (text := (tmp_path / "serve.log").read_text())
                and "trae_groups.server: ready" in text
            ),
            "both fronts attached to the engine and ready",
        )

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                body = {"inputs": {"text": "hello world"}}
                answers = await asyncio.gather(
                    *(http.post("/v1/graphs/tale", json=body) for _ in range(8))
                )
            return [a.status_code for a in answers]

        assert asyncio.run(burst()) == [200] * 8
        auth = {"Authorization": f"Bearer {TOKEN}"}
        change = httpx.post(
            f"{url}/admin/graphs/tale/models/dialog/route",
            json={"split": "default:100%"}, headers=auth, timeout=60,
        )  # fmt: skip
        assert (change.status_code, change.json()["error"]["type"]) == (409, "SeveralFronts")
        os.kill(server.pid, sig)
        code = server.wait(120)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        _, alive = psutil.wait_procs(processes, timeout=120)
        assert alive == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        log.close()
