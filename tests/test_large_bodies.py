"""Large request bodies: parsed off the event loop, a bound on how many are read at once
(429 past it, naming the limit), and a heap trim after them. Real uvicorn on 127.0.0.1;
the held bodies are real half-sent requests, so every count is exact."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from conftest import node_module, wait_until
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

ECHO_SOURCE = """
def echo(text: str) -> dict:
    return {"size": len(text)}
"""
GRAPH = """
name: echo
inputs: {text: str}
nodes:
  say: {function: "large_bodies_nodes:echo", args: {text: "{{ inputs.text }}"}}
outputs: {size: say.size}
"""
THRESHOLD = 4096
LIMIT = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("large_bodies")
    (folder / "echo.yaml").write_text(GRAPH)
    config = ServerConfig(large_body_bytes=THRESHOLD, max_large_bodies=LIMIT)
    with (
        node_module(folder, "large_bodies_nodes", ECHO_SOURCE),
        ServerThread(create_app([folder / "echo.yaml"], config)) as running,
    ):
        yield running


def body_of(size: int) -> bytes:
    text = "x" * max(0, size - 24)
    return json.dumps({"inputs": {"text": text}}).encode()


def half_sent(server, body: bytes) -> socket.socket:
    """A request whose headers and first half of body are sent, the rest held back."""
    raw = socket.create_connection((server.host, server.port))
    head = (
        "POST /v1/graphs/echo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    raw.sendall(head + body[: len(body) // 2])
    return raw


def finish(raw: socket.socket, body: bytes) -> int:
    raw.sendall(body[len(body) // 2 :])
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = raw.recv(65536)
        if not chunk:
            break
        reply += chunk
    raw.close()
    return int(reply.split(b" ", 2)[1])


def test_past_the_limit_a_large_body_is_429_and_small_ones_still_pass(server):
    large = server.state.large_bodies
    big = body_of(THRESHOLD * 4)
    held = [half_sent(server, big) for _ in range(LIMIT)]
    try:
        wait_until(lambda: large.in_flight == LIMIT, "the held bodies to be admitted")
        with httpx.Client(base_url=server.url, timeout=60) as client:
            refused = client.post("/v1/graphs/echo", content=big)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == str(server.state.config.retry_after_s)
            error = refused.json()["error"]
            assert error["type"] == "TooManyLargeBodies"
            assert f"{LIMIT} request bodies of {THRESHOLD} bytes" in error["message"]
            small = client.post("/v1/graphs/echo", content=body_of(256))
            assert small.status_code == 200
            assert client.get("/health").status_code == 200
    finally:
        codes = [finish(raw, big) for raw in held]
    assert codes == [200] * LIMIT
    assert large.in_flight == 0 and large.refused >= 1
    with httpx.Client(base_url=server.url, timeout=60) as client:  # the slots came back
        answer = client.post("/v1/graphs/echo", content=big)
        assert answer.status_code == 200
        assert answer.json()["outputs"]["size"] == len(json.loads(big)["inputs"]["text"])


def test_a_large_body_without_content_length_is_counted_once_it_grows(server):
    large = server.state.large_bodies
    trims = large.trim.trims

    def chunks():
        body = body_of(THRESHOLD * 3)
        for at in range(0, len(body), 1024):
            yield body[at : at + 1024]

    with httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/v1/graphs/echo", content=chunks())  # chunked: no length
    assert answer.status_code == 200
    assert large.in_flight == 0
    wait_until(lambda: large.trim.trims > trims, "the heap trim after a large body", 30)


def test_invalid_large_bodies_still_get_their_400_and_release_the_slot(server):
    large = server.state.large_bodies
    with httpx.Client(base_url=server.url, timeout=60) as client:
        bad = client.post("/v1/graphs/echo", content=b"{" + b" " * (THRESHOLD * 2))
    assert bad.status_code == 400
    assert "not valid JSON" in bad.json()["error"]["message"]
    assert large.in_flight == 0


@pytest.mark.parametrize(
    "fields",
    [{"large_body_bytes": 0}, {"max_large_bodies": 0}],
)
def test_the_settings_are_checked(fields):
    with pytest.raises(ValueError, match="large_body_bytes and max_large_bodies"):
        ServerConfig(**fields)
