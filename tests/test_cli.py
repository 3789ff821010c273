"""The `trae` command: through subprocesses, as a user runs it (model info and the
in-process bench run through ``main()`` to spare a model-loading process each)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import build_encoder, build_llm
from trae_groups.cli import main, parse_size
from trae_groups.loadgen import percentile

NODES_MODULE = "cli_test_nodes"
NODES_SOURCE = '''
"""A python node held until a file appears (the test, another process, creates it)."""
from pathlib import Path

import anyio


async def wait_for_file(path: str) -> dict:
    for _ in range(60_000):  # bounded
        if Path(path).exists():
            return {"released": path}
        await anyio.sleep(0.005)
    raise TimeoutError(path)
'''

SUPPORT = """\
name: support
models:
  intent: {{source: {root}/intent, task: classify}}
  dialog: {{source: {root}/dialog, task: generate}}
inputs:
  text: str
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "Intent: {{{{ intent.label }}}}. User: {{{{ inputs.text }}}}"
    params: {{max_tokens: 4, temperature: 0}}
outputs: {{intent: intent.label, reply: reply.text}}
"""
# line 9 starts the reply node, line 11 holds its prompt
BROKEN = SUPPORT.replace("model: dialog", "model: dialgo").replace(
    "{{{{ intent.label }}}}", "{{{{ intnt.label }}}}"
)
HELD = """\
name: held
inputs: {key: str}
nodes:
  wait: {function: "cli_test_nodes:wait_for_file", args: {path: "{{ inputs.key }}"}}
outputs: {done: wait}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    build_llm(root / "dialog", "llama")
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"])
    (root / "support.yaml").write_text(SUPPORT.format(root=root))
    (root / "broken.yaml").write_text(BROKEN.format(root=root))
    (root / "held.yaml").write_text(HELD)
    (root / f"{NODES_MODULE}.py").write_text(NODES_SOURCE)
    return root


