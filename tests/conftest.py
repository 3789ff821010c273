"""Tiny real models, built from transformers configs and saved to disk, loaded back
through the same code users use."""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

# fixtures shared across modules: the tracing tests', and one Ray cluster per session
pytest_plugins = ["tracing_fixtures", "ray_cluster"]

# The suite's engines decode eagerly: compile="auto" (the default) would spend seconds
# compiling each test's model. The environment reaches the engine processes `trae serve`
# starts too. Tests of compiling opt in with compile=True or by clearing it.
os.environ.setdefault("TRAE_COMPILE", "0")

CORPUS = [
    "hello world, how are you today?",
    "the quick brown fox jumps over the lazy dog",
    "I would like to book a flight to Paris next Monday.",
    "Order 1234 has not arrived; please refund me.",
    "Größe, café, naïve – ünïcödé text works too.",
    "Assistant: Sure, I can help with that. User: thanks!",
] * 4


def build_tokenizer(folder: Path, vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on a small corpus (no hub access needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return fast


def build_word_tokenizer(folder: Path):
    """A word-level tokenizer whose decoder is ``Fuse`` (tokens joined as they are): one
    llguidance cannot read from its own description. Its vocabulary is every printable
    ASCII character and the corpus's words, so any JSON can still be spelled."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for line in CORPUS for w in line.split() if w.isascii()})
    vocab = ["<pad>", "<s>", "</s>", "<unk>", *string.printable[:95], *words]
    vocab = list(dict.fromkeys(vocab))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")  # fmt: skip
    fast.save_pretrained(folder)
    return fast


LLM_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


def build_llm(
    folder: Path, family: str = "llama", seed: int = 0, tokenizer=build_tokenizer, **overrides
) -> Path:
    """A tiny random LLM of ``family`` saved to ``folder``, with the tokenizer that
    ``tokenizer(folder)`` builds and saves there."""
    import transformers

    config_name, model_name, extra = LLM_FAMILIES[family]
    tokenizer = tokenizer(folder)
    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # random init is near-uniform; sharpen so greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def llm_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llms")
    return {family: build_llm(root / family, family) for family in LLM_FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(llm_dirs) -> Path:
    return llm_dirs["llama"]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


ENCODER_WORDS = ["hello", "world", "order", "refund", "paris", "london", "john", "please",
                 "my", "the", "is", "where", "buy", "now", "cheap", "pills", "to", "ship", "a"]  # fmt: skip


def build_encoder(folder: Path, task: str, labels: list[str], seed: int = 0) -> Path:
    """A tiny BERT (classify / tag / embed / rerank) with a WordPiece vocabulary, saved to
    disk. A rerank model is a cross-encoder: sequence classification, one label per
    entry of ``labels`` (one label: the relevance logit)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertModel,
        BertTokenizerFast,
    )

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *ENCODER_WORDS, *chars]
    vocab += ["##" + c for c in chars]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # `vocab=`: transformers 5 ignores `vocab_file` and every word would be [UNK]
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
        id2label=dict(enumerate(labels)), label2id={lab: i for i, lab in enumerate(labels)},
    )  # fmt: skip
    torch.manual_seed(seed)
    cls = {"classify": BertForSequenceClassification, "tag": BertForTokenClassification,
           "embed": BertModel, "rerank": BertForSequenceClassification}[task]  # fmt: skip
    model = cls(config)
    if task == "rerank":  # random init scores every pair alike: sharpen so scores spread
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embeddings" not in name:
                    p.mul_(10.0)
    model.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def node_module(folder: Path, name: str, source: str):
    """A module of python-node functions, importable while the block runs (graphs name
    it as ``name:function``); yields the imported module."""
    (folder / f"{name}.py").write_text(source)
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)


# three LoRA adapters of different ranks, alphas and target modules (peft's own save_pretrained)
LORA_VARIANTS = {
    "short": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=8, lora_alpha=16, target_modules=["o_proj", "up_proj", "down_proj"]),
    "wide": dict(r=16, lora_alpha=8, use_rslora=True, target_modules="all-linear",
                 rank_pattern={"down_proj": 12}, alpha_pattern={"k_proj": 32}),
}  # fmt: skip


def build_lora(folder: Path, base: Path, seed: int = 0, **lora) -> Path:
    """A random-init PEFT LoRA adapter on the model at ``base``, saved by peft itself. Its
    B matrices are random too (peft starts them at zero), so it changes what is generated."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(init_lora_weights=False, **lora)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    wrapped.save_pretrained(folder)
    return folder


def lora_reference(base: Path, adapter: Path | None, prompt: list[int], max_new: int) -> list[int]:
    """peft's merged model (``merge_and_unload``) through transformers' greedy generate."""
    import peft
    from transformers import AutoModelForCausalLM

    key = (str(base), str(adapter))
    if key not in _LORA_REFS:
        model = AutoModelForCausalLM.from_pretrained(base)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
        _LORA_REFS[key] = model.eval()
    done = (*key, tuple(prompt), max_new)
    if done not in _LORA_OUTPUTS:  # several tests ask for the same rows
        with torch.no_grad():
            out = _LORA_REFS[key].generate(
                torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False
            )
        _LORA_OUTPUTS[done] = out[0, len(prompt) :].tolist()
    return _LORA_OUTPUTS[done]


_LORA_REFS: dict = {}
_LORA_OUTPUTS: dict = {}


@pytest.fixture(scope="module")
def interpreter():
    """One spawned worker with TRITON_INTERPRET=1, shared by every case of a test file: Triton
    picks compiled or interpreted once per process, when triton.language is first imported,
    which this process did long ago (see tests/test_triton_kernels.py)."""
    ctx = multiprocessing.get_context("spawn")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the worker at spawn, then restored
    pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)
    try:
        assert pool.submit(_worker_interpreted).result(timeout=120)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    yield pool
    pool.shutdown(cancel_futures=True)


def _worker_interpreted() -> bool:
    torch.set_num_threads(1)
    from trae_groups.kernels import triton_attention

    return triton_attention.INTERPRETED and triton_attention.available("cpu")


def wait_until(condition, what: str, seconds: float = 30.0, interval: float = 0.01) -> None:
    """Poll a condition a bounded number of times (``seconds / interval``), else fail."""
    for _ in range(max(1, int(seconds / interval))):
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"gave up waiting for {what}")


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """A whole SSE body as (event, data) pairs."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events
