"""Models resident on demand: three LLMs served within a weight budget that holds two.

Real tiny models on disk, a real server on 127.0.0.1; every answer is checked against
transformers' own greedy ``generate`` of the model it names.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import build_llm, build_lora
from trae_groups.cli import main
from trae_groups.engine import EngineConfig
from trae_groups.engine.errors import ModelLoadError, ModelUnavailable
from trae_groups.engine.protocol import GenerateRequest
from trae_groups.engine.residency import OnDemandLLM
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.weights import estimate_bytes
from trae_groups.graphs.errors import GraphValidationError, NodeError
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.runtime import ModelRuntime
from trae_groups.serving.http_errors import error_response
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

NAMES = ("a", "b", "c")
MAX_TOKENS = 6
PROMPTS = ["hello world", "the quick brown fox", "please refund me"]


def graph(root, budget: int, wait: str = "60", resident: str = ", resident: on_demand") -> str:
    models = "\n".join(f"  {n}: {{source: {root / n}, task: generate{resident}}}" for n in NAMES)
    nodes = "\n".join(
        f"  {n}: {{model: {n}, prompt: '{{{{ inputs.text }}}}', "
        f"params: {{max_tokens: {MAX_TOKENS}, temperature: 0}}}}"
        for n in NAMES
    )
    outputs = ", ".join(f"{n}: {n}.text" for n in NAMES)
    return (
        f"name: trio\nresources: {{weight_budget: {budget}, load_wait_s: {wait}}}\n"
        f"models:\n{models}\ninputs: {{text: str}}\nnodes:\n{nodes}\noutputs: {{{outputs}}}\n"
    )


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("trio")
    for seed, name in enumerate(NAMES):
        build_llm(root / name, seed=seed + 1)
    one = estimate_bytes(root / "a", torch.float32)
    return root, int(2.5 * one)  # room for two of the three


def expected(root) -> dict[tuple[str, str], str]:
    """transformers' greedy continuation of every prompt by every model."""
    out = {}
    for name in NAMES:
        tok = AutoTokenizer.from_pretrained(root / name)
        model = AutoModelForCausalLM.from_pretrained(root / name).eval()
        for prompt in PROMPTS:
            ids = tok.encode(prompt, add_special_tokens=False)
            with torch.no_grad():
                gen = model.generate(
                    torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                )[0, len(ids):].tolist()  # fmt: skip
            if tok.eos_token_id in gen:
                gen = gen[: gen.index(tok.eos_token_id)]
            out[(name, prompt)] = tok.decode(gen, skip_special_tokens=True)
    return out


def metric(text: str, name: str, model: str) -> float:
    match = re.search(rf'^{name}{{model="{model}",replica="local"}} (\S+)$', text, re.M)
    assert match, f"{name} for {model} missing"
    return float(match.group(1))


