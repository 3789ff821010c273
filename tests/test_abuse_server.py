"""Hardening, end to end: abusive clients and inputs against a real uvicorn on
127.0.0.1 (python-node graphs, so each server starts at once), and the CLI."""

from __future__ import annotations

import json
import textwrap

import httpx
import pytest

from trae_groups.server import ServerConfig, ServerThread, create_app

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
