"""Model versions: routing, sticky users, live split changes, upload and unload."""

from __future__ import annotations

import asyncio
import gc
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import build_encoder
from trae_groups.engine import EngineConfig, ModelLoadError
from trae_groups.engine.protocol import EncodeRequest
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.routing import RouteError, Router, parse_split
from trae_groups.graphs.runtime import ModelRuntime

LABELS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    v1 = build_encoder(root / "v1", "classify", LABELS, seed=1)
    v2 = root / "v2"  # a fine-tune of v1 that differs only in its head
    shutil.copytree(v1, v2)
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(v1)
    with torch.no_grad():
        model.classifier.weight.mul_(-1)
    model.save_pretrained(v2)
    return {"v1": v1, "v2": v2, "big": build_encoder(root / "big", "classify", LABELS, seed=9)}


def graph(dirs, route="{v1: 50, v2: 50}", sticky="") -> str:
    return f"""
name: routed
models:
  clf:
    task: classify
    versions: {{v1: {dirs["v1"]}, v2: {dirs["v2"]}}}
    route: {route}
    {sticky}
inputs: {{text: str, user: {{type: str, default: anonymous}}}}
nodes:
  first: {{model: clf, input: "{{{{ inputs.text }}}}"}}
  second: {{model: clf, input: "{{{{ inputs.text }}}} again"}}
outputs: {{first: first.scores, second: second.scores}}
"""


def start(text):
    spec = load_graph_text(text, "routed.yaml")
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=4 << 20, fast_linear=False))
    executor = rt.bind(spec)
    rt.start()
    return rt, executor


def test_split_proportions_over_2000_requests():
    router = Router("m", {"v1": 90, "v2": 10}, seed=0)
    counts = Counter(router.choose() for _ in range(2000))
    # binomial(2000, 0.1): sd ≈ 13.4; ±5 sd
    assert abs(counts["v2"] - 200) < 67 and counts["v1"] + counts["v2"] == 2000
    router.set_weights({"v1": 0, "v2": 100})
    assert {router.choose() for _ in range(200)} == {"v2"}


def test_sticky_keys_keep_their_version_and_spread():
    router = Router("m", {"v1": 50, "v2": 50})
    users = [f"user-{i}" for i in range(400)]
    first = {u: router.choose(u) for u in users}
    assert all(router.choose(u) == first[u] for u in users for _ in range(3))
    share = Counter(first.values())["v2"] / len(users)
    assert 0.4 < share < 0.6  # binomial(400, 0.5): ±4 sd


@pytest.mark.parametrize(
    "split",
    ["v1:90%, v2:20%", "v1:90%, v3:10%", "v1:110%, v2:-10%", "v1 ninety", "", "v1:50, v1:50"],
)
def test_bad_splits_are_refused_and_change_nothing(split, versions):
    rt, _ = start(graph(versions, "{v1: 100, v2: 0}"))
    try:
        with pytest.raises(RouteError) as err:
            rt.set_route("routed", "clf", parse_split(split))
        assert str(err.value)
        assert rt.versioned("routed", "clf").router.weights == {"v1": 100.0, "v2": 0.0}
    finally:
        rt.shutdown()


def test_bad_routes_in_yaml_are_validation_errors(versions):
    from trae_groups.graphs.errors import GraphValidationError

    for route in ("{v1: 60, v2: 60}", "{v1: 100, v9: 0}"):
        with pytest.raises(GraphValidationError) as err:
            load_graph_text(graph(versions, route), "routed.yaml")
        assert "routed.yaml:" in str(err.value) and "route" in str(err.value)


def test_a_request_uses_one_version_for_all_its_nodes(versions):

    rt, executor = start(graph(versions))
    try:
        texts = [f"hello {i}" for i in range(40)]

        async def many():
            return await asyncio.gather(*(executor.run({"text": t}) for t in texts))

        results = asyncio.run(many())
        assert set(Counter(r.versions["clf"] for r in results)) == {"v1", "v2"}
        clients = rt.versioned("routed", "clf").clients

        async def alone(version, text):
            out = await clients[version].encode(EncodeRequest(text, "solo"))
            return out["scores"]

        for text, r in list(zip(texts, results, strict=True))[:8]:
            version = r.versions["clf"]  # both nodes must match this version alone
            assert r.outputs["first"] == pytest.approx(asyncio.run(alone(version, text)), abs=1e-5)
            assert r.outputs["second"] == pytest.approx(
                asyncio.run(alone(version, text + " again")), abs=1e-5
            )
            other = "v2" if version == "v1" else "v1"
            assert r.outputs["first"] != pytest.approx(asyncio.run(alone(other, text)), abs=1e-5)
    finally:
        rt.shutdown()


