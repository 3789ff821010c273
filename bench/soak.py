"""Soak: a server under mixed, partly hostile traffic for a long time, on 127.0.0.1.

`trae serve` runs in a subprocess with tiny models; --clients workers send, for
--minutes, a seeded mix of: graph runs (JSON and SSE), OpenAI chat and completions
(streamed or not), streams dropped at a random point, requests dropped before their
answer, bad bodies (not JSON, wrong types, unknown outputs, out-of-range sampling),
long prompts, and now and then an admin version upload, a route change and an
unload. Every minute it records requests by status, p50/p99 of the good ones, the
server's RSS and the pool's used pages; between phases it lets the server go idle
and checks that no page is left in use. A 500 anywhere is a failure (exit 1).

    python bench/soak.py [--minutes 30] [--clients 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build_encoder, build_llm, build_lora  # noqa: E402
from trae_groups import loadgen  # noqa: E402

TOKEN = "soak-admin"
GRAPH = """
name: soak
models:
  intent:
    versions: {{v1: {root}/intent, v2: {root}/intent2}}
    route: {{v1: 100}}
    task: classify
    max_queue_delay_ms: 2
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{text: str, history: {{type: messages, default: []}}}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply:
    model: dialog
    prompt: "{{{{ intent.label }}}}: {{{{ inputs.text }}}}"
    params: {{max_tokens: 16}}
outputs: {{intent: intent.label, reply: reply.text}}
"""
CHAT = """
name: chat
models:
  dialog: {{source: {root}/dialog, task: generate}}
inputs: {{messages: messages}}
nodes:
  answer: {{model: dialog, messages: "{{{{ inputs.messages }}}}", params: {{max_tokens: 16}}}}
outputs: {{text: answer.text}}
"""
# the paths the first graphs do not take: a LoRA adapter, a streamed edge, an embedder,
# structured output, and two generate models swapping under a budget that holds one
MIXED = """
name: mixed
resources: {{weight_budget: {budget}, load_wait_s: 60}}
models:
  dialog:
    source: {root}/dialog
    task: generate
    resident: always
    adapters: {{tone: {root}/lora}}
  spare: {{source: {root}/spare, task: generate, resident: on_demand}}
  embedder: {{source: {root}/embedder, task: embed}}
inputs: {{text: str}}
nodes:
  draft: {{model: dialog, adapter: tone, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 24}}}}
  echo:
    model: dialog
    follows: {{node: draft, tokens: 8}}
    prompt: "Again: {{{{ draft.text }}}}"
    params: {{max_tokens: 8}}
  other: {{model: spare, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 8}}}}
  vector: {{model: embedder, input: "{{{{ inputs.text }}}}"}}
