"""LoRA adapters in graphs: a model's ``adapters:``, a generate node's ``adapter:``, and
versions that are adapters on the model's base (routed and sticky like any version)."""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter

import pytest

from conftest import LORA_VARIANTS, build_lora
from trae_groups.engine import EngineConfig, ModelLoadError
from trae_groups.engine.protocol import GenerateRequest
from trae_groups.engine.sampling import SamplingParams
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime

PARAMS = "{max_tokens: 8, temperature: 0}"


@pytest.fixture(scope="module")
def loras(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("graph-loras")
    return {
        name: build_lora(root / name, llama_dir, seed=i, **LORA_VARIANTS[name])
        for i, name in enumerate(("short", "mlp"))
    }


def start(text: str):
    spec = load_graph_text(text, "lora.yaml")
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=4 << 20, fast_linear=False))
    executor = rt.bind(spec)
    rt.start()
    return rt, executor


async def alone(client, text: str, adapter: str | None = None) -> str:
    """What the model generates for this prompt with this adapter, outside any graph."""
    request = GenerateRequest(
        "alone", SamplingParams(max_tokens=8, temperature=0), prompt=text, adapter=adapter
    )
    return "".join([chunk.text async for chunk in client.generate(request)])


def test_generate_nodes_pick_adapters_of_one_model(llama_dir, loras):
    rt, executor = start(f"""
name: lora
models:
  dialog:
    source: {llama_dir}
    task: generate
    adapters: {{short: {loras["short"]}, mlp: {loras["mlp"]}}}
    max_loras: 2
    max_lora_rank: 8
inputs: {{text: str}}
nodes:
  plain: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {PARAMS}}}
  terse: {{model: dialog, adapter: short, prompt: "{{{{ inputs.text }}}}", params: {PARAMS}}}
  deep: {{model: dialog, adapter: mlp, prompt: "{{{{ inputs.text }}}}", params: {PARAMS}}}
outputs: {{plain: plain.text, terse: terse.text, deep: deep.text}}
""")
    try:
        texts = ["hello world", "the quick brown fox", "book a flight to Paris"]

        async def go():
            results = await asyncio.gather(*(executor.run({"text": t}) for t in texts))
            client = executor.models["dialog"].clients["default"]
            for text, result in zip(texts, results, strict=True):
                assert result.outputs["plain"] == await alone(client, text)
                assert result.outputs["terse"] == await alone(client, text, "short")
                assert result.outputs["deep"] == await alone(client, text, "mlp")
            return results

        results = asyncio.run(go())
        outputs = [r.outputs for r in results]
        assert any(o["terse"] != o["plain"] for o in outputs)
        assert any(o["deep"] != o["plain"] for o in outputs)
        worker = executor.models["dialog"].clients["default"].worker
        assert worker.adapters.names() == ["mlp", "short"]
        assert worker.adapters.max_loras == 2  # the model entry's max_loras reached the engine
        assert worker.adapters.max_rank == 8  # and its max_lora_rank
    finally:
        rt.shutdown()


def test_a_version_that_is_an_adapter_gets_its_share_and_sticks(llama_dir, loras):
    rt, executor = start(f"""
name: lora
models:
  dialog:
    task: generate
    versions: {{v1: {llama_dir}, v2: {{adapter: {loras["short"]}}}}}
    route: {{v1: 50, v2: 50}}
    sticky: user
inputs: {{text: str, user: {{type: str, default: anonymous}}}}
nodes:
  reply: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {PARAMS}}}
outputs: {{reply: reply.text}}
""")
    try:
        users = [f"user-{i}" for i in range(24)]

        async def go():
            return await asyncio.gather(
                *(executor.run({"text": "hello world", "user": u}) for u in users * 2)
            )

        results = asyncio.run(go())
        chosen = [r.versions["dialog"] for r in results]
        assert set(Counter(chosen)) == {"v1", "v2"}  # 24 users over 50/50: both get some
        assert chosen[:24] == chosen[24:]  # the same user, the same version
        clients = executor.models["dialog"].clients
        assert clients["v2"].base is clients["v1"]  # one worker, one copy of the base

        async def expected():
            return {
                "v1": await alone(clients["v1"], "hello world"),
                "v2": await alone(clients["v1"], "hello world", "v2"),
            }

        texts = asyncio.run(expected())
        assert texts["v1"] != texts["v2"]
        for result in results:
            assert result.outputs["reply"] == texts[result.versions["dialog"]]
    finally:
        rt.shutdown()


