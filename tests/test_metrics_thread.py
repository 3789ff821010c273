"""/metrics answers while sync python nodes fill anyio's worker threads."""

from __future__ import annotations

import threading
import time

import httpx

from conftest import node_module
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

MODULE = "metrics_thread_nodes"
SOURCE = """
import threading

GATE = threading.Event()


def hold(text: str) -> dict:
    GATE.wait(30)  # bounded: the test opens the gate
    return {"text": text}
"""
GRAPH = """
name: sleepy
inputs: {text: str}
nodes:
  hold: {function: "metrics_thread_nodes:hold", args: {text: "{{ inputs.text }}"}}
outputs: {text: hold.text}
"""
SLEEPERS = 45  # more than anyio's 40 worker threads


def test_metrics_answers_while_sync_nodes_hold_every_worker_thread(tmp_path):
    graph = tmp_path / "sleepy.yaml"
    graph.write_text(GRAPH)
    with node_module(tmp_path, MODULE, SOURCE) as nodes:
        try:
            with ServerThread(create_app([graph], ServerConfig())) as server:
                threads = [
                    threading.Thread(
                        target=httpx.post,
                        args=(f"{server.url}/v1/graphs/sleepy",),
                        kwargs={"json": {"inputs": {"text": str(i)}}, "timeout": 60},
                    )
                    for i in range(SLEEPERS)
                ]
                for t in threads:
                    t.start()
                for _ in range(1000):  # bounded: every sleeper admitted
                    if server.state.inflight == SLEEPERS:
                        break
                    time.sleep(0.01)
                assert server.state.inflight == SLEEPERS
                scrape = httpx.get(f"{server.url}/metrics", timeout=60)
                still_held = server.state.inflight
                nodes.GATE.set()
                for t in threads:
                    t.join(60)
        finally:
            nodes.GATE.set()
    assert scrape.status_code == 200 and "trae_graph_inflight_requests" in scrape.text
    assert still_held == SLEEPERS  # the scrape did not wait for the sleepers
