"""The shipped monitoring files (examples/monitoring/) against a real Prometheus scraping a
real server: the alert rules load and evaluate, every dashboard query returns data after
a short served load, and every metric name they use is one /metrics really exports.
Skipped when no ``prometheus`` binary is on PATH (Debian: apt-get install prometheus)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support_app import build_support

from conftest import wait_until
from trae_groups.engine import EngineConfig
from trae_groups.loadgen import free_port
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

MONITORING = Path(__file__).resolve().parents[1] / "examples" / "monitoring"
RULES = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERTS = {
    "TraeEngineQueueGrowing", "TraeKVPoolPressure", "TraeDeadlineMisses", "TraeServerErrors",
    "TraeServerDown", "TraeNotReady", "TraeReplicaLost",
}  # fmt: skip
FAILS = """
name: fails
inputs: {text: str}
nodes:
  explode: {function: "graph_functions:explode", args: {text: "{{ inputs.text }}"}}
outputs: {never: explode}
"""
LATE = """
name: late
timeout: 0.05s
on_deadline: finish
inputs: {s: float}
nodes:
  nap: {function: "graph_functions:slow_async", args: {seconds: "{{ inputs.s }}"}}
outputs: {done: nap}
"""
# Grafana's variables, as the dashboard's defaults resolve them on a 1 s scrape
VARIABLES = {"$__rate_interval": "15s", "$graph": ".+"}
METRIC = re.compile(r"\b(trae_[a-z_]+|inference_latency[a-z_]*|device_utilization)\b")


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def resolve(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def exported(text: str) -> set[str]:
    """Every sample name /metrics can export, also of families with no series yet (a
    counter with labels shows only its HELP and TYPE until a first event)."""
    names = set()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, []))
        names.update(s.name for s in family.samples)
    return names


def test_the_files_parse_and_promtool_accepts_them():
    assert len(queries()) >= 20 and {"groups"} == set(yaml.safe_load(RULES.read_text()))
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool on PATH (apt-get install prometheus)")
    rules = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = MONITORING / "prometheus.yml"
    checked = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("prometheus")
    (root / "fails.yaml").write_text(FAILS)
    (root / "late.yaml").write_text(LATE)
    app = create_app(
        [build_support(root), root / "fails.yaml", root / "late.yaml"],
        ServerConfig(engine=EngineConfig(pool_bytes=8 << 20)),
    )
    with ServerThread(app) as running:
        yield running


def test_every_name_the_files_use_is_exported(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        http.post("/v1/graphs/support", json={"inputs": {"text": "where is my order"}})
        names = exported(http.get("/metrics").text)
    used = {m for expr in [*queries(), *rule_exprs()] for m in METRIC.findall(expr)}
    assert used - names == set()
    assert len(used) > 25


@pytest.fixture
def prometheus(server, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus on PATH (apt-get install prometheus)")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "trae", "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def ready() -> bool:
        try:
            return api.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, "prometheus to start", seconds=60, interval=0.2)
        yield api
    finally:
        api.close()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
        log.close()


def load(url: str, stop: threading.Event, limit: int = 2000) -> None:
    """Requests one after another until stopped: answers, node failures (500) and
    answers past their deadline."""
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(limit):
            if stop.is_set():
                return
            http.post("/v1/graphs/support", json={"inputs": {"text": f"where is order {i}"}})
            if i % 4 == 0:
                http.post("/v1/graphs/fails", json={"inputs": {"text": "x"}})
                http.post("/v1/graphs/late", json={"inputs": {"s": 0.1}})


def test_rules_load_and_every_dashboard_query_returns_data(server, prometheus):
    stop = threading.Event()
    driver = threading.Thread(target=load, args=(server.url, stop), daemon=True)
    driver.start()
    empty: dict[str, str] = {}

    def answered() -> bool:
        empty.clear()
        for expr in queries():
            found = prometheus.get("/api/v1/query", params={"query": resolve(expr)}).json()
            if found["status"] != "success":
                empty[expr] = found.get("error", "")
            elif not found["data"]["result"]:
                empty[expr] = "no data"
        return not empty

    try:
        wait_until(answered, "every dashboard query to return data", seconds=120, interval=1)
    except AssertionError:
        raise AssertionError(f"queries without data: {json.dumps(empty, indent=1)}") from None
    finally:
        stop.set()
        driver.join(180)
    graphs = prometheus.get(
        "/api/v1/label/graph/values", params={"match[]": "trae_graph_requests_total"}
    ).json()["data"]
    assert {"support", "fails"} <= set(graphs)  # the dashboard's graph variable
    rules: dict[str, dict] = {}

    def evaluated() -> bool:
        groups = prometheus.get("/api/v1/rules").json()["data"]["groups"]
        rules.update({r["name"]: r for g in groups for r in g["rules"]})
        return set(rules) == ALERTS and all(r["health"] == "ok" for r in rules.values())

    wait_until(evaluated, "every alert rule to load and evaluate", seconds=60, interval=0.5)
    # what TraeServerErrors and TraeDeadlineMisses read holds real events, not only zeros
    for query in ('sum(trae_graph_requests_total{graph="fails", code="500"})',
                  'sum(trae_graph_deadline_misses_total{graph="late", action="late"})',
                  'sum(trae_node_errors_total{graph="fails", node="explode"})'):  # fmt: skip
        found = prometheus.get("/api/v1/query", params={"query": query}).json()["data"]["result"]
        assert found and float(found[0]["value"][1]) > 0, query
