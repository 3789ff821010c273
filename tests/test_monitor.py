"""MemoryProfiler: its samples are the pool's and the store's own accounting, and a
profile draws as a PNG."""

from __future__ import annotations

import asyncio
import sys

import pytest

from conftest import build_encoder, build_llm
from trae_groups.cli import main
from trae_groups.engine import EngineConfig
from trae_groups.engine.protocol import GenerateRequest
from trae_groups.engine.sampling import SamplingParams
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.monitor import MemoryProfiler, layers, read_profile

GRAPH = """
name: duo
models:
  dialog: {{source: {root}/dialog, task: generate}}
  intent: {{source: {root}/intent, task: classify}}
inputs: {{text: str}}
nodes:
  intent: {{model: intent, input: "{{{{ inputs.text }}}}"}}
  reply: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 4}}}}
outputs: {{intent: intent.label, reply: reply.text}}
"""


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    root = tmp_path_factory.mktemp("duo")
    build_llm(root / "dialog")
    build_encoder(root / "intent", "classify", ["greet", "order"])
    spec = load_graph_text(GRAPH.format(root=root), str(root / "duo.yaml"))
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=1 << 20, tokens_per_page=4))
    executor = rt.bind(spec)
    rt.start()
    yield rt, executor
    rt.shutdown()


def test_samples_add_up_to_the_pool_and_store_accounting(runtime, tmp_path):
    rt, executor = runtime
    for text in ("hello world, how are you today?", "please refund me"):  # prefix cache fills
        asyncio.run(executor.run({"text": text}))
    profiler = MemoryProfiler(0.05, tmp_path / "mem.jsonl", stats=lambda: [rt.stats()]).start()
    client = executor.models["dialog"].clients["default"]

    async def while_generating():
        request = GenerateRequest("held", SamplingParams(max_tokens=200, ignore_eos=True),
                                  prompt="hello world, how are you today? " * 3)  # fmt: skip
        stream = client.generate(request)
        await stream.__anext__()  # its KV pages are in use while it runs
        # one instant, on the engine thread between two steps: the sample and the pool
        taken = rt.engine.loop.call(lambda: (profiler.sample(), rt.engine.pool.stats()))
        await stream.aclose()  # aborted: wait (bounded) for its pages to come back
        for _ in range(500):
            if rt.engine.pool.stats().used_pages == 0:
                break
            await asyncio.sleep(0.01)
        return taken

    sample, pool = asyncio.run(while_generating())
    profiler.stop()
    (owners,) = sample["pools"]
    assert owners["kv"] == {k: v for k, v in pool.pages_by_owner.items() if ":" not in k}
    assert owners["kv"].get(client.name, 0) > 0
    assert owners["prefix_cache"] == pool.cached_pages > 0
    assert owners["free"] == pool.free_pages
    parts = sum(owners["kv"].values()) + sum(owners["encoder"].values())
    assert parts + owners["prefix_cache"] + owners["free"] == owners["pages"] == pool.num_pages
    assert sample["weights"] == {r.name: r.bytes for r in rt.store.report()}
    assert sample["process"]["rss"] > sum(sample["weights"].values())
    written = read_profile(tmp_path / "mem.jsonl")
    assert len(written) >= 2 and written[-1]["t"] >= written[0]["t"]
    stacked = layers(written)  # bytes: pool pages times the page size, weights as held
    total_pool = owners["pages"] * owners["page_bytes"]
    last = {name: series[-1] for name, series in stacked.items()}
    assert sum(v for k, v in last.items() if not k.startswith("weights")) == total_pool


def test_profile_plot_writes_a_png(runtime, tmp_path, capsys):
    profile = tmp_path / "mem.jsonl"
    with MemoryProfiler(interval=0.02, path=profile):  # no stats=: every live engine
        asyncio.run(runtime[1].run({"text": "hello"}))
    last = read_profile(profile)[-1]
    assert runtime[0].engine.pool.num_pages in [p["pages"] for p in last["pools"]]
    assert {"dialog", "intent"} <= set(last["weights"])
    assert main(["profile", "plot", str(profile), "-o", str(tmp_path / "mem.png")]) == 0
    png = (tmp_path / "mem.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "wrote" in capsys.readouterr().out


def test_profile_plot_says_how_to_install_matplotlib_when_missing(tmp_path, capsys, monkeypatch):
    profile = tmp_path / "mem.jsonl"
    MemoryProfiler(path=profile).start().stop()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main(["profile", "plot", str(profile), "-o", str(tmp_path / "x.png")]) == 1
    assert "pip install 'trae-groups[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