@pytest.mark.parametrize(
    ("model", "node", "message"),
    [
        ("adapters: {a: ./x}", "adapter: b", "model 'm' has no adapter 'b' (its adapters: ['a'])"),
        ("", "adapter: a", "model 'm' has no adapter 'a' (it has no adapters)"),
    ],
)
def test_a_node_naming_an_unknown_adapter_is_a_load_error(llama_dir, model, node, message):
    text = f"""
name: lora
models:
  m: {{source: {llama_dir}, task: generate, {model}}}
nodes:
  reply: {{model: m, {node}, prompt: "hi"}}
outputs: {{reply: reply.text}}
"""
    with pytest.raises(GraphValidationError) as info:
        load_graph_text(text, "lora.yaml")
    assert message in str(info.value)
    assert "lora.yaml:6" in str(info.value) and "reply" in str(info.value)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("{source: ./e, task: classify, adapters: {a: ./x}}", "for generate models, not classify"),
        ("{task: generate, versions: {v1: {adapter: ./x}}}", "need a version that is a model"),
        ("{task: generate, versions: {v1: ./m, a: {adapter: ./x}}, adapters: {a: ./y}}",
         "['a'] name both a version and an adapter"),
        ("{source: ./m, task: generate, max_loras: 0}", "greater than 0"),
    ],
)  # fmt: skip
def test_bad_adapter_declarations_are_load_errors(model, message):
    text = f"name: lora\nmodels:\n  m: {model}\n"
    with pytest.raises(GraphValidationError) as info:
        load_graph_text(text, "lora.yaml")
    assert message in str(info.value) and "lora.yaml:3" in str(info.value)


def test_a_bad_adapter_folder_fails_the_bind_naming_it(llama_dir, tmp_path):
    (tmp_path / "broken").mkdir()
    spec = load_graph_text(f"""
name: lora
models:
  m: {{source: {llama_dir}, task: generate, adapters: {{a: {tmp_path / "broken"}}}}}
nodes:
  reply: {{model: m, adapter: a, prompt: "hi"}}
outputs: {{reply: reply.text}}
""")
    rt = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=4 << 20, fast_linear=False))
    try:
        with pytest.raises(ModelLoadError, match="broken: no adapter_config.json"):
            rt.bind(spec)
    finally:
        rt.shutdown()


