"""The live graph page on a real server: /v1/stats holds the same figures as /metrics, the
page is self-contained, and in headless Chromium (driven through the DevTools protocol)
it draws the demo-shaped graph, fetches nothing but the server, and moves with traffic."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support_app import NODES, SPAM, build_support

from conftest import wait_until
from trae_groups.engine import EngineConfig
from trae_groups.loadgen import free_port
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-dev-shm-usage", "--window-size=1280,800",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_support(tmp_path_factory.mktemp("dashboard"))
    app = create_app([path], ServerConfig(engine=EngineConfig(pool_bytes=8 << 20)))
    with ServerThread(app) as running:
        yield running


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def run(http: httpx.Client, text: str = "where is my order") -> dict:
    answer = http.post("/v1/graphs/support", json={"inputs": {"text": text}})
    assert answer.status_code == 200, answer.text
    return answer.json()


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


def summed(samples, name: str, **labels) -> float:
    """A /metrics sample summed over the labels not given (version, replica, le...)."""
    return sum(
        v for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == want for k, want in labels.items())
    )  # fmt: skip


def stats(http: httpx.Client) -> dict:
    response = http.get("/v1/stats")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def test_stats_hold_each_graph_as_its_dag_with_the_metrics_figures(http):
    before = stats(http)
    bodies = [run(http), run(http, SPAM)]
    after, samples = stats(http), scrape(http)  # nothing runs between the two readings
    (graph,) = after["graphs"]
    nodes = {n["name"]: n for n in graph["nodes"]}
    assert list(nodes) == list(NODES)  # dependency order
    assert sorted(nodes["reply"]["parents"]) == ["entities", "intent"]
    assert (nodes["intent"]["depth"], nodes["reply"]["depth"]) == (0, 1)
    assert nodes["reply"]["kind"] == "generate" and nodes["reply"]["model"] == "dialog"
    old = {n["name"]: n for n in before["graphs"][0]["nodes"]}
    for name in NODES:
        node = nodes[name]
        assert sum(node["runs"].values()) - sum(old[name]["runs"].values()) == 2
        for status, count in node["runs"].items():
            where = {"graph": "support", "node": name, "status": status}
            assert count == summed(samples, "trae_node_runs_total", **where)
        latency = node["latency"]
        where = {"graph": "support", "node": name}
        assert latency["count"] == summed(samples, "trae_node_latency_seconds_count", **where)
        if node["runs"].get("ok"):  # a skipped node has no run time
            assert latency["le"][-1] is None and latency["counts"][-1] == latency["count"] > 0
            assert latency["counts"] == sorted(latency["counts"])  # cumulative
    assert [b["nodes"]["reply"]["status"] for b in bodies] == ["ok", "skipped"]
    moved = {s: n - old["reply"]["runs"].get(s, 0) for s, n in nodes["reply"]["runs"].items()}
    assert moved == {"ok": 1, "skipped": 1}
    assert graph["requests"]["200"] == summed(samples, "trae_graph_requests_total", code="200")
    models = after["models"]
    assert {m: models[m]["kind"] for m in ("intent", "ner", "dialog")} == {
        "intent": "encoder", "ner": "encoder", "dialog": "llm",
    }  # fmt: skip
    dialog = models["dialog"]
    assert dialog["batch"]["count"] == summed(samples, "trae_llm_batch_tokens_count")
    assert dialog["batch"]["count"] > 0 and dialog["queue"]["count"] > 0
    assert models["intent"]["batch"]["count"] > 0
    pool = after["pool"]
    assert pool["capacity"] == summed(samples, "trae_pool_capacity_pages") > 0
    assert pool["used"] + pool["cached"] + pool["free"] == pool["capacity"]
    assert after["ready"] is True and after["time"] >= before["time"]


def test_the_page_is_one_self_contained_document(http):
    response = http.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    addresses = {word for word in page.split('"') if "://" in word}
    assert addresses == {"http://www.w3.org/2000/svg"}  # a namespace, never fetched
    assert 'fetch("v1/stats"' in page


# ---------------------------------------------------------------- headless Chromium


def chromium() -> str:
    found = os.environ.get("TRAE_CHROMIUM") or shutil.which("chromium")
    found = found or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not found:
        pytest.skip("no chromium on PATH (apt-get install chromium, or set TRAE_CHROMIUM)")
    return found


class DevTools:
    """A page target over the Chrome DevTools protocol: commands answered by id, the
    events seen on the way kept in ``events``."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    def __call__(self, method: str, **params) -> dict:
        sent = next(self.ids)
        self.ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        for _ in range(100_000):  # events come in between; bounded all the same
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == sent:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)
        raise AssertionError(f"{method}: no answer")

    def value(self, expression: str):
        result = self("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


@pytest.fixture
def browser(tmp_path):
    client = pytest.importorskip(
        "websockets.sync.client", reason="the DevTools client needs websockets"
    )
    connect = client.connect
    binary = chromium()
    port = free_port()
    log = (tmp_path / "chromium.log").open("w")
    process = subprocess.Popen(
        [binary, *CHROMIUM_FLAGS, f"--remote-debugging-port={port}",
         f"--user-data-dir={tmp_path / 'profile'}", "about:blank"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    targets: list[dict] = []

    def listening() -> bool:
        try:
            targets[:] = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
        except httpx.HTTPError:
            return False
        return any(t.get("type") == "page" for t in targets)

    try:
        wait_until(listening, "chromium's DevTools endpoint", seconds=60, interval=0.2)
        page = next(t for t in targets if t.get("type") == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=30) as ws:
            yield DevTools(ws)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(20)
        log.close()


def node_runs(tools: DevTools) -> dict[str, int]:
    found = tools.value(
        "JSON.stringify(Object.fromEntries([...document.querySelectorAll('[data-node]')]"
        ".map(g => [g.dataset.node, Number(g.dataset.runs)])))"
    )
    return json.loads(found or "{}")


def test_the_page_draws_the_graph_and_moves_with_requests(server, http, browser, tmp_path):
    browser("Runtime.enable")
    browser("Network.enable")
    browser("Page.enable")
    browser("Page.navigate", url=f"{server.url}/dashboard")
    wait_until(lambda: set(node_runs(browser)) == set(NODES), "the three nodes", 60, 0.2)
    edges = browser.value("document.querySelectorAll('#graph-support path.edge').length")
    assert edges == 2  # intent -> reply, entities -> reply
    before = node_runs(browser)
    run(http)
    run(http, SPAM)  # the reply is skipped: half its runs in the window
    wait_until(
        lambda: all(node_runs(browser)[n] == before[n] + 2 for n in NODES),
        "the page to count two more runs of every node", 60, 0.2,
    )  # fmt: skip
    reply = browser.value("document.querySelector('[data-node=reply]').textContent")
    assert "skip 50%" in reply  # this window's share: one of two runs
    shown = browser.value("document.querySelector('#graph-support h2').textContent")
    assert shown.startswith("support") and "answered" in shown
    models = browser.value(
        "[...document.querySelectorAll('#models tr[data-model]')].map(r => r.dataset.model)"
    )
    assert sorted(models) == ["dialog", "intent", "ner"]
    assert "pages" in browser.value("document.querySelector('[data-pool=used]').textContent")
    shot = browser("Page.captureScreenshot", format="png")
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "dashboard.png").write_bytes(png)
    browser("Runtime.evaluate", expression="document.getElementById('colour').value='rate'; draw()")
    assert set(node_runs(browser)) == set(NODES)  # redrawn under another colouring
    fetched = {
        e["params"]["request"]["url"] for e in browser.events
        if e.get("method") == "Network.requestWillBeSent"
    }  # fmt: skip
    outside = [u for u in fetched if not u.startswith(server.url)]
    assert fetched and not outside, outside
    errors = [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    assert not errors
