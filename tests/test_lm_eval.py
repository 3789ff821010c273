"""lm-eval's own client (``local-completions``, its default settings) against a served
tiny model scores a multiple-choice task exactly as lm-eval's ``hf`` model does on the
same folder: what ``loglikelihood`` sends (token ids, ``echo``, ``logprobs``) must come
back in OpenAI's shape with the model's own log-probabilities. No network: the task is
a local JSON file (``dataset_path: json``)."""

from __future__ import annotations

import json
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
    task = TASK.format(data=root / "data.jsonl", cache=root / "cache")
    (root / "tiny_choice.yaml").write_text(task)
    return root


def evaluate(task_dir: Path, model: str, model_args: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return simple_evaluate(
        model=model, model_args=model_args, tasks=["tiny_choice"], task_manager=manager,
        batch_size=1, log_samples=True, bootstrap_iters=0,
    )  # fmt: skip


def scores(results: dict) -> list[float]:
    """Every document's log-likelihood of each choice, in order."""
    samples = sorted(results["samples"]["tiny_choice"], key=lambda s: s["doc_id"])
    return [float(resp[0]) for s in samples for resp in s["filtered_resps"]]


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
