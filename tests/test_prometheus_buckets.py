"""Histogram buckets from a graph's ``monitoring:`` section: checked when the graph loads
(field and file line), and the configured bounds are the ones a real server's /metrics
exports, on the request path and on the engine's histograms."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support_app import build_support

from trae_groups.engine import EngineConfig
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.serving.metrics import HISTOGRAM_BUCKETS, LATENCY_BUCKETS
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

GRAPH = """name: g
inputs: {{text: str}}
nodes:
  up: {{function: "graph_functions:shout", args: {{text: "{{{{ inputs.text }}}}"}}}}
outputs: {{up: up}}
monitoring:
  metrics:
    {metric}: {{buckets: {buckets}}}
"""


def rejected(text: str) -> str:
    with pytest.raises(GraphValidationError) as error:
        load_graph_text(text, "g.yaml")
    return str(error.value)


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ("[1, 0.5, 2]", "bounds must increase strictly"),
        ("[1, 1]", "bounds must increase strictly"),
        ("[1, .inf]", "finite number"),
        ("[]", "at least 1 item"),
        ("[fast]", "valid number"),
    ],
)
def test_bad_bounds_are_refused_at_load_naming_field_and_line(buckets, message):
    found = rejected(GRAPH.format(metric="inference_latency", buckets=buckets))
    assert found.startswith("g.yaml:8: monitoring.metrics.inference_latency.buckets")
    assert message in found


def test_a_bad_metric_name_is_refused_at_load():
    found = rejected(GRAPH.format(metric="'no such-name'", buckets="[1]"))
    assert found.startswith("g.yaml:8: monitoring.metrics") and "pattern" in found


def test_a_name_the_server_does_not_export_is_refused_with_file_and_line(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(GRAPH.format(metric="inference_latncy", buckets="[1, 2]"))
    with pytest.raises(GraphValidationError) as error:
        create_app([path])
    found = str(error.value)
    assert found.startswith(f"{path}:8: monitoring.metrics: 'inference_latncy' is not a histogram")
    assert "did you mean 'inference_latency'?" in found


def test_trae_validate_checks_the_names_too(tmp_path, capsys):
    from trae_groups.cli import main

    path = tmp_path / "g.yaml"
    path.write_text(GRAPH.format(metric="inference_latncy", buckets="[1, 2]"))
    assert main(["validate", str(path), "--skip-models"]) == 1
    assert f"{path}:8: monitoring.metrics: 'inference_latncy'" in capsys.readouterr().err
    path.write_text(GRAPH.format(metric="inference_latency", buckets="[1, 2]"))
    assert main(["validate", str(path), "--skip-models"]) == 0


def test_two_graphs_that_disagree_on_one_metric_are_refused(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GRAPH.format(metric="inference_latency", buckets="[1, 2]"))
    b.write_text(
        GRAPH.format(metric="inference_latency", buckets="[1, 3]").replace("name: g", "name: h")
    )
    with pytest.raises(GraphValidationError) as error:
        create_app([a, b])
    assert f"{b}:8: monitoring.metrics.inference_latency.buckets: differs from graph 'g'" in str(
        error.value
    )


MONITORING = """monitoring:
  metrics:
    inference_latency: {buckets: [7, 70, 700, 7000]}
    trae_node_latency_seconds: {buckets: [0.0123, 0.123, 1.23, 12.3]}
    trae_time_to_first_token_seconds: {buckets: [0.0777, 0.777, 7.77]}
"""


def bounds(text: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                found.setdefault(family.name, set()).add(s.labels["le"])
    return found


def test_configured_bounds_are_what_metrics_exports(tmp_path):
    path = build_support(tmp_path, MONITORING)
    app = create_app([path], ServerConfig(engine=EngineConfig(pool_bytes=8 << 20)))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        answer = http.post("/v1/graphs/support", json={"inputs": {"text": "where is my order"}})
        assert answer.status_code == 200
        exported = bounds(http.get("/metrics").text)
    assert exported["inference_latency"] == {"7.0", "70.0", "700.0", "7000.0", "+Inf"}
    assert exported["trae_node_latency_seconds"] == {"0.0123", "0.123", "1.23", "12.3", "+Inf"}
    assert exported["trae_time_to_first_token_seconds"] == {"0.0777", "0.777", "7.77", "+Inf"}
    default = {str(float(b)) for b in LATENCY_BUCKETS} | {"+Inf"}
    assert exported["trae_graph_latency_seconds"] == default  # not set: the default
    assert set(HISTOGRAM_BUCKETS) <= set(exported)  # every configurable name is exported
