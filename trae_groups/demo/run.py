"""`trae demo`: prepare the demo's models (cached), serve the support graph, send one
example request and print the reply, then keep serving until Ctrl-C."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from trae_groups.demo.prepare import DemoSetupError, prepare_demo

EXAMPLE = "Hi, my order 48213 for a desk lamp has not arrived in Porto yet. Where is it?"


def graph_file() -> Path:
    """The demo graph, installed with the package (no source checkout needed)."""
    path = Path(__file__).with_name("support.yaml")
    if not path.is_file():
        raise DemoSetupError(f"the demo graph is missing: {path} (reinstall trae-groups)")
    return path


def send_example(url: str, timeout_s: float = 600.0) -> None:
    """Wait until the server is ready, then show one request and its answer."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=300.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get("/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            print("the server did not become ready in time", file=sys.stderr)
            return
        body = {"inputs": {"text": EXAMPLE}}
        print(f"\nexample request: POST {url}/v1/graphs/support {json.dumps(body)}", flush=True)
        answer = client.post("/v1/graphs/support", json=body).json()
    print(json.dumps(answer.get("outputs", answer), indent=2, ensure_ascii=False), flush=True)
    print(
        f"\nserving on {url} — try:\n"
        f"  curl -s {url}/v1/graphs/support -H 'content-type: application/json' "
        f"""-d '{{"inputs": {{"text": "I want a refund for my broken kettle"}}}}'\n"""
        f"  curl -s {url}/metrics | head\nCtrl-C stops the server.",
        flush=True,
    )


def run_demo(host: str = "127.0.0.1", port: int = 8000, example: bool = True) -> int:
    from trae_groups.serving.server import ServerConfig, serve

    try:
        assets = prepare_demo(progress=True)
        path = graph_file()
    except DemoSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    os.environ["TRAE_DEMO_DIR"] = str(assets.root)
    if example:
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        threading.Thread(target=send_example, args=(url,), daemon=True).start()
    # served as `trae serve` serves: the engine in a process of its own
    config = ServerConfig(host=host, port=port, log_level="warning", engine_process=True)
    return serve([path], config)
