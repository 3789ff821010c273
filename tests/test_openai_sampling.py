"""The sampling half of the OpenAI surface over real HTTP: logprobs (chat and the legacy
completions shape) against transformers' log_softmax, echo with prompt scores (what
lm-eval's loglikelihood sends), every prompt form of /v1/completions, ``n`` and
``best_of``, ``logit_bias``, and a table proving each request field is honoured or
refused by name."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import build_llm
from trae_groups.engine import EngineConfig
from trae_groups.serving.openai_api import ChatCompletionRequest, CompletionRequest
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

GRAPH = """
name: fields
models:
  llm: {{source: {root}/a, task: generate}}
  routed:
    task: generate
    versions: {{a: {root}/a, b: {root}/b}}
    route: {{a: 50, b: 50}}
    sticky: user
inputs: {{text: str, user: {{type: str, default: anonymous}}}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 3}}}}
  other: {{model: routed, prompt: "{{{{ inputs.text }}}}", params: {{max_tokens: 3}}}}
outputs: {{said: say.text, other: other.text}}
"""
EOS = 2  # the tiny tokenizer's "</s>" (conftest.build_tokenizer)
TOLERANCE = 1e-4  # float32 logits of a batched paged forward against an unbatched one
TOOLS = [{"type": "function", "function": {"name": "track", "parameters": {
    "type": "object", "properties": {"late": {"type": "boolean"}}, "required": ["late"],
    "additionalProperties": False}}}]  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root: Path = tmp_path_factory.mktemp("sampling")
    build_llm(root / "a", "llama")
    build_llm(root / "b", "llama", seed=5)
    (root / "fields.yaml").write_text(GRAPH.format(root=root))
    return root


@pytest.fixture(scope="module")
def server(root):
    config = ServerConfig(engine=EngineConfig(pool_bytes=16 << 20))
    with ServerThread(create_app([root / "fields.yaml"], config)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(root):
    """transformers' log_softmax at every position of a token list: [len, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(root / "a").eval()

    def logprobs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)

    return logprobs


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)


def ok(server, route: str, body: dict) -> dict:
    answer = post(server, route, body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed(server, route: str, body: dict) -> list[dict]:
    """The chunks of a streamed answer (its data lines before ``[DONE]``)."""
    with httpx.stream("POST", f"{server.url}/v1/{route}", json={**body, "stream": True},
                      timeout=60) as answer:  # fmt: skip
        assert answer.status_code == 200
        lines = answer.read().decode().splitlines()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def completion(**body) -> dict:
    return {"model": "llm", "prompt": "hello world", "max_tokens": 6, "ignore_eos": True,
            "user": "u0", **body}  # fmt: skip


def chat(**body) -> dict:
    messages = [{"role": "user", "content": "where is my order?"}]
    return {"model": "llm", "messages": messages, "max_tokens": 6, "ignore_eos": True,
            "user": "u0", **body}  # fmt: skip


# ---------------------------------------------------------------- logprobs and echo


def test_lm_evals_loglikelihood_request_scores_the_prompt_as_transformers(server, reference):
    """What lm-eval 0.4.13's local-completions sends for loglikelihood: token-id lists,
    max_tokens 1, logprobs 1, echo, temperature 0."""
    tokens = [5, 17, 42, 99, 230, 7, 64, 301, 12]
    body = {"model": "llm", "prompt": [tokens], "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}  # fmt: skip
    (choice,) = ok(server, "completions", body)["choices"]
    got = choice["logprobs"]
    assert len(got["tokens"]) == len(tokens) + 1  # the prompt, then the generated token
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    ref = reference(tokens)
    for i in range(1, len(tokens)):
        assert abs(got["token_logprobs"][i] - ref[i - 1, tokens[i]].item()) < TOLERANCE
        (top,) = got["top_logprobs"][i].values()
        assert abs(top - ref[i - 1].max().item()) < TOLERANCE
    generated = ref[-1].argmax().item()
    assert abs(got["token_logprobs"][-1] - ref[-1, generated].item()) < TOLERANCE
    assert choice["text"].startswith("".join(got["tokens"][:-1]))  # echo: the prompt first
    assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:i]) for i in range(10)]


def test_echo_with_max_tokens_zero_scores_only_the_prompt(server, reference):
    tokens = [9, 8, 70, 71, 300]
    body = {"model": "llm", "prompt": tokens, "max_tokens": 0, "logprobs": 0, "echo": True}
    answer = ok(server, "completions", body)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 0
    values = choice["logprobs"]["token_logprobs"]
    want = [None] + [reference(tokens)[i - 1, tokens[i]].item() for i in range(1, 5)]
    assert values[0] is None and values[1:] == pytest.approx(want[1:], abs=TOLERANCE)
    refused = post(server, "completions", {**body, "echo": False})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "max_tokens"


