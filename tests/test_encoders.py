"""Encoder runner and worker against transformers' own models and pipelines."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertTokenizer,
    RobertaConfig,
    RobertaForSequenceClassification,
    pipeline,
)

from trae_groups.engine.batcher import BatcherConfig
from trae_groups.engine.encoder_runner import EncoderRunner
from trae_groups.engine.encoder_worker import EncoderWorker
from trae_groups.engine.errors import EngineStopped, RequestAborted, RequestError
from trae_groups.engine.loop import EngineLoop
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.ner import aggregate
from trae_groups.engine.protocol import EncodeOptions
from trae_groups.engine.weights import WeightStore

transformers.logging.set_verbosity_error()

WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "for", "on", "with", "new", "york"]
WORDS += ["hello", "world", "paris", "london", "john"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?éü")
TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
INTENTS = ["greet", "ask", "spam"]
TEXTS = [
    "hello world",
    "john lives in new york",
    "paris and london are cities of the world",
    "is it raining in paris ?",
    "zoé visited münchen with john",
    "a",
    "the quick brown fox jumps over the lazy dog near london",
    "new york new york",
]


def tokenizer() -> BertTokenizer:
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *WORDS,
        *CHARS,
        *("##" + c for c in CHARS),
    ]
    return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, strip_accents=False)


def config(labels: list[str]) -> BertConfig:
    return BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )


def save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    torch.manual_seed(1)
    clf = BertForSequenceClassification(config(INTENTS))
    tag = BertForTokenClassification(config(TAGS))
    # two heads fine-tuned on one frozen backbone
    shared_clf = BertForSequenceClassification(config(INTENTS))
    shared_tag = BertForTokenClassification(config(TAGS))
    shared_tag.bert.load_state_dict(shared_clf.bert.state_dict(), strict=False)
    return {
        "clf": save(clf, root / "clf"),
        "tag": save(tag, root / "tag"),
        "shared_clf": save(shared_clf, root / "shared_clf"),
        "shared_tag": save(shared_tag, root / "shared_tag"),
        "embed": save(BertModel(config(INTENTS)), root / "embed"),
    }


@pytest.fixture(scope="module")
def store() -> WeightStore:
    return WeightStore()


def reference_tokens(folder: Path, text: str) -> tuple[list[str], list[float], dict]:
    """Per-token labels and scores straight from transformers' model."""
    model = BertForTokenClassification.from_pretrained(folder).eval()
    tok = tokenizer()
    enc = tok(text, return_tensors="pt", return_offsets_mapping=True)
    offsets = enc.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        probs = torch.softmax(model(**enc).logits[0], -1)
    best, index = probs.max(-1)
    labels = [model.config.id2label[i] for i in index.tolist()]
    return labels, best.tolist(), {"offsets": offsets, "word_ids": enc.word_ids()}