def trae(*args: str, cwd: Path, timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [sys.executable, "-m", "trae_groups.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- no models loaded


def test_validate_ok_exits_0(root):
    script = Path(sys.executable).parent / "trae"  # the installed entry point
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trae_groups.cli"]
    done = subprocess.run(
        [*command, "validate", "support.yaml", "held.yaml"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ok: support.yaml (graph 'support': 2 nodes, 2 models)" in done.stdout
    assert "ok: held.yaml" in done.stdout


def test_validate_reports_every_issue_with_its_line_and_exits_1(root):
    done = trae("validate", "broken.yaml", cwd=root)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "broken.yaml:9: node 'reply': unknown model 'dialgo' (did you mean 'dialog'?)",
        "broken.yaml:11: node 'reply': unknown name 'intnt': not a node, and inputs are "
        "read as inputs.<name> (did you mean 'intent'?)",
    ]


def test_validate_reports_a_missing_model_folder_at_its_source_line(root, tmp_path):
    (tmp_path / "g.yaml").write_text(
        (root / "support.yaml").read_text().replace(f"{root}/intent", "./nowhere")
    )
    done = trae("validate", "g.yaml", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("g.yaml:3: model 'intent': no model at")
    assert trae("validate", "--skip-models", "g.yaml", cwd=tmp_path).returncode == 0


def test_show_prints_the_dag_level_by_level(root):
    done = trae("show", "support.yaml", cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "graph support: 2 nodes, 2 models",
        "inputs: text (str)",
        "level 0:",
        "  intent [classify: intent] <- inputs.text",
        "level 1:",
        "  reply [generate: dialog] <- intent, inputs.text",
        "outputs: intent = intent.label, reply = reply.text",
    ]


def test_show_writes_mermaid_dot_and_png_files(root, tmp_path):
    assert trae("show", "support.yaml", "--format", "mermaid", "-o", str(tmp_path / "g.mmd"),
                cwd=root).returncode == 0  # fmt: skip
    mermaid = (tmp_path / "g.mmd").read_text()
    assert mermaid.startswith("flowchart TD") and "intent --> reply" in mermaid
    assert trae("show", "support.yaml", "--format", "dot", "-o", str(tmp_path / "g.dot"),
                cwd=root).returncode == 0  # fmt: skip
    dot = (tmp_path / "g.dot").read_text()
    assert dot.startswith('digraph "support"') and '"intent" -> "reply";' in dot
    png = trae("show", "support.yaml", "-o", str(tmp_path / "g.png"), cwd=root)
    if shutil.which("dot"):
        assert png.returncode == 0
        assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert png.returncode == 1
        assert "Graphviz" in png.stderr


# every part of a graph that reaches into the engine's option tables: resources (checked by
# EngineConfig), an output schema (compiled by llguidance), speculative follows, a streamed
# edge, sampling ranges, quantization, a KV cache dtype and a python node
ENGINE_OPTIONS = """\
name: options
resources: {pool_bytes: 64MiB, weight_budget: 1GiB}
models:
  llm: {source: ./nowhere/llm, task: generate, quantization: int8, max_batch_size: 8}
inputs: {text: str}
nodes:
  extract:
    model: llm
    prompt: "{{ inputs.text }}"
    output_schema: {type: object, properties: {n: {type: integer}}, required: [n]}
  reply:
    model: llm
    prompt: "User: {{ inputs.text }} Assistant:"
    params: {max_tokens: 8, temperature: 0.5, top_p: 0.9}
  rewrite:
    model: llm
    follows: {node: reply, tokens: 4}
    speculative: {method: follows, num_tokens: 4}
    prompt: "Rewrite: {{ reply.text }}"
  glue: {function: "json:dumps", args: {obj: "{{ extract.json.n }}"}}
outputs: {n: extract.json.n, rewrite: rewrite.text, glue: glue}
"""
# runs one command through main() and reports which heavy modules it imported
IMPORTS_SCRIPT = """\
import json, sys
from trae_groups.cli import main
code = main(sys.argv[1:])
heavy = ("torch", "transformers", "triton", "numpy")
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""


@pytest.mark.parametrize("command", ["validate", "show"])
def test_commands_that_read_a_graph_import_no_torch(command, tmp_path):
    (tmp_path / "options.yaml").write_text(ENGINE_OPTIONS)
    support = Path(__file__).parents[1] / "examples" / "support.yaml"
    flags = ["--skip-models"] if command == "validate" else []
    for graph in (str(support), "options.yaml"):
        done = subprocess.run(
            [sys.executable, "-c", IMPORTS_SCRIPT, command, *flags, graph],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout.splitlines()[-1])
        assert report == {"code": 0, "imported": []}, (graph, report)
    if command == "validate":  # the engine's ranges are still checked, without torch
        bad = ENGINE_OPTIONS.replace("pool_bytes: 64MiB", "pool_bytes: 0")
        (tmp_path / "bad.yaml").write_text(bad)
        done = subprocess.run(
            [sys.executable, "-c", IMPORTS_SCRIPT, command, *flags, "bad.yaml"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert "bad.yaml:2: resources: pool_bytes: must be > 0" in done.stderr, done.stderr
        assert json.loads(done.stdout) == {"code": 1, "imported": []}


def test_health_of_nothing_listening_exits_1(root):
    done = trae("health", "--url", f"http://127.0.0.1:{free_port()}", cwd=root)
    assert done.returncode == 1
    assert json.loads(done.stdout)["alive"] is False


def test_run_rejects_bad_inputs_before_loading_models(root):
    done = trae("run", "support.yaml", "--input", '{"txt": "hi"}', cwd=root)
    assert done.returncode == 1
    assert json.loads(done.stderr)["error"]["field"] == "inputs.text"


def test_sizes_and_percentiles():
    assert parse_size("8388608") == 8 << 20
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5g") == 3 << 29
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


# ---------------------------------------------------------------- with models


def test_run_prints_the_result_json(root):
    done = trae(
        "run", "support.yaml", "--input", '{"text": "where is my order"}', "--pool-bytes",
        "16MiB", cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert set(result) == {"request_id", "outputs", "nodes", "ms"}
    assert result["outputs"]["intent"] in {"greet", "order", "spam"}
    assert {n: v["status"] for n, v in result["nodes"].items()} == {"intent": "ok", "reply": "ok"}
    assert "attention backend torch" in done.stderr
    for model in ("'intent' (classify)", "'dialog' (generate)"):  # a line per model loaded
        assert f"loaded model {model} from {root}" in done.stderr, done.stderr[-2000:]


def test_model_info_reports_each_model(root, capsys):
    assert main(["model", "info", str(root / "support.yaml"), "--json", "--detail"]) == 0
    report = json.loads(capsys.readouterr().out)
    models = {m["name"]: m for m in report["models"]}
    assert set(models) == {"intent", "dialog"}
    assert models["dialog"]["task"] == "generate"
    assert models["intent"]["parameters"] > 0
    assert models["dialog"]["used_by"] == ["support/reply"]
    assert report["held_bytes"] == sum(m["bytes"] for m in models.values())
    # the LLM's linears are pre-packed private copies: counted, not only its embeddings
    dialog = models["dialog"]
    assert dialog["private_bytes"] > dialog["bytes"] / 2 and dialog["resident"] == "always"


def test_bench_in_process_prints_throughput_and_percentiles(root, capsys):
    args = ["bench", str(root / "support.yaml"), "--clients", "3", "--requests", "9"]
    assert main([*args, "--pool-bytes", "16MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["requests"], report["errors"], report["target"]) == (9, 0, "in-process")
    assert report["throughput_rps"] > 0
    assert 0 < report["p50_ms"] <= report["p99_ms"]


def start_serve(root: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``trae serve`` in a subprocess on a free port; returns once /ready answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "trae_groups.cli", "serve", *args, "--port", str(port),
         "--pool-bytes", "16MiB"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for _ in range(600):  # bounded: about two minutes
        if trae("health", "--url", url, cwd=root).returncode == 0:
            return server, url
        if server.poll() is not None:
            raise AssertionError(server.stdout.read())
        time.sleep(0.2)
    server.kill()
    raise AssertionError("the server never got ready")


def test_bench_against_no_server_fails_and_says_why(root):
    done = trae("bench", "support.yaml", "--url", f"http://127.0.0.1:{free_port()}",
                "--clients", "2", "--requests", "3", cwd=root)  # fmt: skip
    assert done.returncode == 1
    assert "3 requests, 3 errors" in done.stdout
    assert "first error: ClientConnectorError" in done.stderr


def test_serve_health_bench_and_sigterm_drains_in_flight_requests(root, tmp_path):
    server, url = start_serve(
        root, "support.yaml", "held.yaml", "--grace", "120", "--admin-token", "tok"
    )
    try:
        bench = trae("bench", "support.yaml", "--url", url, "--clients", "2", "--requests", "4",
                     "--json", cwd=root)  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        assert json.loads(bench.stdout)["requests"] == 4

        route = trae("model", "route", "intent", "--graph", "support.yaml", "--url", url, "--token", "tok",
                     cwd=root)  # fmt: skip
        assert route.returncode == 0, route.stderr
        assert json.loads(route.stdout)["route"] == {"default": 100.0}
        wrong = trae("model", "route", "intent", "--url", url, "--token", "x",
                     "--split", "default:100%", cwd=root)  # fmt: skip
        assert wrong.returncode == 1
        assert json.loads(wrong.stderr)["error"]["type"] == "Unauthorized"

        gate = tmp_path / "open"
        result: dict = {}
        caller = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(
                    f"{url}/v1/graphs/held", json={"inputs": {"key": str(gate)}}, timeout=120
                )
            )
        )
        caller.start()
        for _ in range(3000):
            if 'trae_graph_inflight_requests{graph="held"} 1.0' in httpx.get(f"{url}/metrics").text:
                break
            time.sleep(0.01)
        server.send_signal(signal.SIGTERM)
        for _ in range(3000):  # draining: not ready any more, the sockets still open
            if httpx.get(f"{url}/ready").status_code == 503:
                break
            time.sleep(0.01)
        late = httpx.post(f"{url}/v1/graphs/held", json={"inputs": {"key": "late"}})
        assert late.status_code == 503
        assert late.json()["error"]["type"] == "ShuttingDown"
        gate.touch()
        caller.join(120)
        assert result["r"].status_code == 200
        assert result["r"].json()["outputs"]["done"] == {"released": str(gate)}
        assert server.wait(120) == 0
        log = server.stdout.read()
        assert "attention backend torch" in log and "draining" in log
        assert '"POST /v1/graphs/held HTTP/1.1" 200' in log  # the access log is on by default
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


def test_serve_no_access_log_leaves_requests_out_of_the_log(root, tmp_path):
    """Also: --memory-profile writes the timeline (test_monitor draws one) and
    --weight-budget reaches the engine."""
    profile = tmp_path / "mem.jsonl"
    server, url = start_serve(
        root, "support.yaml", "--no-access-log", "--memory-profile", str(profile),
        "--memory-interval", "0.2", "--weight-budget", "1GiB",
    )  # fmt: skip
    try:
        answer = httpx.post(f"{url}/v1/graphs/support", json={"inputs": {"text": "hi"}}, timeout=60)
        assert answer.status_code == 200
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
        assert 'trae_weight_budget_bytes{replica="local"} 1.073741824e+09' in metrics
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0
        log = server.stdout.read()
        assert "ready:" in log and "POST /v1/graphs" not in log
        assert "model dialog: the pool holds" in log  # its KV capacity, at start-up
        samples = [json.loads(line) for line in profile.read_text().splitlines()]
        assert len(samples) >= 2 and set(samples[-1]["weights"]) == {"intent", "dialog"}
        assert samples[-1]["pools"][0]["pages"] * samples[-1]["pools"][0]["page_bytes"] == 16 << 20
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


def test_serve_exits_1_when_models_fail_to_load(root, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "g.yaml").write_text(
        (root / "support.yaml").read_text().replace(f"{root}/intent", "./empty")
    )
    done = trae("serve", "g.yaml", "--port", str(free_port()), cwd=tmp_path)
    assert done.returncode == 1
    assert "models did not load" in done.stderr