def test_echo_of_a_text_prompt_returns_it_first(server):
    plain = ok(server, "completions", completion())["choices"][0]["text"]
    echoed = ok(server, "completions", completion(echo=True))["choices"][0]
    assert echoed["text"] == "hello world" + plain and echoed["logprobs"] is None


def test_greedy_logprobs_are_transformers_log_softmax_of_each_chosen_token(server, reference, root):
    """Tolerance on the float, not on the argmax: each step's chosen token is transformers'
    argmax there, and its logprob is log_softmax of transformers' logits."""
    tokenizer = AutoTokenizer.from_pretrained(root / "a")
    tokens = [5, 17, 42, 99]
    got = ok(server, "completions", completion(prompt=tokens, logprobs=3))["choices"][0]
    for j, value in enumerate(got["logprobs"]["token_logprobs"]):
        ref = reference(tokens)[-1]
        chosen = int(ref.argmax())
        assert got["logprobs"]["tokens"][j] == tokenizer.decode([chosen])
        assert abs(value - ref[chosen].item()) < TOLERANCE
        # keyed by text, as OpenAI's legacy shape is: two tokens of one text keep one entry
        values, ids = ref.topk(3)
        want = {
            tokenizer.decode([i]): v for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        }
        top = got["logprobs"]["top_logprobs"][j]
        assert top.keys() == want.keys()
        assert [top[k] for k in want] == pytest.approx(list(want.values()), abs=TOLERANCE)
        tokens.append(chosen)


def test_streamed_logprobs_equal_the_whole_answer(server):
    """The same tokens and offsets; the values within float tolerance (a second run may
    read its prompt's KV from the prefix cache)."""
    whole = ok(server, "completions", completion(logprobs=2))["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in streamed(server, "completions",
              completion(logprobs=2)) if c["choices"] and c["choices"][0]["logprobs"]]  # fmt: skip
    joined = {key: [v for c in chunks for v in c[key]] for key in whole}
    assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=TOLERANCE)
    assert [list(t) for t in joined["top_logprobs"]] == [list(t) for t in whole["top_logprobs"]]
    chat_whole = ok(server, "chat/completions", chat(logprobs=True, top_logprobs=2))
    content = chat_whole["choices"][0]["logprobs"]["content"]
    assert len(content) == chat_whole["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode())
               for e in content)  # fmt: skip
    pieces = streamed(server, "chat/completions", chat(logprobs=True, top_logprobs=2))
    streamed_content = [e for c in pieces if c["choices"] and c["choices"][0]["logprobs"]
                        for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert [e["token"] for e in streamed_content] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed_content] == pytest.approx(
        [e["logprob"] for e in content], abs=TOLERANCE
    )


def test_top_logprobs_without_logprobs_is_refused_by_name(server):
    answer = post(server, "chat/completions", chat(top_logprobs=2))
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "top_logprobs"


# ---------------------------------------------------------------- prompts, n, best_of


def test_every_prompt_form_with_choices_indexed_prompt_major(server):
    def texts(prompt, **extra) -> list[str]:
        choices = ok(server, "completions", completion(prompt=prompt, **extra))["choices"]
        assert [c["index"] for c in choices] == list(range(len(choices)))
        return [c["text"] for c in choices]

    one, two = texts("hello world")[0], texts("the quick brown fox")[0]
    assert texts(["hello world", "the quick brown fox"]) == [one, two]
    ids = [[5, 17, 42], [7, 8, 9, 10]]
    first, second = texts(ids[0])[0], texts([ids[1]])[0]
    assert texts(ids) == [first, second]
    assert texts(ids, n=2) == [first, first, second, second]  # greedy: n equal choices