outputs: {{draft: draft.text, echo: echo.text, other: other.text, vector: vector.embedding}}
"""
WORDS = ["hello", "where", "is", "my", "order", "refund", "paris", "london", "please", "ship"]


def rss_mb(pid: int) -> float:
    """Resident MB of ``pid`` and its descendants (the engine process is a child)."""
    total = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1]) / 1024
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        total += sum(rss_mb(int(child)) for child in children)
    return total


def pool_used(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("trae_pool_pages{") and 'state="used"' in line:
            return float(line.rsplit(" ", 1)[1])
    return -1.0


class Soak:
    def __init__(self, url: str, root: Path, rng: random.Random):
        self.url, self.root, self.rng = url, root, rng
        self.status: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def text(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(2, 10)))

    async def one(self, session: aiohttp.ClientSession) -> None:
        kind = self.rng.choices(
            ["graph", "graph_sse", "chat", "completion_sse", "drop_stream", "drop_request",
             "bad", "long", "admin", "mixed", "structured", "embedding", "adapter"],
            weights=[30, 10, 10, 8, 8, 5, 15, 3, 1, 8, 5, 5, 5],
        )[0]  # fmt: skip
        start = time.perf_counter()
        try:
            code = await getattr(self, kind)(session)
        except (TimeoutError, aiohttp.ClientError) as exc:
            code = f"client-{type(exc).__name__}"
        self.status[f"{kind}:{code}"] += 1
        if code == 200 and kind in ("graph", "chat"):  # the latency figures: the simple paths
            self.latencies.append(time.perf_counter() - start)
        if isinstance(code, int) and code >= 500 and code != 503:
            self.failures.append(f"{kind} -> {code}")

    async def post(self, session, path: str, body, **kw) -> int:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        async with session.post(self.url + path, data=data, headers=headers, **kw) as r:
            await r.read()
            return r.status

    async def graph(self, session) -> int:
        return await self.post(session, "/v1/graphs/soak", {"inputs": {"text": self.text()}})

    async def graph_sse(self, session) -> int:
        """The stream's error event's status if it has one (a 200 carried it), else 200."""
        body = {"inputs": {"text": self.text()}, "stream": True}
        async with session.post(self.url + "/v1/graphs/soak", json=body) as r:
            payload = (await r.read()).decode()
        for block in payload.split("\n\n"):
            if block.startswith("event: error"):
                return json.loads(block.split("data: ", 1)[1])["status"]
        return r.status

    async def chat(self, session) -> int:
        body = {"model": "chat", "messages": [{"role": "user", "content": self.text()}]}
        return await self.post(session, "/v1/chat/completions", body)

    async def completion_sse(self, session) -> int:
        body = {"model": "soak/dialog", "prompt": self.text(), "max_tokens": 16, "stream": True}
        return await self.post(session, "/v1/completions", body)

    async def drop_stream(self, session) -> int:
        body = {"model": "soak/dialog", "prompt": self.text(), "max_tokens": 200,
                "stream": True, "ignore_eos": True}  # fmt: skip
        async with session.post(self.url + "/v1/completions", json=body) as r:
            for _ in range(self.rng.randint(1, 5)):
                await r.content.readline()
            r.close()  # the client goes away mid-stream
            return r.status

    async def drop_request(self, session) -> int:
        body = {"inputs": {"text": self.text()}}
        try:
            async with asyncio.timeout(self.rng.uniform(0.001, 0.03)):
                return await self.post(session, "/v1/graphs/soak", body)
        except TimeoutError:
            return 499

    async def bad(self, session) -> int:
        choice = self.rng.randrange(6)
        if choice == 0:
            return await self.post(session, "/v1/graphs/soak", b"{not json")
        if choice == 1:
            return await self.post(session, "/v1/graphs/soak", {"inputs": {"text": 5}})
        if choice == 2:
            return await self.post(
                session, "/v1/graphs/soak", {"inputs": {"text": "x"}, "outputs": ["nope"]}
            )
        if choice == 3:
            body = {"model": "soak/dialog", "prompt": "x", "temperature": 9}
            return await self.post(session, "/v1/completions", body)
        if choice == 4:
            return await self.post(session, "/v1/graphs/nothere", {"inputs": {}})
        return await self.post(session, "/v1/graphs/soak", b"\xff\xfe")

    async def mixed(self, session) -> int:
        """Adapter, streamed edge, on-demand swap and embedder in one graph run."""
        return await self.post(session, "/v1/graphs/mixed", {"inputs": {"text": self.text()}})

    async def structured(self, session) -> int:
        schema = {"type": "object", "properties": {"word": {"enum": WORDS}},
                  "required": ["word"], "additionalProperties": False}  # fmt: skip
        body = {"model": "soak/dialog", "messages": [{"role": "user", "content": self.text()}],
                "max_tokens": 32, "response_format": {"type": "json_schema",
                "json_schema": {"name": "w", "schema": schema}}}  # fmt: skip
        return await self.post(session, "/v1/chat/completions", body)

    async def embedding(self, session) -> int:
        body = {"model": "mixed/embedder", "input": [self.text() for _ in range(4)]}
        return await self.post(session, "/v1/embeddings", body)

    async def adapter(self, session) -> int:
        body = {"model": "mixed/dialog:tone", "prompt": self.text(), "max_tokens": 8}
        return await self.post(session, "/v1/completions", body)

    async def long(self, session) -> int:
        body = {"model": "soak/dialog", "prompt": list(range(3, 200)), "max_tokens": 4}
        return await self.post(session, "/v1/completions", body)

    async def admin(self, session) -> int:
        auth = {"authorization": f"Bearer {TOKEN}"}
        route = "/admin/graphs/soak/models/intent"
        if self.rng.random() < 0.3:  # load a version, then unload it (no route gives it traffic)
            body = {"version": "v3", "path": str(self.root / "intent2")}
            code = await self.post(session, f"{route}/versions", body, headers=auth)
            async with session.delete(f"{self.url}{route}/versions/v3", headers=auth) as r:
                await r.read()
                return max(code, r.status)
        split = self.rng.choice(["v1:100%", "v1:50%,v2:50%", "v2:100%"])
        return await self.post(session, f"{route}/route", {"split": split}, headers=auth)


async def phase(soak: Soak, clients: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            for _ in range(1_000_000):  # bounded
                if time.monotonic() > deadline:
                    return
                await soak.one(session)

        await asyncio.gather(*(worker() for _ in range(clients)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trae-soak-"))
    build_encoder(root / "intent", "classify", ["greet", "order", "spam"], seed=3)
    build_encoder(root / "intent2", "classify", ["greet", "order", "spam"], seed=4)
    build_llm(root / "dialog", "llama")
    build_llm(root / "spare", "qwen3", seed=1)
    build_encoder(root / "embedder", "embed", [], seed=5)
    build_lora(root / "lora", root / "dialog", r=4, lora_alpha=8, target_modules=["q_proj"])
    (root / "soak.yaml").write_text(GRAPH.format(root=root))
    (root / "chat.yaml").write_text(CHAT.format(root=root))
    # the budget holds dialog and the embedder but not spare too: spare swaps in and out
    (root / "mixed.yaml").write_text(MIXED.format(root=root, budget="2MiB"))
    port = loadgen.free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TRAE_ADMIN_TOKEN": TOKEN}
    server = subprocess.Popen(
        [sys.executable, "-m", "trae_groups.cli", "--log-level", "warning", "serve",
         str(root / "soak.yaml"), str(root / "chat.yaml"), str(root / "mixed.yaml"),
         "--port", str(port),
         "--pool-bytes", "32MiB", "--no-access-log"],
        env=env, stdout=(root / "server.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    print(f"server log: {root / 'server.log'}", flush=True)
    soak = Soak(url, root, random.Random(args.seed))
    rows = []
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        phases = max(1, round(args.minutes))
        for minute in range(phases):
            soak.latencies.clear()
            before = sum(soak.status.values())
            asyncio.run(phase(soak, args.clients, args.minutes * 60 / phases))
            time.sleep(2)  # idle: dropped work drains
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            lat = sorted(soak.latencies) or [0.0]
            rows.append({
                "minute": minute + 1,
                "requests": sum(soak.status.values()) - before,
                "p50_ms": lat[len(lat) // 2] * 1000,
                "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
                "rss_mb": rss_mb(server.pid),
                "pages_used_idle": pool_used(metrics),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    print("requests by kind:status:")
    for key, n in sorted(soak.status.items()):
        print(f"  {key}: {n}")
    warm = rows[len(rows) // 3 :] if len(rows) >= 3 else rows
    growth = warm[-1]["rss_mb"] - warm[0]["rss_mb"] if warm else 0.0
    print(
        f"RSS after warm-up: {warm[0]['rss_mb']:.0f} -> {warm[-1]['rss_mb']:.0f} MB ({growth:+.0f})"
    )
    leaks = [r for r in rows if r["pages_used_idle"] != 0]
    print(f"pages in use when idle: {leaks or '0 after every phase'}")
    print(f"5xx other than 503: {len(soak.failures)} {soak.failures[:5]}")
    return 1 if soak.failures or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
