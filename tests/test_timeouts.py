"""A graph's timeout ends the request on time even when a node's work cannot be
interrupted (a sync python function keeps running on its thread)."""

from __future__ import annotations

import httpx

from conftest import node_module
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

MODULE = "timeout_test_nodes"
SOURCE = """
import threading

RELEASE = threading.Event()
FINISHED = threading.Event()


def stuck(text: str) -> dict:
    RELEASE.wait(30)  # bounded: the test releases it
    FINISHED.set()
    return {"text": text}
"""
GRAPH = """
name: stuck
timeout: 0.5s
inputs: {text: str}
nodes:
  work: {function: "timeout_test_nodes:stuck", args: {text: "{{ inputs.text }}"}}
outputs: {text: work.text}
"""


def test_a_sync_node_past_the_graph_timeout_gets_504_before_it_returns(tmp_path):
    (tmp_path / "stuck.yaml").write_text(GRAPH)
    with node_module(tmp_path, MODULE, SOURCE) as nodes:
        try:
            with ServerThread(create_app([tmp_path / "stuck.yaml"], ServerConfig())) as server:
                answer = httpx.post(f"{server.url}/v1/graphs/stuck", json={"inputs": {"text": "x"}})
                finished_before_answer = nodes.FINISHED.is_set()
                nodes.RELEASE.set()
        finally:
            nodes.RELEASE.set()
    assert answer.status_code == 504
    assert not finished_before_answer  # the answer did not wait for the function