def test_n_shares_one_prefill_and_usage_counts_the_prompt_once(server):
    answer = ok(server, "completions", completion(n=3, temperature=1.5, seed=4))
    assert len(answer["choices"]) == 3
    single = ok(server, "completions", completion())
    assert answer["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == 3 * 6
    chunks = streamed(server, "chat/completions", chat(n=2))
    ends = {c["choices"][0]["index"] for c in chunks if c["choices"] and
            c["choices"][0]["finish_reason"]}  # fmt: skip
    assert ends == {0, 1}


def test_best_of_keeps_the_most_likely(server):
    body = completion(n=2, best_of=4, temperature=1.5, seed=9, logprobs=0)
    choices = ok(server, "completions", body)["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert len(choices) == 2 and scores == sorted(scores, reverse=True)
    every = ok(server, "completions", completion(n=4, temperature=1.5, seed=9, logprobs=0))
    best = sorted((sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]), reverse=True)
    assert scores == pytest.approx(best[:2], abs=1e-3)  # the same 4 seeded sequences, top 2
    for extra in ({"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}):
        refused = post(server, "completions", completion(**extra))
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "best_of"


# ---------------------------------------------------------------- every field


def text(answer: dict, i: int = 0) -> str:
    choice = answer["choices"][i]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def usage(answer: dict) -> int:
    return answer["usage"]["completion_tokens"]


Check = Callable[..., None]  # (server, route, make_body) -> None: asserts the field's effect


def effect(extra: dict, check: Callable[[dict, dict], bool]) -> Check:
    """The field changes the answer as ``check(answer, greedy baseline)`` says."""

    def run(server, route, make) -> None:
        answer, base = ok(server, route, make(**extra)), ok(server, route, make())
        assert check(answer, base), (extra, answer, base)

    return run


def refused(extra: dict, field: str) -> Check:
    def run(server, route, make) -> None:
        answer = post(server, route, make(**extra))
        assert answer.status_code == 422, (extra, answer.text)
        assert answer.json()["error"]["param"].split(".")[0] == field, answer.text

    return run


def sticky_user(server, route, make) -> None:
    """``user`` pins a version of a model that routes sticky: one user, one answer; over
    16 users both versions answer."""
    answers = {}
    for user in [f"user-{i}" for i in range(16)]:
        got = {text(ok(server, route, make(model="routed", user=user))) for _ in range(2)}
        assert len(got) == 1, user
        answers[user] = got.pop()
    assert len(set(answers.values())) == 2


def streams(server, route, make) -> None:
    chunks = streamed(server, route, make())
    assert "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get(
        "content") or "" for c in chunks if c["choices"]) == text(ok(server, route, make()))  # fmt: skip


def stream_usage(server, route, make) -> None:
    chunks = streamed(server, route, make(stream_options={"include_usage": True}))
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def deadline(server, route, make) -> None:
    answer = post(server, route, make(timeout=1e-6))
    assert answer.status_code in (503, 504) and "eadline" in answer.text, answer.text


def stopped(server, route, make) -> None:
    base = text(ok(server, route, make(max_tokens=12)))
    stop = base[1:3]
    assert len(stop) == 2, base  # the tiny model's greedy text has something to stop at
    cut = ok(server, route, make(max_tokens=12, stop=[stop]))
    assert cut["choices"][0]["finish_reason"] == "stop" and text(cut) == base[: base.index(stop)]


def penalised(server, route, make) -> None:
    """The penalty divides the prompt's tokens' logits: the first token's logprob (of the
    distribution sampled from) moves."""
    asked = {"logprobs": True} if route.startswith("chat") else {"logprobs": 0}

    def first(answer: dict) -> float:
        got = answer["choices"][0]["logprobs"]
        return got["content"][0]["logprob"] if "content" in got else got["token_logprobs"][0]

    plain = first(ok(server, route, make(**asked)))
    assert first(ok(server, route, make(repetition_penalty=9.0, **asked))) != plain


def seeded(server, route, make) -> None:
    first = text(ok(server, route, make(temperature=2.0, seed=3)))
    assert text(ok(server, route, make(temperature=2.0, seed=3))) == first
    assert text(ok(server, route, make(temperature=2.0, seed=4))) != first


HOT = {"temperature": 2.0, "seed": 3}
FORCE_EOS = {"logit_bias": {str(EOS): 100}}
SHARED: dict[str, list[Check]] = {
    "model": [effect({"model": "fields/llm"}, lambda a, b: a["model"] == "fields/llm")],
    "max_tokens": [effect({"max_tokens": 2}, lambda a, b: usage(a) == 2)],
    "temperature": [effect(HOT, lambda a, b: text(a) != text(b)),
                    refused({"temperature": 3}, "temperature")],
    "top_p": [effect({**HOT, "top_p": 1e-6}, lambda a, b: text(a) == text(b))],
    "top_k": [effect({**HOT, "top_k": 1}, lambda a, b: text(a) == text(b))],
    "min_p": [effect({**HOT, "min_p": 0.9999}, lambda a, b: text(a) == text(b))],
    "repetition_penalty": [penalised],
    "stop": [stopped],
    "seed": [seeded],
    "ignore_eos": [effect({**FORCE_EOS, "ignore_eos": False},
                          lambda a, b: usage(a) == 1 and a["choices"][0]["finish_reason"] == "stop"),
                   effect(FORCE_EOS, lambda a, b: usage(a) == 6)],
    "timeout": [deadline],
    # same tokens either way; that it stops proposals: test_speculative_config.py
    "speculative": [effect({"speculative": False}, lambda a, b: text(a) == text(b)),
                    refused({"speculative": 3}, "speculative")],
    "n": [effect({"n": 2}, lambda a, b: len(a["choices"]) == 2), refused({"n": 33}, "n")],
    "stream": [streams],
    "stream_options": [stream_usage,
                       refused({"stream_options": {"include_usage": True}}, "stream_options")],
    "presence_penalty": [refused({"presence_penalty": 0.5}, "presence_penalty")],
    "frequency_penalty": [refused({"frequency_penalty": 0.5}, "frequency_penalty")],
    "logit_bias": [effect(FORCE_EOS, lambda a, b: usage(a) == 6 and text(a) == ""),
                   refused({"logit_bias": {"x": 1}}, "logit_bias"),
                   refused({"logit_bias": {"5": 101}}, "logit_bias")],
    "user": [sticky_user],
    "response_format": [effect(
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "yn", "schema": {"enum": ["yes", "no"]}}}, "max_tokens": 12},
        lambda a, b: json.loads(text(a)) in ("yes", "no"))],
    "guided_json": [effect({"guided_json": {"type": "boolean"}, "max_tokens": 12},
                           lambda a, b: text(a) in ("true", "false"))],
    "guided_regex": [effect({"guided_regex": "[ab]{4}", "max_tokens": 12},
                            lambda a, b: re.fullmatch("[ab]{4}", text(a)) is not None)],
    "guided_choice": [effect({"guided_choice": ["left", "right"], "max_tokens": 12},
                             lambda a, b: text(a) in ("left", "right"))],
    "guided_grammar": [effect({"guided_grammar": 'start: "x" "y"', "max_tokens": 12},
                              lambda a, b: text(a) == "xy")],
}  # fmt: skip
COMPLETIONS: dict[str, list[Check]] = {
    **SHARED,
    "prompt": [effect({"prompt": ["hello world", "hello world"]},
                      lambda a, b: [text(a, 0), text(a, 1)] == [text(b)] * 2)],
    "echo": [effect({"echo": True}, lambda a, b: text(a) == "hello world" + text(b))],
    "logprobs": [effect({"logprobs": 2}, lambda a, b: len(a["choices"][0]["logprobs"]["tokens"])
                        == usage(a) and b["choices"][0]["logprobs"] is None),
                 refused({"logprobs": 6}, "logprobs")],
    "suffix": [refused({"suffix": "!"}, "suffix")],
    "best_of": [effect({"best_of": 3, **HOT}, lambda a, b: len(a["choices"]) == 1),
                refused({"best_of": 33}, "best_of")],
}  # fmt: skip
CHAT: dict[str, list[Check]] = {
    **SHARED,
    "messages": [effect({"messages": [{"role": "user", "content": "hello world, how are you"}]},
                        lambda a, b: a["usage"]["prompt_tokens"] != b["usage"]["prompt_tokens"]),
                 refused({"messages": []}, "messages")],
    "max_completion_tokens": [effect({"max_completion_tokens": 2}, lambda a, b: usage(a) == 2)],
    "logprobs": [effect({"logprobs": True}, lambda a, b: len(a["choices"][0]["logprobs"][
        "content"]) == usage(a) and b["choices"][0]["logprobs"] is None)],
    "top_logprobs": [effect({"logprobs": True, "top_logprobs": 3}, lambda a, b: all(
        len(e["top_logprobs"]) == 3 for e in a["choices"][0]["logprobs"]["content"])),
        refused({"top_logprobs": 3}, "top_logprobs")],
    "tools": [effect({"tools": TOOLS, "tool_choice": "required", "max_tokens": 200},
                     lambda a, b: a["choices"][0]["finish_reason"] == "tool_calls")],
    "tool_choice": [refused({"tool_choice": "required"}, "tool_choice")],
}  # fmt: skip
CASES = [("completions", CompletionRequest, COMPLETIONS), ("chat/completions",
         ChatCompletionRequest, CHAT)]  # fmt: skip


@pytest.mark.parametrize(("route", "model", "table"), CASES)
def test_the_table_covers_every_field_of_the_request_model(route, model, table):
    assert set(table) == set(model.model_fields), route


@pytest.mark.parametrize(
    ("route", "field", "check"),
    [(route, field, check) for route, _, table in CASES for field, checks in table.items()
     for check in checks],
)  # fmt: skip
def test_each_field_is_honoured_or_refused_by_name(server, route, field, check):
    check(server, route, chat if route.startswith("chat") else completion)
