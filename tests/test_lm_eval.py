"""lm-eval's own clients against a served tiny model, its ``hf`` model on the same
folder as the oracle. ``local-completions`` (its default settings) scores a
multiple-choice task: what ``loglikelihood`` sends (token ids, ``echo``, ``logprobs``)
must come back in OpenAI's shape with the model's own log-probabilities.
``local-chat-completions`` generates for a ``generate_until`` task. No network: the
tasks read a local JSON file (``dataset_path: json``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trae_groups.engine import EngineConfig
from trae_groups.serving.server import ServerConfig, ServerThread, create_app

lm_eval = pytest.importorskip("lm_eval")

GRAPH = """
name: evaluated
models:
  llm: {{source: {folder}, task: generate}}
inputs: {{text: str}}
nodes:
  say: {{model: llm, prompt: "{{{{ inputs.text }}}}"}}
outputs: {{said: say.text}}
"""
TASK = """
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
CHAT_TASK = """
task: tiny_reply
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
QUESTIONS = [
    ("hello world, how are", ["you", "the fox", "Paris", "refund"], 0),
    ("the quick brown fox jumps over the", ["lazy dog", "order", "café", "Monday"], 0),
    ("I would like to book a flight to", ["Paris", "the dog", "1234", "thanks"], 0),
    ("Order 1234 has not arrived; please", ["refund me", "jump", "hello", "naïve"], 0),
    ("Assistant: Sure, I can help with that. User:", ["thanks!", "fox", "today", "Größe"], 0),
    ("the lazy dog", ["jumps", "books a flight", "is unicode", "arrived"], 1),
    ("next Monday", ["please", "the quick", "Paris.", "how are you"], 2),
    ("Größe, café,", ["naïve", "order", "dog", "world"], 0),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    root: Path = tmp_path_factory.mktemp("lm_eval_task")
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, task in (("tiny_choice", TASK), ("tiny_reply", CHAT_TASK)):
        (root / f"{name}.yaml").write_text(
            task.format(data=root / "data.jsonl", cache=root / "cache")
        )
    return root


def evaluate(task_dir: Path, model: str, model_args: dict, task="tiny_choice", **how) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return simple_evaluate(
        model=model, model_args=model_args, tasks=[task], task_manager=manager,
        batch_size=1, log_samples=True, bootstrap_iters=0, **how,
    )  # fmt: skip


def scores(results: dict) -> list[float]:
    """Every document's log-likelihood of each choice, in order."""
    samples = sorted(results["samples"]["tiny_choice"], key=lambda s: s["doc_id"])
    return [float(resp[0]) for s in samples for resp in s["filtered_resps"]]


def replies_of(results: dict) -> list[str]:
    samples = sorted(results["samples"]["tiny_reply"], key=lambda s: s["doc_id"])
    return [s["filtered_resps"][0] for s in samples]


def test_local_completions_scores_as_lm_evals_hf_model(tmp_path, task_dir, llama_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "g.yaml").write_text(GRAPH.format(folder=llama_dir))
    config = ServerConfig(engine=EngineConfig(pool_bytes=8 << 20))
    with ServerThread(create_app([tmp_path / "g.yaml"], config)) as server:
        served = evaluate(task_dir, "local-completions", {
            "model": "llm", "base_url": f"{server.url}/v1/completions",
            "tokenizer": str(llama_dir), "tokenizer_backend": "huggingface", "max_retries": 1,
        })  # fmt: skip
    local = evaluate(task_dir, "hf", {"pretrained": str(llama_dir), "dtype": "float32",
                                      "device": "cpu"})  # fmt: skip
    assert scores(served) == pytest.approx(scores(local), abs=1e-3)
    accuracy = served["results"]["tiny_choice"]["acc,none"]
    assert accuracy == local["results"]["tiny_choice"]["acc,none"]


def test_local_chat_completions_generates_as_lm_evals_hf_model(
    tmp_path, task_dir, llama_dir, monkeypatch
):
    """A generate_until task through lm-eval's chat client (its chat template applied by
    the server) and through its hf model (the same template applied by lm-eval): the same
    greedy replies."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "templated"
    shutil.copytree(llama_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "chat_template": TEMPLATE}))  # fmt: skip
    (tmp_path / "g.yaml").write_text(GRAPH.format(folder=folder))
    config = ServerConfig(engine=EngineConfig(pool_bytes=8 << 20))
    with ServerThread(create_app([tmp_path / "g.yaml"], config)) as server:
        served = evaluate(task_dir, "local-chat-completions", {
            "model": "llm", "base_url": f"{server.url}/v1/chat/completions", "max_retries": 1,
        }, task="tiny_reply", apply_chat_template=True)  # fmt: skip
    local = evaluate(task_dir, "hf", {"pretrained": str(folder), "dtype": "float32",
                     "device": "cpu"}, task="tiny_reply", apply_chat_template=True)  # fmt: skip
    replies = [replies_of(r) for r in (served, local)]
    assert replies[0] == replies[1] and any(replies[0])