def test_sticky_input_pins_a_user(versions):
    rt, executor = start(graph(versions, sticky="sticky: user"))
    try:

        async def runs(user):
            return [
                (await executor.run({"text": "x", "user": user})).versions["clf"] for _ in range(5)
            ]

        for user in ("alice", "bob", "carol", "dave"):
            assert len(set(asyncio.run(runs(user)))) == 1
    finally:
        rt.shutdown()


def test_versions_share_identical_tensors(versions):
    rt, _ = start(graph(versions))
    try:
        reports = {r.path.split("/")[-1]: r for r in rt.store.report()}
        assert reports["v2"].shared_bytes > 0.9 * reports["v2"].bytes  # all but the head
        clients = rt.versioned("routed", "clf").clients
        v1, v2 = (clients[v].worker.runner.heads[clients[v].head].model for v in ("v1", "v2"))
        assert clients["v1"].worker is clients["v2"].worker  # one backbone: one worker, two heads
        assert (
            v1.bert.embeddings.word_embeddings.weight.data_ptr()
            == v2.bert.embeddings.word_embeddings.weight.data_ptr()
        )
        assert v1.classifier.weight.data_ptr() != v2.classifier.weight.data_ptr()
    finally:
        rt.shutdown()


def test_upload_route_rollout_and_unload_frees_memory(versions):
    rt, executor = start(graph(versions, "{v1: 100, v2: 0}"))
    try:
        before = rt.store.total_bytes()
        rt.add_version("routed", "clf", "v3", versions["big"])
        assert rt.store.total_bytes() > before
        rt.set_route("routed", "clf", parse_split("v1:50%, v3:50%"))
        seen = {asyncio.run(executor.run({"text": f"t{i}"})).versions["clf"] for i in range(30)}
        assert seen == {"v1", "v3"}
        with pytest.raises(RouteError, match="traffic"):
            rt.remove_version("routed", "clf", "v3")  # still routed to
        rt.set_route("routed", "clf", {"v1": 100})
        rt.remove_version("routed", "clf", "v3")
        gc.collect()
        assert rt.store.total_bytes() == before
        assert "clf@v3" not in rt.engine.loop.workers
        assert asyncio.run(executor.run({"text": "still serving"})).versions["clf"] == "v1"
    finally:
        rt.shutdown()


def test_upload_of_missing_or_corrupt_folder_is_refused(versions, tmp_path):
    rt, executor = start(graph(versions, "{v1: 100, v2: 0}"))
    try:
        with pytest.raises(ModelLoadError):
            rt.add_version("routed", "clf", "v9", tmp_path / "absent")
        corrupt = tmp_path / "corrupt"
        shutil.copytree(versions["v1"], corrupt)
        (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
        with pytest.raises(ModelLoadError):
            rt.add_version("routed", "clf", "v9", corrupt)
        assert set(rt.versioned("routed", "clf").clients) == {"v1", "v2"}
        assert asyncio.run(executor.run({"text": "fine"})).outputs["first"]
    finally:
        rt.shutdown()


def test_reload_under_load_fails_no_request(versions):
    rt, old = start(graph(versions, "{v1: 100, v2: 0}"))
    rng = random.Random(0)
    try:

        async def load_and_reload():
            tasks = [asyncio.ensure_future(old.run({"text": f"a{i}"})) for i in range(30)]
            await asyncio.sleep(0.01)
            new_spec = load_graph_text(graph(versions, "{v1: 0, v2: 100}"), "routed.yaml")
            new = rt.bind(new_spec)  # in-flight requests keep the executor they started on
            tasks += [asyncio.ensure_future(new.run({"text": f"b{i}"})) for i in range(30)]
            await asyncio.sleep(rng.random() * 0.01)
            results = await asyncio.gather(*tasks)
            rt.release(old)
            return results

        results = asyncio.run(load_and_reload())
        assert all(r.outputs["first"] for r in results)
        assert {r.versions["clf"] for r in results[30:]} == {"v2"}
        assert rt.graphs["routed"] is not old
    finally:
        rt.shutdown()
