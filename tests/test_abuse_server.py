"""Hardening, end to end: abusive clients and inputs against a real uvicorn on
127.0.0.1 (python-node graphs, so each server starts at once), and the CLI."""

from __future__ import annotations

import contextlib
import json
import socket
import textwrap
import threading
import time

import httpx
import pytest

from conftest import build_encoder, build_llm
from trae_groups.cli import main
from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

TOKEN = "abuse-admin-token"

NAN = """
name: nan
inputs: {}
nodes:
  d: {function: "graph_functions:non_finite"}
outputs: {d: d}
"""


def strict_json(text: str):
    """RFC 8259 JSON only: NaN and Infinity are errors, as in every non-Python parser."""

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def write_graphs(folder, **graphs: str) -> list:
    paths = []
    for name, text in graphs.items():
        path = folder / f"{name}.yaml"
        path.write_text(textwrap.dedent(text))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    paths = write_graphs(tmp_path_factory.mktemp("abuse"), nan=NAN)
    with ServerThread(create_app(paths, ServerConfig(admin_token=TOKEN))) as running:
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# -- 10. non-finite floats are written as null, in JSON and in SSE ----------------------

EXPECTED = {"nan": None, "inf": None, "list": [1.5, None], "ok": 2.5}


def test_non_finite_floats_are_null_in_json(client):
    response = client.post("/v1/graphs/nan", json={"inputs": {}})
    assert response.status_code == 200
    assert strict_json(response.text)["outputs"]["d"] == EXPECTED


def test_non_finite_floats_are_null_in_sse(client):
    response = client.post("/v1/graphs/nan", json={"inputs": {}, "stream": True})
    assert response.status_code == 200
    events = {}
    for block in response.text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events[fields["event"]] = strict_json(fields["data"])  # every event parses strictly
    assert events["result"]["outputs"]["d"] == EXPECTED
    assert events["node_finished"]["node"] == "d"


# -- 7. slow clients: unfinished headers or bodies are answered 408 and closed ----------


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    paths = write_graphs(tmp_path_factory.mktemp("slow"), nan=NAN)
    config = ServerConfig(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=4)
    with ServerThread(create_app(paths, config)) as running:
        yield running


def raw(server, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=30)
    if data:
        sock.sendall(data)
    return sock


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket timeout)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def status_and_json(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/graphs/nan HTTP/1.1\r\nHost: x\r\nContent-Ty"],
    ids=["nothing", "half the headers"],
)
def test_unfinished_headers_get_408_and_the_connection_closes(strict_server, sent):
    status, body = status_and_json(answer(raw(strict_server, sent)))
    assert status == 408 and body["error"]["type"] == "RequestTimeout"
    assert "headers did not arrive within 0.5 s" in body["error"]["message"]


def test_an_unfinished_body_gets_408_and_the_connection_closes(strict_server):
    head = b"POST /v1/graphs/nan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock = raw(strict_server, head + b'Content-Length: 200\r\n\r\n{"inputs": {')
    status, body = status_and_json(answer(sock))
    assert status == 408 and "body did not arrive within 0.5 s" in body["error"]["message"]


def test_oversized_headers_get_431(server):  # the default 10 s deadline: no race with it
    sock = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    with contextlib.suppress(OSError):  # the server may close while we still write
        sock.sendall(b"".join(b"X-Pad: " + b"a" * 1017 + b"\r\n" for _ in range(80)))
    status, body = status_and_json(answer(sock))
    assert status == 431 and body["error"]["type"] == "HeadersTooLarge"


def test_stalled_connections_are_capped_and_then_dropped(tmp_path):
    config = ServerConfig(header_timeout_s=3, max_connections=4)  # 3 s: room on a busy box
    server = ServerThread(create_app(write_graphs(tmp_path, nan=NAN), config)).start()
    try:
        stalled_then_served(server)
    finally:
        server.stop()


def stalled_then_served(strict_server) -> None:
    stalled = [raw(strict_server, b"GET /health HTTP/1.1\r\n") for _ in range(4)]
    with httpx.Client(base_url=strict_server.url, timeout=30) as c:
        assert c.get("/health").status_code == 503  # the cap: no 5th connection
        for sock in stalled:
            assert status_and_json(answer(sock))[0] == 408
        response = c.post("/v1/graphs/nan", json={"inputs": {}})  # served again
        assert response.status_code == 200 and strict_json(response.text)["outputs"]["d"]
    with httpx.Client(base_url=strict_server.url, timeout=30) as keep:  # normal keep-alive
        assert [keep.get("/health").status_code for _ in range(3)] == [200, 200, 200]


# -- 12. admin inputs: version names follow the graph file's rule; paths are text -------


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    build_encoder(root / "intent", "classify", ["greet", "order"])
    graph = f"""
        name: routed
        models:
          clf: {{versions: {{v1: {root / "intent"}}}, task: classify}}
        inputs: {{text: str}}
        nodes:
          c: {{model: clf, input: "{{{{ inputs.text }}}}"}}
        outputs: {{label: c.label}}
        """
    config = ServerConfig(admin_token=TOKEN, engine=EngineConfig(pool_bytes=8 << 20))
    with ServerThread(create_app(write_graphs(root, routed=graph), config)) as running:
        running.model_dir = root / "intent"
        yield running


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"version": "v3", "path": "/tmp/intent\u0000/x"}, "path"),
        ({"version": "a:1%,b", "path": "MODEL"}, "version"),
        ({"version": "../x", "path": "MODEL"}, "version"),
        ({"version": "v 3", "path": "MODEL"}, "version"),
        ({"version": "v2\n", "path": "MODEL"}, "version"),  # a "$" anchor let this through
        ({"version": "v" * 1000, "path": "MODEL"}, "version"),
    ],
)
def test_bad_upload_names_and_paths_are_422_and_change_nothing(admin_server, body, field):
    body = {**body, "path": body["path"].replace("MODEL", str(admin_server.model_dir))}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = "/admin/graphs/routed/models/clf"
    with httpx.Client(base_url=admin_server.url, timeout=60, headers=auth) as c:
        response = c.post(f"{url}/versions", json=body)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["field"] == field
        assert c.get(f"{url}/route").json()["route"] == {"v1": 100.0}