def test_model_info_counts_adapter_bytes(llama_dir, loras, tmp_path, capsys):
    import json

    from trae_groups.cli import main

    graph = tmp_path / "lora.yaml"
    graph.write_text(f"""
name: lora
models:
  dialog: {{source: {llama_dir}, task: generate, adapters: {{short: {loras["short"]}}}}}
nodes:
  reply: {{model: dialog, adapter: short, prompt: "hi"}}
outputs: {{reply: reply.text}}
""")
    assert main(["model", "info", str(graph), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {m["name"]: m for m in report["models"]}
    # rank 4 on q_proj (64 -> 64) and v_proj (64 -> 32), 2 layers, float32
    short = 2 * 4 * ((64 + 64) + (64 + 32))
    assert rows["dialog:short"]["task"] == "lora r=4"
    assert rows["dialog:short"]["parameters"] == short
    assert report["adapter_bytes"] == rows["dialog:short"]["bytes"] == 4 * short
    assert report["held_bytes"] == rows["dialog"]["bytes"]  # the base, held once


TOKEN = "lora-admin-token"


@pytest.fixture(scope="module")
def lora_server(llama_dir, loras, tmp_path_factory):
    from trae_groups.serving.server import ServerConfig, ServerThread, create_app

    graph = tmp_path_factory.mktemp("lora-server") / "lora.yaml"
    graph.write_text(f"""
name: lora
models:
  dialog:
    task: generate
    versions: {{v1: {llama_dir}, v2: {{adapter: {loras["mlp"]}}}}}
    adapters: {{short: {loras["short"]}}}
inputs: {{text: str}}
nodes:
  reply: {{model: dialog, prompt: "{{{{ inputs.text }}}}", params: {PARAMS}}}
outputs: {{reply: reply.text}}
""")
    config = ServerConfig(engine=EngineConfig(pool_bytes=4 << 20), admin_token=TOKEN)
    with ServerThread(create_app([graph], config)) as server:
        yield server


def complete(http, model: str, prompt: str = "hello world"):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return http.post("/v1/completions", json=body)


def test_openai_lists_and_serves_adapters_by_model_id(lora_server, loras):
    import httpx

    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        served = http.get("/v1/graphs/lora").json()["models"]["dialog"]["versions"]
        assert served["v2"] == str(loras["mlp"])  # an adapter version shows its own folder
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert {"dialog", "dialog:short", "dialog:v2", "lora/dialog:short"} <= set(listed)
        assert listed["dialog:short"]["parent"] == "dialog"
        assert listed["lora/dialog:v2"]["trae"]["kind"] == "adapter"
        texts = {}
        for model in ("dialog", "dialog:short", "dialog:v2"):
            answer = complete(http, model)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
            texts[model] = answer.json()["choices"][0]["text"]
        unknown = complete(http, "dialog:nope")
        assert unknown.status_code == 404 and "dialog:nope" in unknown.text
    runtime = lora_server.state.runtime
    worker = runtime.graphs["lora"].models["dialog"].clients["v1"].worker
    expected = runtime.engine.generate(
        ["hello world"] * 3,
        SamplingParams(max_tokens=8, temperature=0),
        model=worker.name,
        adapters=[None, "short", "v2"],
    )
    assert [texts[m] for m in ("dialog", "dialog:short", "dialog:v2")] == [o.text for o in expected]
    assert len(set(texts.values())) == 3


def test_admin_uploads_routes_and_unloads_an_adapter_version(lora_server, loras, tmp_path):
    import httpx

    from trae_groups.cli import main

    auth = {"Authorization": f"Bearer {TOKEN}"}
    versions = "/admin/graphs/lora/models/dialog/versions"
    route = "/admin/graphs/lora/models/dialog/route"
    cut = tmp_path / "cut"
    shutil.copytree(loras["short"], cut)
    weights = cut / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    worker = lora_server.state.runtime.graphs["lora"].models["dialog"].clients["v1"].worker
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        bad = http.post(versions, headers=auth, json={"version": "v3", "adapter": str(cut)})
        assert bad.status_code == 422 and "corrupt adapter_model.safetensors" in bad.text
        # the CLI's upload: a version that is an adapter, 0% until routed
        assert main(["model", "upload", "dialog", "--version", "v3", "--adapter",
                     str(loras["short"]), "--url", lora_server.url, "--token", TOKEN]) == 0  # fmt: skip
        assert "v3" in worker.adapters.names()
        routed = http.post(route, headers=auth, json={"split": "v1:0%, v2:0%, v3:100%"})
        assert routed.status_code == 200
        try:
            run = http.post("/v1/graphs/lora", json={"inputs": {"text": "hello world"}}).json()
            assert run["versions"] == {"dialog": "v3"}
            # v3 is the "short" adapter's folder: it answers as dialog:short does
            assert run["outputs"]["reply"] == complete(http, "dialog:short").json()["choices"][0]["text"]  # fmt: skip
            busy = http.delete(versions + "/v3", headers=auth)
            assert busy.status_code == 422 and "traffic" in busy.text
        finally:
            http.post(route, headers=auth, json={"split": {"v1": 100}})
        gone = http.delete(versions + "/v3", headers=auth)
        assert gone.status_code == 200 and gone.json()["versions"] == ["v1", "v2"]
        assert "v3" not in worker.adapters.names()
        run = http.post("/v1/graphs/lora", json={"inputs": {"text": "hi"}})
        assert run.status_code == 200 and run.json()["versions"] == {"dialog": "v1"}


def test_the_dsl_declares_adapters_as_yaml_does(llama_dir, loras):
    from trae_groups import ModelGroup

    group = ModelGroup("lora")
    group.add_model("dialog", path=str(llama_dir), task="generate",
                    adapters={"short": str(loras["short"])}, max_loras=2)  # fmt: skip
    text = group.input("text", str)
    reply = group.generate("reply", model="dialog", adapter="short", prompt=text, max_tokens=4)
    group.output("reply", reply.text)
    yaml_spec = load_graph_text(f"""
name: lora
models:
  dialog: {{source: {llama_dir}, task: generate, adapters: {{short: {loras["short"]}}}, max_loras: 2}}
inputs: {{text: str}}
nodes:
  reply: {{model: dialog, adapter: short, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 4}}}}
outputs: {{reply: reply.text}}
""")
    assert group.spec() == yaml_spec


def test_validate_reports_missing_adapter_folders_at_their_lines(
    llama_dir, loras, tmp_path, capsys
):
    from trae_groups.cli import main

    graph = tmp_path / "lora.yaml"
    graph.write_text(f"""name: lora
models:
  dialog:
    task: generate
    versions:
      v1: {llama_dir}
      v2: {{adapter: ./gone}}
    adapters:
      short: {loras["short"]}
      nowhere: ./nowhere
nodes:
  reply: {{model: dialog, prompt: "hi"}}
outputs: {{reply: reply.text}}
""")
    assert main(["validate", str(graph)]) == 1
    err = capsys.readouterr().err
    assert f"lora.yaml:7: model 'dialog': no LoRA adapter at {tmp_path / 'gone'}" in err
    assert f"lora.yaml:10: model 'dialog': no LoRA adapter at {tmp_path / 'nowhere'}" in err
    assert "short" not in err
