"""The detokenizer's decode (engine/detokenizer.py): the Rust tokenizer's own where that is the
text transformers' ``decode`` gives, transformers' where it would not be."""

from __future__ import annotations

import random

import pytest

from conftest import build_tokenizer, build_word_tokenizer
from trae_groups.engine.detokenizer import text_decoder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("skip", [False, True])
def test_the_direct_decode_gives_transformers_text(bpe, skip, monkeypatch):
    rng = random.Random(0)  # special tokens (0-2) and byte pieces among them
    cases = [[rng.randrange(len(bpe)) for _ in range(rng.randrange(0, 12))] for _ in range(200)]
    want = [bpe.decode(ids, skip_special_tokens=skip) for ids in cases]
    decode = text_decoder(bpe)
    monkeypatch.setattr(bpe, "decode", lambda *a, **k: pytest.fail("transformers' decode ran"))
    assert [decode(ids, skip) for ids in cases] == want


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tmp_path, monkeypatch):
    words = build_word_tokenizer(tmp_path)
    words.clean_up_tokenization_spaces = True  # not BPE: transformers cleans up
    ids = words.encode("hello , world .", add_special_tokens=False)
    want = words.decode(ids, skip_special_tokens=True)
    calls = []
    original = words.decode
    monkeypatch.setattr(words, "decode", lambda *a, **k: calls.append(a) or original(*a, **k))
    assert text_decoder(words)(ids, True) == want and calls