class TestRunnerParity:
    def test_classify_matches_pipeline_at_batch_1(self, folders, store):
        runner = EncoderRunner(store.load(folders["clf"], "classify"))
        model = BertForSequenceClassification.from_pretrained(folders["clf"])
        pipe = pipeline("text-classification", model=model, tokenizer=tokenizer(), top_k=None)
        for text in TEXTS:
            (ours,) = runner.run([text])
            theirs = pipe([text])[0]
            assert ours["label"] == theirs[0]["label"]
            assert ours["score"] == pytest.approx(theirs[0]["score"], abs=1e-5)
            for entry in theirs:
                assert ours["scores"][entry["label"]] == pytest.approx(entry["score"], abs=1e-5)
            assert ours["truncated"] is False

    def test_classify_batch_with_padding_matches_batch_1(self, folders, store):
        runner = EncoderRunner(store.load(folders["clf"], "classify"))
        batched = runner.run(TEXTS)
        for text, result in zip(TEXTS, batched, strict=True):
            (alone,) = runner.run([text])
            assert result["label"] == alone["label"]
            assert result["score"] == pytest.approx(alone["score"], abs=1e-5)

    def test_tag_matches_transformers(self, folders, store):
        runner = EncoderRunner(store.load(folders["tag"], "tag"))
        model = BertForTokenClassification.from_pretrained(folders["tag"])
        pipe = pipeline("token-classification", model=model, tokenizer=tokenizer())
        batched = runner.run(TEXTS)
        for text, result in zip(TEXTS, batched, strict=True):
            labels, scores, enc = reference_tokens(folders["tag"], text)
            for token in pipe(text):  # transformers' own per-token view agrees
                assert token["entity"] == labels[token["index"]]
                assert token["score"] == pytest.approx(scores[token["index"]], abs=1e-5)
            expected = aggregate(labels, scores, enc["offsets"], text, enc["word_ids"])
            assert [(s["entity"], s["start"], s["end"]) for s in result["spans"]] == [
                (s.entity, s.start, s.end) for s in expected
            ]
            for ours, ref in zip(result["spans"], expected, strict=True):
                assert ours["score"] == pytest.approx(ref.score, abs=1e-5)
                assert ours["text"] == text[ours["start"] : ours["end"]]
        assert any(r["spans"] for r in batched)

    def test_embed_mean_cls_and_normalize(self, folders, store):
        runner = EncoderRunner(store.load(folders["embed"], "embed"))
        model = BertModel.from_pretrained(folders["embed"]).eval()
        enc = tokenizer()("hello world", return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state[0]
        (mean,) = runner.run(["hello world"])
        (cls,) = runner.run(["hello world"], pooling="cls")
        (unit,) = runner.run(["hello world"], normalize=True)
        assert mean["dim"] == 32
        assert torch.allclose(torch.tensor(mean["vector"]), hidden.mean(0), atol=1e-5)
        assert torch.allclose(torch.tensor(cls["vector"]), hidden[0], atol=1e-5)
        assert torch.tensor(unit["vector"]).norm().item() == pytest.approx(1.0, abs=1e-5)
        padded = runner.run(["hello world", TEXTS[6]])[0]
        assert torch.allclose(torch.tensor(padded["vector"]), hidden.mean(0), atol=1e-5)


class TestBadInput:
    def test_too_long_text_is_truncated_and_flagged(self, folders, store):
        for task in ("classify", "tag"):
            runner = EncoderRunner(
                store.load(folders["clf" if task == "classify" else "tag"], task)
            )
            long_text = " ".join(["hello world"] * 100)
            results = runner.run([long_text, "hello"])
            assert results[0]["truncated"] is True
            assert results[1]["truncated"] is False
        spans = results[0]["spans"]
        assert all(s["end"] <= len(long_text) for s in spans)

    def test_a_long_text_is_cut_before_tokenizing_with_the_same_results(
        self, folders, store, monkeypatch
    ):
        """encoder_runner._cut: a text far past the truncation is tokenized from its
        beginning only, and every result (labels, scores, spans, truncated) is the one the
        whole text gives."""
        from trae_groups.engine import chat

        long_text = " ".join(["hello world, my order is where?"] * 2000)  # 64k characters
        for task in ("classify", "tag"):
            loaded = store.load(folders["clf" if task == "classify" else "tag"], task)
            runner = EncoderRunner(loaded)
            read: list[int] = []
            real = loaded.tokenizer.__class__.__call__

            def spy(tok, text, *args, _real=real, _read=read, **kwargs):
                _read.extend(len(t) for t in (text if isinstance(text, list) else [text]))
                return _real(tok, text, *args, **kwargs)

            monkeypatch.setattr(loaded.tokenizer.__class__, "__call__", spy)
            cut = runner.run([long_text, "hello"])
            assert max(read) < len(long_text) // 10  # only a prefix was read
            monkeypatch.setattr(chat, "PROBE_CHARS_PER_TOKEN", 10**9)  # never cut
            whole = runner.run([long_text, "hello"])
            monkeypatch.undo()
            assert cut == whole and cut[0]["truncated"] is True

    def test_roberta_position_offset_is_respected(self, store, tmp_path):
        cfg = RobertaConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=34,
            pad_token_id=1,
            num_labels=2,
        )
        loaded = store.load(save(RobertaForSequenceClassification(cfg), tmp_path), "classify")
        assert loaded.max_length == 32  # positions 0..1 are taken by padding
        (result,) = EncoderRunner(loaded).run([" ".join(["hello"] * 200)])
        assert result["truncated"] is True

    @pytest.mark.parametrize("text", ["", "   ", None])
    def test_empty_text(self, folders, store, text):
        runner = EncoderRunner(store.load(folders["clf"], "classify"))
        with pytest.raises(RequestError) as err:
            runner.run([text])
        assert err.value.field == "text"
        worker = EncoderWorker("clf", runner.heads["clf"])
        with pytest.raises(RequestError):
            worker.submit(text)

    def test_bad_options_and_heads(self, folders, store):
        worker = EncoderWorker("e", store.load(folders["embed"], "embed"))
        with pytest.raises(RequestError) as err:
            worker.submit("hi", options=EncodeOptions(pooling="max"))
        assert err.value.field == "pooling"
        with pytest.raises(RequestError) as err:
            worker.submit("hi", options=EncodeOptions(normalize="yes"))
        assert err.value.field == "normalize"
        with pytest.raises(RequestError) as err:
            worker.submit("hi", head="nope")
        assert err.value.field == "head"


