"""Hardening: no single request, file or upload can stall, freeze or exhaust the server.

Each test is one abuse a client or a graph author can commit, on tiny real models and
real files, bounded in time."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import textwrap
import threading
import time
import tracemalloc

import pytest

from conftest import build_llm
from trae_groups.cli import main
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.errors import ModelLoadError, RequestError
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.scheduler import Scheduler, SchedulerSettings
from trae_groups.engine.sequence import Sequence
from trae_groups.engine.weights import WeightStore
from trae_groups.graphs.compile import resolve_functions
from trae_groups.graphs.errors import GraphValidationError, TemplateRenderError
from trae_groups.graphs.functions import ENV_VAR
from trae_groups.graphs.loader import load_graph_text
from trae_groups.graphs.templates import Condition, GraphTemplate

# -- 1. one long prompt must not stall the other LLM requests ------------------------------


def seq(n_prompt: int, rid: str) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(), lambda out: None)


def scheduler(budget: int, cap: int) -> Scheduler:
    pool = MemoryPool(256, 1024)
    return Scheduler(pool, "m", SchedulerSettings(4, 8, budget, "m", long_prefill_tokens=cap))


def test_a_long_prefill_leaves_room_for_waiting_prompts_and_running_decodes():
    s = scheduler(budget=16, cap=4)
    long = seq(200, "long")
    s.add(long)
    alone = s.schedule()
    assert [(i.seq.request_id, i.num_new) for i in alone.prefills] == [("long", 16)]
    long.num_computed += 16
    s.add(seq(3, "short"))
    both = s.schedule()  # the long chunk is capped while "short" waits, then topped up
    assert [(i.seq.request_id, i.num_new) for i in both.prefills] == [("long", 13), ("short", 3)]
    for item in both.scheduled:
        item.seq.num_computed += item.num_new
        if item.samples:
            item.seq.output_token_ids.append(7)
    after = s.schedule()  # "short" decodes; the long prompt takes the rest
    assert [(i.seq.request_id, i.num_new) for i in after.decodes] == [("short", 1)]
    assert [(i.seq.request_id, i.num_new) for i in after.prefills] == [("long", 15)]


def test_many_waiting_prompts_each_get_in_while_a_long_one_runs():
    s = scheduler(budget=16, cap=4)
    s.add(seq(200, "long"))
    s.schedule()
    for i in range(3):
        s.add(seq(4, f"s{i}"))
    out = s.schedule()
    assert sorted(i.seq.request_id for i in out.prefills) == ["long", "s0", "s1", "s2"]
    assert out.num_tokens == 16


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory):
    return build_llm(tmp_path_factory.mktemp("long-llm"), max_position_embeddings=4096)


def _timed(eng: LLMEngine, prompt: list[int], max_tokens: int) -> dict:
    """Submit; the returned dict gets 'latency' (seconds to the final output) and
    'steps' (engine steps of the model from submit to the final output)."""
    worker = eng.llms["m"]
    result: dict = {
        "start": time.monotonic(),
        "step": worker.counters.steps,
        "done": threading.Event(),
    }

    def sink(out):  # on the engine thread, right after the step that finished it
        if out.finished:
            result["latency"] = time.monotonic() - result["start"]
            result["steps"] = worker.counters.steps - result["step"]
            result["out"] = out
            result["done"].set()

    eng.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), sink=sink)
    return result


def test_a_short_request_is_served_while_a_long_prompt_prefills(long_llm):
    config = EngineConfig(pool_bytes=16 << 20, max_num_batched_tokens=32, fast_linear=False)
    short = [5, 6, 7, 8]
    alone, beside, longs = [], [], []
    with LLMEngine({"m": long_llm}, config) as eng:
        worker = eng.llms["m"]
        for offset in range(3):  # alone and beside in turn: both meet the same load
            alone.append(_timed(eng, short, 8))
            assert alone[-1]["done"].wait(60)
            # a new long prompt each time: no prefix-cache hits
            long = _timed(eng, list(range(3 + offset, 403 + offset)) * 5, 1)  # 2,000 tokens
            for _ in range(2000):  # the long prompt is under way (63 steps of 32 alone)
                if any(s.num_computed for s in list(worker.scheduler.running)):
                    break
                time.sleep(0.005)
            beside.append(_timed(eng, short, 8))
            assert beside[-1]["done"].wait(300) and long["done"].wait(300)
            longs.append(long)
    assert all(run["out"].token_ids == alone[0]["out"].token_ids for run in alone + beside)

    def median(runs, key):
        return statistics.median(run[key] for run in runs)

    # in engine steps (exact, whatever the machine's load): admitted at once, decoded
    # alongside; before the fix it waited for the whole prefill, ~60 steps
    assert median(beside, "steps") <= median(alone, "steps") + 2
    # and it finished while the long prompt was still prefilling (steps, not seconds)
    assert median(beside, "steps") < median(longs, "steps") / 3


def test_max_prompt_tokens_refuses_longer_prompts(llama_dir):
    config = EngineConfig(pool_bytes=8 << 20, fast_linear=False, max_prompt_tokens=10)
    with LLMEngine({"m": llama_dir}, config) as eng:
        with pytest.raises(RequestError) as err:
            eng.generate([list(range(3, 14))], SamplingParams(max_tokens=2))
        assert err.value.field == "prompt" and "max_prompt_tokens" in str(err.value)
        assert eng.generate([list(range(3, 13))], SamplingParams(max_tokens=2))[0].finished
        worker = eng.add_llm("m2", llama_dir, max_prompt_tokens=4)
        assert worker.max_prompt_tokens == 4
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        EngineConfig(max_prompt_tokens=0)


def test_text_no_tokenization_could_fit_is_refused_before_tokenizing(llama_dir, monkeypatch):
    from trae_groups.engine import chat
    from trae_groups.engine.protocol import GenerateRequest

    config = EngineConfig(pool_bytes=8 << 20, fast_linear=False, max_prompt_tokens=10)
    calls = []
    for name in ("encode", "chat_token_ids", "prompt_token_ids"):
        real = getattr(chat, name)
        monkeypatch.setattr(
            chat, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k)
        )
    with LLMEngine({"m": llama_dir}, config) as eng:
        worker = eng.llms["m"]
        bound = worker._chars_per_token_bound
        huge = "word " * (bound * 11 // 5 + 1)  # more characters than 10 tokens can hold
        asks = ({"prompt": huge}, {"messages": ({"role": "user", "content": huge},)})
        for i, request in enumerate(asks):
            with pytest.raises(RequestError) as err:
                ask = GenerateRequest(f"r{i}", SamplingParams(max_tokens=2), **request)
                worker.submit(ask, lambda out: None)
            assert err.value.field == "prompt" and "characters" in str(err.value)
        assert calls == []  # refused without tokenizing
        with pytest.raises(RequestError) as err:  # shorter text: tokenized, then counted
            eng.generate(["word " * 40], SamplingParams(max_tokens=2))
        assert "characters" not in str(err.value) and "max_prompt_tokens" in str(err.value)


def test_text_past_the_limit_is_refused_after_tokenizing_a_prefix(llama_dir, monkeypatch):
    """Text under the no-tokenizing bound but past the limit: only a probe of its beginning
    is tokenized (chat.probe), for the prompt and for a chat's
    messages; text up to twice the probe is tokenized whole and counted exactly."""
    from trae_groups.engine import chat, llm_worker
    from trae_groups.engine.protocol import GenerateRequest

    monkeypatch.setattr(llm_worker, "PROBE_SLACK", 4)  # the tiny model's 40 tokens, not 8k
    config = EngineConfig(pool_bytes=8 << 20, fast_linear=False, max_prompt_tokens=40)
    tokenized: list[int] = []
    real = chat.encode
    monkeypatch.setattr(
        chat, "encode", lambda tok, text: tokenized.append(len(text)) or real(tok, text)
    )
    with LLMEngine({"m": llama_dir}, config) as eng:
        worker = eng.llms["m"]
        probe = chat.PROBE_CHARS_PER_TOKEN * (40 + 4)
        long = "word " * 200  # 1,000 characters: under the bound, over twice the probe
        assert len(long) // worker._chars_per_token_bound <= 40 and len(long) > 2 * probe
        asks = ({"prompt": long}, {"messages": ({"role": "user", "content": long},)})
        for i, request in enumerate(asks):
            tokenized.clear()
            with pytest.raises(RequestError) as err:
                ask = GenerateRequest(f"r{i}", SamplingParams(max_tokens=2), **request)
                worker.submit(ask, lambda out: None)
            assert err.value.field == "prompt" and "more than 40 tokens" in str(err.value)
            assert tokenized == [probe]  # the probe, never the whole
        tokenized.clear()
        with pytest.raises(RequestError) as err:  # within twice the probe: counted exactly
            eng.generate(["word " * 100], SamplingParams(max_tokens=2))
        assert "more than" not in str(err.value) and "max_prompt_tokens" in str(err.value)
        assert tokenized == [500]


# -- 3. templates: compiling never evaluates; rendering is bounded ------------------------


def bounded(work, seconds: float = 60.0):
    """Run work() in a thread; fail (not hang) if it does not finish in time."""
    result: dict = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as exc:  # handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def graph_with(prompt: str, when: str | None = None) -> str:
    node = {"model": "llm", "prompt": prompt} | ({"when": when} if when else {})
    return textwrap.dedent(f"""\
        name: g
        models:
          llm: {{source: ./llm, task: generate}}
        inputs: {{text: str}}
        nodes:
          reply: {node!r}
        outputs: {{out: reply.text}}
        """)


def test_validating_huge_constant_expressions_neither_hangs_nor_allocates():
    tracemalloc.start()
    try:
        for expression in ["9 ** (9 ** 9)", "'x' * 10**9", "[0] * 10**9", "'x' | center(10**9)"]:
            text = graph_with("{{ " + expression + " }}", when=expression + " != 1")
            spec = bounded(lambda text=text: load_graph_text(text, "g.yaml"))
            assert spec.nodes["reply"].prompt == "{{ " + expression + " }}"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # before: 2.9 GB for 'x' * 10**9


@pytest.mark.parametrize(
    "template",
    [
        "{{ 9 ** (9 ** 9) }}",
        "a {{ 'x' * 10**9 }}",
        "{{ [0] * 10**9 }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ 'x' | center(10**9) }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ '%0999999999d' | format(1) }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ '{:>{w}}'.format(1, w=10**9) }}",
        "{{ ('a' * 4000000) | replace('a', 'bb') }}",
        "{{ [1] | batch(10**9, 0) | list }}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    ],
)
def test_rendering_stops_at_the_template_limits(template):
    compiled = bounded(lambda: GraphTemplate(template), 10)
    with pytest.raises(TemplateRenderError, match="over the template limits"):
        bounded(lambda: compiled.render({}), 30)


def test_conditions_are_bounded_too():
    with pytest.raises(TemplateRenderError, match="over the template limits"):
        bounded(lambda: Condition("('x' * 10**9) | length > 1").evaluate({}), 30)


def test_ordinary_templates_are_unchanged_by_the_limits():
    context = {"inputs": {"docs": ["a", "b"], "n": 3}}
    assert GraphTemplate("{{ 2 ** 10 + inputs.n * 2 }}").render(context) == 1030
    assert GraphTemplate("{{ inputs.docs + ['c'] }}").render(context) == ["a", "b", "c"]
    rendered = GraphTemplate(
        "{% for d in inputs.docs %}{{ loop.index }}:{{ d ~ '!' }} {% endfor %}"
        "{{ '%03d' % inputs.n }} {{ '{:>4}'.format('x') }} {{ 'ab' | center(6) }}"
    ).render(context)
    assert rendered == "1:a! 2:b! 003    x   ab  "


def test_a_deeply_nested_template_is_a_validation_issue():
    for template in [
        "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
        "{{ " + "(1 + " * 80 + "1" + ")" * 80 + " }}",
    ]:
        with pytest.raises(GraphValidationError) as err:
            bounded(lambda template=template: load_graph_text(graph_with(template), "g.yaml"))
        (issue,) = err.value.issues
        assert issue.node == "reply" and issue.line == 6 and "nested too deeply" in issue.message


# -- 8. a model folder that lies: refused before allocating, and never with NaN weights ----


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | changes))
    return dst


def test_a_config_with_thousands_of_layers_over_small_weights_is_refused_up_front(
    llama_dir, tmp_path, monkeypatch
):
    folder = _copy_with_config(llama_dir, tmp_path / "bomb", num_hidden_layers=3000)
    from transformers import LlamaForCausalLM

    def never(*args, **kwargs):
        raise AssertionError("weights were being loaded")

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", never)
    with pytest.raises(ModelLoadError, match="3000 layers; the weights hold 21 tensors"):
        bounded(lambda: WeightStore().load(folder, "generate"), 30)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 4096}, "model.safetensors: tensor model.embed_tokens.weight has shape"),
        ({"vocab_size": 10**8}, "tensor model.embed_tokens.weight has shape [512, 64]"),
    ],
)
def test_a_config_that_does_not_match_the_weights_is_refused_before_loading(
    llama_dir, tmp_path, monkeypatch, changes, message
):
    folder = _copy_with_config(llama_dir, tmp_path / "lie", **changes)
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", None)  # must not be reached
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        bounded(lambda: WeightStore().load(folder, "generate"), 30)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_with_non_finite_values_are_refused(llama_dir, tmp_path, bad):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(llama_dir, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as err:
        WeightStore().load(folder, "generate")
    assert "model.safetensors: tensor model.layers.1.mlp.up_proj.weight holds NaN" in str(err.value)


# -- 11. python nodes cannot name os:system and the like ----------------------------------


def python_graph(function: str) -> str:
    return textwrap.dedent(f"""\
        name: g
        inputs: {{text: str}}
        nodes:
          run: {{function: "{function}", args: {{command: "{{{{ inputs.text }}}}"}}}}
        outputs: {{out: run}}
        """)


@pytest.mark.parametrize(
    "function",
    ["os:system", "subprocess:run", "builtins:eval", "sys:exit", "shutil:rmtree",
     "importlib:import_module", "pickle:loads", "socket:create_connection", "ctypes:CDLL",
     "os.path:join", "graph_functions:__class__"],
)  # fmt: skip
def test_dangerous_functions_are_refused_at_validation(function, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(python_graph(function), "g.yaml")
    (issue,) = err.value.issues
    assert (issue.file, issue.line, issue.node) == ("g.yaml", 4, "run")
    assert f"'{function}'" in issue.message and "not allowed" in issue.message


@pytest.mark.parametrize("function", ["logging:os.system", "json:codecs.open"])
def test_dangerous_functions_reached_through_another_module_are_refused(function, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    spec = load_graph_text(python_graph(function), "g.yaml")  # the text looks harmless
    with pytest.raises(GraphValidationError) as err:
        resolve_functions(spec)
    (issue,) = err.value.issues
    assert issue.line == 4 and "is not allowed in graphs" in issue.message


def test_the_operator_allow_list_is_the_only_list_when_set(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "graph_functions, os.path")
    assert resolve_functions(load_graph_text(python_graph("graph_functions:shout"), "g.yaml"))
    assert resolve_functions(load_graph_text(python_graph("os.path:join"), "g.yaml"))
    with pytest.raises(GraphValidationError) as err:
        load_graph_text(python_graph("json:dumps"), "g.yaml")
    assert "module 'json' is not in TRAE_ALLOWED_FUNCTIONS" in err.value.issues[0].message


def test_trae_validate_reports_the_refused_function_and_takes_the_allow_flag(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(ENV_VAR, "")  # blank: unset; restored after main() sets it
    path = tmp_path / "g.yaml"
    path.write_text(python_graph("subprocess:getoutput"))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:4: node 'run': 'subprocess:getoutput': module 'subprocess'" in err
    assert main(["validate", "--allow-functions", "subprocess", str(path)]) == 0