# -- 13. shutdown: requests still running when the grace ends answer 503 at once ------

SLOW = """
name: slow
inputs: {seconds: float}
nodes:
  wait: {function: "graph_functions:slow_async", args: {seconds: "{{ inputs.seconds }}"}}
outputs: {done: wait}
"""


def test_requests_running_past_the_grace_get_503_json_and_an_sse_error(tmp_path):
    grace = 1.0
    config = ServerConfig(shutdown_grace_s=grace, retry_after_s=7)
    running = ServerThread(create_app(write_graphs(tmp_path, slow=SLOW), config)).start()
    answers: dict = {}

    def call(kind: str) -> None:
        body = {"inputs": {"seconds": 120}, "stream": kind == "sse"}
        with httpx.Client(base_url=running.url, timeout=60) as c:
            response = c.post("/v1/graphs/slow", json=body)
        answers[kind] = (response, time.monotonic())

    callers = [threading.Thread(target=call, args=(kind,)) for kind in ("json", "sse")]
    for t in callers:
        t.start()
    for _ in range(3000):  # both admitted (bounded wait)
        if running.state.inflight == 2:
            break
        time.sleep(0.01)
    assert running.state.inflight == 2
    stopped_at = time.monotonic()
    running.stop()
    for t in callers:
        t.join(60)
    response, at = answers["json"]
    assert response.status_code == 503 and response.headers["retry-after"] == "7"
    assert response.json()["error"]["type"] == "ShuttingDown"
    assert at - stopped_at >= 0.9 * grace  # they had their grace first
    stream, _ = answers["sse"]
    assert stream.status_code == 200
    events = [
        (fields["event"], strict_json(fields["data"]))
        for fields in (
            dict(line.split(": ", 1) for line in block.splitlines())
            for block in stream.text.strip().split("\n\n")
        )
    ]
    assert events[-2][0] == "error" and events[-2][1]["status"] == 503
    assert events[-2][1]["error"]["type"] == "ShuttingDown" and events[-1][0] == "done"
    assert not running.thread.is_alive()


# -- 14. the CLI: one clear line, not a traceback; the port is checked first --------------

MISSING_MODEL = """
name: g
models:
  clf: {source: "${MODEL_ROOT}/intent", task: classify}
inputs: {text: str}
nodes:
  c: {model: clf, input: "{{ inputs.text }}"}
outputs: {label: c.label}
"""


def test_trae_run_with_a_missing_model_folder_prints_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MODEL_ROOT", str(tmp_path / "nowhere"))
    (path,) = write_graphs(tmp_path, g=MISSING_MODEL)
    assert main(["run", str(path), "--input", '{"text": "hi"}']) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = strict_json(err.strip().splitlines()[-1])
    assert (
        line["error"]["type"] == "ModelLoadError"
        and "no such model folder" in line["error"]["message"]
    )


def test_an_unknown_filter_is_a_validation_issue_not_a_traceback(tmp_path, capsys):
    (path,) = write_graphs(
        tmp_path,
        t="""
        name: t
        inputs: {text: str}
        nodes:
          s: {function: "graph_functions:shout", args: {text: "{{ inputs.text | uper }}"}}
        outputs: {o: s}
        """,
    )
    for command in (["validate", str(path)], ["run", str(path), "--input", '{"text": "a"}']):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert f"{path}:5: node 's': unknown filter 'uper' (did you mean 'upper'?)" in err


def test_validate_names_an_unset_variable_in_a_model_path(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MODEL_ROOT", raising=False)
    (path,) = write_graphs(tmp_path, g=MISSING_MODEL)
    assert main(["validate", str(path)]) == 1
    assert "needs MODEL_ROOT, which is not set" in capsys.readouterr().err


def test_serve_checks_the_port_before_loading_any_model(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MODEL_ROOT", str(tmp_path / "nowhere"))  # loading it would fail
    (path,) = write_graphs(tmp_path, g=MISSING_MODEL)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", str(path), "--port", str(port), "--grace", "1"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
    assert "models did not load" not in caplog.text and "no such model folder" not in caplog.text


# -- 1. max_prompt_tokens: the engine's refusal is a 422 naming the prompt ---------------


def test_a_prompt_over_max_prompt_tokens_is_a_422(tmp_path):
    build_llm(tmp_path / "dialog")
    graph = f"""
        name: chat
        models:
          dialog: {{source: {tmp_path / "dialog"}, task: generate}}
        inputs: {{text: str}}
        nodes:
          reply: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 2}}}}
        outputs: {{reply: reply.text}}
        """
    engine = EngineConfig(pool_bytes=8 << 20, max_prompt_tokens=8)
    app = create_app(write_graphs(tmp_path, chat=graph), ServerConfig(engine=engine))
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=60) as c:
        assert c.post("/v1/graphs/chat", json={"inputs": {"text": "hello"}}).status_code == 200
        long = {"inputs": {"text": "the quick brown fox jumps over the lazy dog " * 4}}
        response = c.post("/v1/graphs/chat", json=long)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["node"] == "reply" and error["field"] == "prompt"
    assert "max_prompt_tokens" in error["message"]