def serve(name: str, loaded, **kwargs) -> tuple[EngineLoop, EncoderWorker]:
    loop = EngineLoop(name="test-encoders")
    worker = EncoderWorker(name, loaded, wake=loop.wake, **kwargs)
    loop.add_worker(worker)
    loop.start()
    return loop, worker


def concurrent_submit(worker: EncoderWorker, texts: list[str], **kwargs) -> list:
    barrier = threading.Barrier(len(texts))
    futures: list[Future | None] = [None] * len(texts)

    def send(i: int) -> None:
        barrier.wait()
        futures[i] = worker.submit(texts[i], request_id=f"r{i}", **kwargs)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [f.result(timeout=60) for f in futures]


class TestWorker:
    def test_64_concurrent_submitters_get_their_own_results(self, folders, store):
        loaded = store.load(folders["clf"], "classify")
        pool = MemoryPool(num_pages=256, page_bytes=64 * 1024)
        config = BatcherConfig(max_batch_size=16, timeout_ms=20)
        loop, worker = serve("clf", loaded, batcher=config, pool=pool)
        try:
            texts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(64)]
            results = concurrent_submit(worker, texts)
        finally:
            loop.stop()
        alone = EncoderRunner(loaded).run(texts)
        for got, ref in zip(results, alone, strict=True):
            assert got["label"] == ref["label"]
            assert got["score"] == pytest.approx(ref["score"], abs=1e-5)
        stats = worker.stats()
        assert stats["items"] == 64 and stats["queue"] == 0
        assert max(stats["batch_sizes"]) > 1
        assert stats["peak_pages"] > 0  # batches held pool pages while they ran ...
        assert pool.stats().used_pages == 0  # ... and gave every one back

    def test_tagger_under_concurrency(self, folders, store):
        loaded = store.load(folders["tag"], "tag")
        loop, worker = serve("ner", loaded, batcher=BatcherConfig(timeout_ms=20))
        try:
            texts = TEXTS * 4
            results = concurrent_submit(worker, texts)
        finally:
            loop.stop()
        refs = dict(zip(TEXTS, EncoderRunner(loaded).run(TEXTS), strict=True))
        for text, got in zip(texts, results, strict=True):
            ref = refs[text]
            assert [s["text"] for s in got["spans"]] == [s["text"] for s in ref["spans"]]
            for a, b in zip(got["spans"], ref["spans"], strict=True):
                assert a["score"] == pytest.approx(b["score"], abs=1e-5)
        assert max(worker.stats()["batch_sizes"]) > 1

    def test_small_pool_shrinks_batches_never_fails(self, folders, store):
        loaded = store.load(folders["clf"], "classify")
        worker = EncoderWorker("clf", loaded, batcher=BatcherConfig(preferred_batch_size=16))
        worker.pool = MemoryPool(num_pages=4, page_bytes=4096)
        futures = [worker.submit(f"{TEXTS[2]} {i}") for i in range(16)]
        while not all(f.done() for f in futures):
            worker.step()
        assert all(f.result()["label"] in INTENTS for f in futures)
        assert worker.stats()["pool_shrinks"] > 0
        assert max(worker.stats()["batch_sizes"]) < 16
        assert worker.pool.stats().used_pages == 0

    def test_full_pool_defers_then_runs(self, folders, store):
        loaded = store.load(folders["clf"], "classify")
        pool = MemoryPool(num_pages=8, page_bytes=4096)
        worker = EncoderWorker("clf", loaded, batcher=BatcherConfig(timeout_ms=0), pool=pool)
        held = pool.allocate("llm", 8)
        future = worker.submit("hello world")
        worker.step()
        assert not future.done() and worker.stats()["queue"] == 1
        assert worker.urgency(time.monotonic()) is None  # backing off
        pool.release(held)
        time.sleep(0.01)
        worker.step()
        assert future.result(timeout=5)["label"] in INTENTS
        assert pool.stats().used_pages == 0

    def test_urgency_gathers_then_fires(self, folders, store):
        worker = EncoderWorker(
            "clf",
            store.load(folders["clf"], "classify"),
            batcher=BatcherConfig(preferred_batch_size=4, timeout_ms=50),
        )
        now = time.monotonic()
        assert worker.urgency(now) is None and worker.next_wakeup(now) is None
        worker.submit("hello")
        item = next(iter(worker.batcher))
        assert worker.urgency(item.queued_at) is None  # gathering
        assert worker.next_wakeup(now) == pytest.approx(item.queued_at + 0.05)
        late = worker.urgency(item.queued_at + 0.05)
        assert late is not None and late.overdue
        for _ in range(3):
            worker.submit("hello")
        full = worker.urgency(item.queued_at)
        assert full is not None and not full.overdue

    def test_abort_close_and_cancel(self, folders, store):
        worker = EncoderWorker("clf", store.load(folders["clf"], "classify"))
        keep = worker.submit("hello", request_id="a")
        gone = [worker.submit("world", request_id="b") for _ in range(3)]
        cancelled = worker.submit("paris", request_id="c")
        assert cancelled.cancel()
        worker.abort("b")
        for f in gone:
            with pytest.raises(RequestAborted):
                f.result(timeout=1)
        worker.step()
        assert keep.result(timeout=5)["label"] in INTENTS
        assert worker.stats()["items"] == 1
        pending = worker.submit("hello")
        worker.close()
        with pytest.raises(EngineStopped):
            pending.result(timeout=1)
        with pytest.raises(EngineStopped):
            worker.submit("hello")

    def test_an_item_error_fails_only_that_item(self, folders, store):
        worker = EncoderWorker("clf", store.load(folders["clf"], "classify"))
        real = worker.runner.result

        def result(head, output, encoded, row, options):
            if encoded.texts[row] == "boom":
                raise RuntimeError("bad item")
            return real(head, output, encoded, row, options)

        worker.runner.result = result
        good, bad = worker.submit("hello"), worker.submit("boom")
        worker.step()
        assert good.result(timeout=5)["label"] in INTENTS
        with pytest.raises(RuntimeError, match="bad item"):
            bad.result(timeout=5)

    def test_a_text_that_breaks_tokenizing_fails_only_itself(self, folders, store):
        worker = EncoderWorker("clf", store.load(folders["clf"], "classify"))
        real = worker.runner.encode

        def encode(texts):
            if "boom" in texts:
                raise ValueError("cannot tokenize")
            return real(texts)

        worker.runner.encode = encode
        good, bad = worker.submit("hello"), worker.submit("boom")
        worker.step()
        assert good.result(timeout=5)["label"] in INTENTS
        with pytest.raises(ValueError, match="cannot tokenize"):
            bad.result(timeout=5)
        assert worker.stats()["queue"] == 0