@pytest.mark.parametrize("resident", [", resident: on_demand", ""], ids=["marked", "pressure"])
def test_three_llms_in_a_budget_for_two_all_answer_under_interleaved_load(trio, resident):
    """Marked on demand, or not marked at all: a budget that cannot hold every model
    makes the unmarked generate models resident on demand too."""
    root, budget = trio
    (root / "trio.yaml").write_text(graph(root, budget, resident=resident))
    want = expected(root)
    calls = [(NAMES[i % 3], PROMPTS[(i // 3) % 3]) for i in range(18)]
    calls = calls[::2] + calls[1::2]  # interleaved: no model's requests come together

    async def run(url: str) -> list[tuple[int, dict]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def one(model: str, prompt: str):
                body = {"inputs": {"text": prompt}, "outputs": [model]}
                r = await http.post("/v1/graphs/trio", json=body)
                return r.status_code, r.json()

            results = []
            for start in range(0, len(calls), 3):  # three at a time: one always waits
                results += await asyncio.gather(*(one(*c) for c in calls[start : start + 3]))
            return results

    with ServerThread(create_app([root / "trio.yaml"], ServerConfig())) as server:
        results = asyncio.run(run(server.url))
        text = httpx.get(f"{server.url}/metrics").text
        reports = {r.name: r for r in server.state.runtime.store.report()}
    for (model, prompt), (status, body) in zip(calls, results, strict=True):
        assert status == 200, body
        assert body["outputs"][model] == want[(model, prompt)], (model, prompt)
    evictions = sum(metric(text, "trae_model_evictions_total", n) for n in NAMES)
    loads = sum(metric(text, "trae_model_loads_total", n) for n in NAMES)
    assert evictions > 0 and loads == evictions + sum(
        metric(text, "trae_model_resident", n) for n in NAMES
    )
    assert sum(metric(text, "trae_model_resident", n) for n in NAMES) <= 2
    # what /metrics says each resident model holds is the store's own count
    assert set(reports) == {n for n in NAMES if metric(text, "trae_model_resident", n)}
    for name, report in reports.items():
        for kind, value in (("total", report.bytes), ("private", report.private_bytes)):
            line = (
                rf'^trae_model_weight_bytes{{kind="{kind}",model="{name}",replica="local"}} (\S+)$'
            )
            assert float(re.search(line, text, re.M).group(1)) == value
    rss = re.search(r'^trae_process_memory_bytes{kind="rss"} (\S+)$', text, re.M)
    assert rss and float(rss.group(1)) > sum(r.bytes for r in reports.values())
    budget_line = re.search(r"^trae_weight_budget_bytes\{replica=\"local\"\} (\S+)$", text, re.M)
    assert budget_line and float(budget_line.group(1)) == budget


def test_a_model_that_cannot_become_resident_in_time_is_a_retryable_503(trio):
    """Budget for one model, held by a generation that stays open: the other model's
    request waits load_wait_s, then gets ModelUnavailable (503 + Retry-After); once
    the first is done, the second loads and answers."""
    root, budget = trio
    spec = load_graph_text(graph(root, budget // 2, wait="0.3"), "trio.yaml")
    rt = ModelRuntime.for_specs([spec])
    assert rt.config.weight_budget == budget // 2 and rt.config.load_wait_s == 0.3
    executor = rt.bind(spec)
    rt.start()
    a, b = (executor.models[n].clients["default"] for n in ("a", "b"))
    assert isinstance(a, OnDemandLLM)

    def request(i: int) -> GenerateRequest:
        return GenerateRequest(f"r{i}", SamplingParams(max_tokens=4), prompt="hello world")

    async def retried(client, first: int):
        """A generation opened and its first chunk read, retried as a client told to
        retry would (a load can outlast the 0.3 s wait on a busy machine)."""
        for attempt in range(50):
            stream = client.generate(request(first + attempt))
            try:
                return stream, await stream.__anext__()
            except ModelUnavailable:
                await asyncio.sleep(0.1)
        raise AssertionError(f"{client.name!r} never became resident")

    async def scenario():
        held, first = await retried(a, 100)  # "a" is resident and in use while it is open
        with pytest.raises(ModelUnavailable) as refused:
            async for _ in b.generate(request(2)):
                pass
        await held.aclose()  # "a" is idle now: "b" may evict it
        stream, head = await retried(b, 200)
        return first, refused.value, [head] + [c async for c in stream]

    try:
        first, refused, chunks = asyncio.run(scenario())
    finally:
        rt.shutdown()
    assert first.token_ids and refused.retry_after >= 1 and "b" in str(refused)
    assert chunks[-1].finished and chunks[-1].finish_reason in ("stop", "length")
    stats = rt.stats()
    assert stats.residency["a"].evictions == 1 and stats.residency["b"].resident
    assert stats.pool.used_pages == 0 and not stats.pool.cached_by_owner.get("a")


def test_resident_always_is_never_evicted_and_a_budget_it_fills_is_refused_at_start(trio):
    root, budget = trio
    text = graph(root, budget).replace(
        f"{{source: {root / 'a'}, task: generate, resident: on_demand}}",
        f"{{source: {root / 'a'}, task: generate, resident: always}}",
    )
    spec = load_graph_text(text, "trio.yaml")
    rt = ModelRuntime.for_specs([spec], EngineConfig(weight_budget=budget // 2))
    rt.bind(spec)
    assert rt.engine.llms["a"] and set(rt.stats().residency) == {"b", "c"}
    with pytest.raises(ModelLoadError, match="always-resident models hold"):
        rt.start()
    rt.shutdown()


def test_an_on_demand_model_larger_than_the_budget_is_refused_at_load(trio):
    root, budget = trio
    spec = load_graph_text(graph(root, budget // 4), "trio.yaml")
    rt = ModelRuntime.for_specs([spec])
    with pytest.raises(ValueError, match="weight budget"):
        rt.bind(spec)
    rt.shutdown()


def test_model_info_lists_on_demand_models_with_their_estimate(trio, capsys):
    root, budget = trio
    (root / "info.yaml").write_text(graph(root, budget))
    assert main(["model", "info", str(root / "info.yaml"), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert {n: r["resident"] for n, r in rows.items()} == dict.fromkeys(NAMES, "on_demand")
    assert rows["a"]["bytes"] == estimate_bytes(root / "a", torch.float32)
    assert rows["a"]["parameters"] is None  # not loaded: nothing is counted but the estimate


def test_an_unavailable_model_answers_503_with_retry_after_on_every_route():
    cause = ModelUnavailable("b", "still loading after 0.3 s", retry_after=3)
    for error, openai in ((NodeError("reply", cause), False), (cause, True)):
        response = error_response(error, openai=openai)
        assert response.status_code == 503 and response.headers["Retry-After"] == "3"
        assert "still loading" in json.loads(response.body)["error"]["message"]


def test_resident_on_demand_on_an_encoder_is_refused_at_load_naming_file_and_model():
    text = (
        "name: g\nmodels:\n  intent: {source: ./x, task: classify, resident: on_demand}\n"
        "inputs: {text: str}\nnodes:\n  i: {model: intent, input: '{{ inputs.text }}'}\n"
        "outputs: {label: i.label}\n"
    )
    with pytest.raises(GraphValidationError) as error:
        load_graph_text(text, "g.yaml")
    assert "g.yaml:3:" in str(error.value) and "resident: on_demand is for generate models" in str(
        error.value
    )


def test_adapters_on_an_on_demand_model_are_refused_with_the_reason(trio, tmp_path):
    """Marked on demand: a load error with the file's line; made on demand by a budget that
    cannot hold every model: refused when bound, naming the model (was an AttributeError)."""
    root, budget = trio
    adapter = build_lora(
        tmp_path / "lora", root / "a", r=2, lora_alpha=4, target_modules=["q_proj"]
    )
    marked = graph(root, budget).replace(
        f"{{source: {root / 'a'}, task: generate, resident: on_demand}}",
        f"{{source: {root / 'a'}, task: generate, resident: on_demand, adapters: {{x: {adapter}}}}}",
    )
    with pytest.raises(GraphValidationError, match=r"trio.yaml:\d+.*LoRA adapters need their base"):
        load_graph_text(marked, "trio.yaml")
    pressed = graph(root, budget, resident="").replace(
        f"{{source: {root / 'a'}, task: generate}}",
        f"{{source: {root / 'a'}, task: generate, adapters: {{x: {adapter}}}}}",
    )
    spec = load_graph_text(pressed, "trio.yaml")
    rt = ModelRuntime.for_specs([spec])
    try:
        with pytest.raises(ModelLoadError, match="'a' is loaded on demand") as refused:
            rt.bind(spec)
        assert refused.value.field == "adapters"
    finally:
        rt.shutdown()


def test_swapping_on_demand_models_leaves_no_objects_behind_with_compile_auto(
    trio, tmp_path, monkeypatch
):
    """compile="auto" leaves on-demand models eager: torch keeps a compiled graph's
    artifacts after its model is evicted (~6,000 objects and a few MB per load before)."""
    import gc

    from trae_groups.engine.config import COMPILE_ENV

    monkeypatch.setenv(COMPILE_ENV, "1")  # "auto" compiles where it works (not by default)
    root, _ = trio
    one = estimate_bytes(root / "a", torch.float32)
    spec = load_graph_text(graph(root, int(1.5 * one)), str(tmp_path / "trio.yaml"))
    runtime = ModelRuntime.for_specs([spec], EngineConfig(pool_bytes=16 << 20, compile="auto"))
    graph_run = runtime.bind(spec)
    runtime.start()

    async def rounds(n: int) -> int:
        for _ in range(n):
            for name in NAMES:
                await graph_run.run({"text": "hello world"}, outputs=[name])
        gc.collect()
        return len(gc.get_objects())

    try:
        asyncio.run(rounds(2))  # warm: first loads, caches
        before = asyncio.run(rounds(1))
        after = asyncio.run(rounds(3))
        loads = sum(r.loads for r in runtime.stats().residency.values())
        assert runtime.engine.llms == {} or all(
            w.runner.compiled is None for w in runtime.engine.llms.values()
        )
    finally:
        runtime.shutdown()
    assert loads == 6 * len(NAMES)  # every round evicted and loaded each model again
    assert after - before < 1000, (before, after)  # was ~17,600 more over three rounds
