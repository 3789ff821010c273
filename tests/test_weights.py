"""WeightStore: zero-copy loads, one instance per model, one copy per distinct tensor."""

from __future__ import annotations

import gc
import json
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
    CodeGenConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from trae_groups.engine.errors import ModelLoadError
from trae_groups.engine.weights import SharingPolicy, WeightStore, tensor_slots

transformers.logging.set_verbosity_error()

WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "for", "on", "with", "new", "york"]
WORDS += ["hello", "world", "paris", "london", "john"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?")


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
    return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})


def bert_config(**kwargs) -> BertConfig:
    base = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    return BertConfig(**{**base, **kwargs})


def save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    big = BertForSequenceClassification(
        bert_config(
            vocab_size=30000, hidden_size=256, intermediate_size=1024, num_attention_heads=4
        )
    )
    v1 = BertForSequenceClassification(bert_config())
    v2 = BertForSequenceClassification(bert_config())
    v2.bert.load_state_dict(v1.bert.state_dict())  # a new head on the same backbone
    tagger = BertForTokenClassification(bert_config(num_labels=5))
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )
    return {
        "big": save(big, root / "big"),
        "v1": save(v1, root / "v1"),
        "v2": save(v2, root / "v2"),
        "tagger": save(tagger, root / "tagger"),
        "base": save(BertModel(bert_config()), root / "base"),
        "llama": save(llama, root / "llama"),
    }


def rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def file_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def touch(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for _, _, _, t in tensor_slots(model):
            t.float().sum() if t.numel() < 1024 else t.sum()


def ptr(module: torch.nn.Module, name: str) -> int:
    return module.get_parameter(name).data_ptr()


class TestZeroCopy:
    def test_parameters_are_views_of_the_file_mapping(self, models):
        store = WeightStore()
        loaded = store.load(models["big"], "classify")
        ranges = file_ranges(models["big"] / "model.safetensors")
        assert ranges, "the safetensors file is not mapped"
        for name, p in loaded.model.named_parameters():
            assert any(lo <= p.data_ptr() < hi for lo, hi in ranges), name

    def test_load_adds_no_private_memory(self, models):
        gc.collect()
        size = (models["big"] / "model.safetensors").stat().st_size
        before = rss("RssAnon")
        store = WeightStore()
        store.load(models["big"], "classify")
        assert rss("RssAnon") - before < 0.1 * size

    def test_three_nodes_cost_one_model(self, models):
        touch(torch.nn.Linear(4, 4))
        gc.collect()
        store = WeightStore()
        before = rss()
        nodes = [store.load(models["big"], "classify") for _ in range(3)]
        for node in nodes:
            touch(node.model)
        grown = rss() - before
        (report,) = store.report()
        assert nodes[0] is nodes[1] is nodes[2]
        assert report.loads == 3
        assert grown <= 1.1 * report.bytes
        assert store.total_bytes() == report.bytes

    def test_isolated_policy_makes_private_copies(self, models):
        store = WeightStore(SharingPolicy(memory="isolated"))
        nodes = [store.load(models["big"], "classify") for _ in range(3)]
        ranges = file_ranges(models["big"] / "model.safetensors")
        assert len({id(n) for n in nodes}) == 3
        # Every parameter of every copy is its own memory, none of it the file mapping
        # (pointers, not RSS: the allocator may reuse memory earlier tests freed).
        for name, _ in nodes[0].model.named_parameters():
            pointers = {ptr(n.model, name) for n in nodes}
            assert len(pointers) == 3, name
            assert not any(lo <= p < hi for p in pointers for lo, hi in ranges), name
        assert all(r.shared_bytes == 0 and r.memory == "isolated" for r in store.report())
        del nodes
        store.unload(models["big"])


class TestSharing:
    def test_versions_share_every_identical_tensor(self, models):
        store = WeightStore()
        v1 = store.load(models["v1"], "classify").model
        v2 = store.load(models["v2"], "classify").model
        for name, p in v1.bert.named_parameters():
            assert p.data_ptr() == v2.bert.get_parameter(name).data_ptr(), name
        assert ptr(v1, "classifier.weight") != ptr(v2, "classifier.weight")
        r1, r2 = store.report()
        head = v2.classifier.weight.numel() * 4  # both biases are zeros: shared too
        assert r2.shared_bytes == r2.bytes - head
        assert store.total_bytes() == r1.bytes + head

    def test_same_folder_as_classifier_and_embedder(self, models):
        store = WeightStore()
        clf = store.load(models["v1"], "classify").model
        emb = store.load(models["v1"], "embed").model
        name = "embeddings.word_embeddings.weight"
        assert ptr(clf.bert, name) == ptr(emb, name)

    def test_tied_weights_stay_tied(self, models):
        store = WeightStore()
        lm = store.load(models["llama"], "generate", attn_implementation="eager").model
        assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
        assert lm.config._attn_implementation == "eager"

    def test_unload_keeps_tensors_others_use(self, models):
        store = WeightStore()
        store.load(models["v1"], "classify")
        v2 = store.load(models["v2"], "classify")
        assert store.unload(models["v1"]) == 1
        (report,) = store.report()
        assert report.shared_bytes == 0
        assert store.total_bytes() == report.bytes
        out = v2.model(input_ids=torch.tensor([[2, 5, 3]])).logits
        assert torch.isfinite(out).all()
        store.unload(models["v2"])
        assert store.report() == [] and store.total_bytes() == 0
        assert not store._held and not store._by_ptr


class TestOptions:
    def test_bfloat16(self, models):
        loaded = WeightStore().load(models["v1"], "classify", dtype=torch.bfloat16)
        assert loaded.model.classifier.weight.dtype == torch.bfloat16
        assert WeightStore().load(models["v1"], "classify").model is not loaded.model

    def test_int8_is_close_to_float(self, models):
        store = WeightStore()
        ref = store.load(models["v1"], "classify").model
        q = store.load(models["v1"], "classify", quantize="int8")
        assert type(q.model.classifier).__name__ == "Int8Linear"
        ids = torch.randint(5, 128, (8, 16))
        with torch.no_grad():
            a = torch.softmax(ref(input_ids=ids).logits, -1)
            b = torch.softmax(q.model(input_ids=ids).logits, -1)
        assert (a - b).abs().max() < 0.05
        by_task = {(r.quantize): r for r in store.report()}
        assert by_task["int8"].bytes < by_task[None].bytes

    def test_policy_is_validated_and_recorded(self, models):
        with pytest.raises(ValueError):
            SharingPolicy(memory="sometimes")
        store = WeightStore(SharingPolicy(gpu="dedicated"))
        store.load(models["v1"], "classify")
        assert store.report()[0].gpu == "dedicated"


class TestErrors:
    def test_missing_folder(self, tmp_path):
        with pytest.raises(ModelLoadError, match="no such model folder"):
            WeightStore().load(tmp_path / "nope", "classify")

    def test_missing_config(self, tmp_path):
        with pytest.raises(ModelLoadError, match=r"no config\.json"):
            WeightStore().load(tmp_path, "classify")

    def test_corrupt_config(self, tmp_path):
        (tmp_path / "config.json").write_text("{not json")
        with pytest.raises(ModelLoadError, match="config"):
            WeightStore().load(tmp_path, "classify")

    def test_corrupt_safetensors(self, models, tmp_path):
        folder = save(BertForSequenceClassification(bert_config()), tmp_path / "m")
        (folder / "model.safetensors").write_bytes(b"\x07garbage" * 100)
        with pytest.raises(ModelLoadError, match="corrupt safetensors"):
            WeightStore().load(folder, "classify")

    def test_no_weights(self, tmp_path):
        (tmp_path / "config.json").write_text(json.dumps(bert_config().to_dict()))
        with pytest.raises(ModelLoadError, match="no safetensors"):
            WeightStore().load(tmp_path, "classify")

    def test_generate_on_an_encoder(self, models):
        with pytest.raises(ModelLoadError, match="encoder"):
            WeightStore().load(models["v1"], "generate")

    def test_task_the_architecture_cannot_do(self, models, tmp_path):
        CodeGenConfig(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
        with pytest.raises(ModelLoadError, match="cannot do 'tag'"):
            WeightStore().load(tmp_path, "tag")  # codegen has no token-classification head
        with pytest.raises(ModelLoadError, match="not a 'tag' model"):
            WeightStore().load(models["v1"], "tag")  # saved as a sequence classifier
        with pytest.raises(ModelLoadError, match="not a 'classify' model"):
            WeightStore().load(models["llama"], "classify")

    def test_head_missing_from_checkpoint(self, models):
        with pytest.raises(ModelLoadError, match="not a 'classify' model"):
            WeightStore().load(models["base"], "classify")  # saved as BertModel
        config = json.loads((models["base"] / "config.json").read_text())
        del config["architectures"]  # nothing says what it is: the missing head does
        (models["base"] / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match="no weights for classifier"):
            WeightStore().load(models["base"], "classify")
        assert WeightStore().load(models["base"], "embed").task == "embed"

    def test_unknown_task_and_options(self, models):
        store = WeightStore()
        with pytest.raises(ModelLoadError, match="unknown task"):
            store.load(models["v1"], "summarize")
        with pytest.raises(ModelLoadError, match="int8"):
            store.load(models["v1"], "classify", quantize="int8", dtype=torch.bfloat16)
        with pytest.raises(ModelLoadError, match="unknown quantization"):
            store.load(models["v1"], "classify", quantize="int4")

    def test_tagger_loads(self, models):
        loaded = WeightStore().load(models["tagger"], "tag")
        assert loaded.task == "tag" and loaded.tokenizer.is_fast
        assert loaded.max_length == 64