class TestSharedBackbone:
    def heads(self, folders, store):
        return {
            "intent": store.load(folders["shared_clf"], "classify"),
            "ner": store.load(folders["shared_tag"], "tag"),
        }

    def test_backbone_runs_once_for_both_heads(self, folders, store):
        heads = self.heads(folders, store)
        worker = EncoderWorker("nlu", heads, batcher=BatcherConfig(preferred_batch_size=1))
        calls = []
        backbone = worker.runner.primary.model.base_model
        hook = backbone.register_forward_hook(lambda *a: calls.append(1))
        try:
            texts = TEXTS[:4]
            intents = [worker.submit(t, head="intent") for t in texts]
            tags = [worker.submit(t, head="ner") for t in texts]
            both = worker.submit(TEXTS[1], head=("intent", "ner"))
            worker.step()
        finally:
            hook.remove()
        assert calls == [1]
        alone_clf = EncoderRunner(heads["intent"]).run(texts)
        alone_tag = EncoderRunner(heads["ner"]).run(texts)
        for f, ref in zip(intents, alone_clf, strict=True):
            assert f.result()["label"] == ref["label"]
            assert f.result()["score"] == pytest.approx(ref["score"], abs=1e-5)
        for f, ref in zip(tags, alone_tag, strict=True):
            assert [s["start"] for s in f.result()["spans"]] == [s["start"] for s in ref["spans"]]
        result = both.result()
        assert set(result) == {"intent", "ner"}
        assert result["intent"]["label"] == alone_clf[1]["label"]

    def test_heads_on_different_backbones_are_refused(self, folders, store):
        with pytest.raises(ValueError, match="does not share the backbone"):
            EncoderRunner(
                {
                    "intent": store.load(folders["clf"], "classify"),
                    "ner": store.load(folders["tag"], "tag"),
                }
            )
