"""NER aggregation on crafted label sequences, plus offsets from a real tokenizer."""

from __future__ import annotations

import pytest
from transformers import BertTokenizer

from trae_groups.engine.ner import aggregate, split_label, word_groups

CLS, SEP = (0, 0), (0, 0)


def tokens_of(text: str, words: list[str]) -> list[tuple[int, int]]:
    """Character offsets of each listed piece, found left to right in ``text``."""
    offsets, at = [], 0
    for w in words:
        start = text.index(w, at)
        offsets.append((start, start + len(w)))
        at = start + len(w)
    return offsets


def spans(labels, text, pieces, scores=None, word_ids=None):
    offsets = tokens_of(text, pieces)
    scores = scores or [0.5] * len(labels)
    return [
        (s.entity, s.text, s.start, s.end)
        for s in aggregate(labels, scores, offsets, text, word_ids)
    ]


class TestSplitLabel:
    @pytest.mark.parametrize(
        "label, expected",
        [
            ("O", ("O", None)),
            ("B-PER", ("B", "PER")),
            ("I-PER", ("I", "PER")),
            ("S-LOC", ("B", "LOC")),
            ("U-LOC", ("B", "LOC")),
            ("E-LOC", ("I", "LOC")),
            ("L-LOC", ("I", "LOC")),
            ("b-per", ("B", "per")),
            ("PER", ("I", "PER")),
            ("B-", ("I", "B-")),
            ("MISC-X", ("I", "MISC-X")),
        ],
    )
    def test_prefixes(self, label, expected):
        assert split_label(label) == expected


class TestAggregate:
    def test_multi_token_entity_and_single(self):
        text = "John Smith lives in Paris"
        labels = ["B-PER", "I-PER", "O", "O", "B-LOC"]
        assert spans(labels, text, text.split()) == [
            ("PER", "John Smith", 0, 10),
            ("LOC", "Paris", 20, 25),
        ]

    def test_adjacent_entities_b_after_b(self):
        text = "Alice Bob met"
        assert spans(["B-PER", "B-PER", "O"], text, text.split()) == [
            ("PER", "Alice", 0, 5),
            ("PER", "Bob", 6, 9),
        ]

    def test_type_change_splits(self):
        text = "Paris Hilton"
        assert spans(["B-LOC", "I-PER"], text, text.split()) == [
            ("LOC", "Paris", 0, 5),
            ("PER", "Hilton", 6, 12),
        ]

    def test_inside_without_begin_starts_entity(self):
        text = "in New York"
        assert spans(["O", "I-LOC", "I-LOC"], text, text.split()) == [("LOC", "New York", 3, 11)]

    def test_plain_labels_merge_consecutive_words(self):
        text = "New York and Rome"
        labels = ["LOC", "LOC", "O", "LOC"]
        assert spans(labels, text, text.split()) == [
            ("LOC", "New York", 0, 8),
            ("LOC", "Rome", 13, 17),
        ]

    def test_bioes(self):
        text = "Ann went to Los Angeles"
        labels = ["S-PER", "O", "O", "B-LOC", "E-LOC"]
        assert spans(labels, text, text.split()) == [
            ("PER", "Ann", 0, 3),
            ("LOC", "Los Angeles", 12, 23),
        ]

    def test_entities_at_string_start_and_end(self):
        text = "Berlin to Oslo"
        assert spans(["B-LOC", "O", "B-LOC"], text, text.split()) == [
            ("LOC", "Berlin", 0, 6),
            ("LOC", "Oslo", 10, 14),
        ]

    def test_all_outside_and_empty(self):
        assert spans(["O", "O"], "a b", ["a", "b"]) == []
        assert aggregate([], [], [], "") == []

    def test_subword_pieces_join_their_word(self):
        text = "Washington visited"
        pieces = ["Wash", "ing", "ton", "visited"]
        word_ids = [0, 0, 0, 1]
        labels = ["B-LOC", "O", "I-PER", "O"]  # continuation labels are ignored
        assert spans(labels, text, pieces, word_ids=word_ids) == [("LOC", "Washington", 0, 10)]

    def test_word_that_starts_outside_stays_outside(self):
        text = "unknown Rome"
        pieces = ["un", "known", "Rome"]
        labels = ["O", "B-PER", "B-LOC"]
        assert spans(labels, text, pieces, word_ids=[0, 0, 1]) == [("LOC", "Rome", 8, 12)]

    def test_subwords_of_a_multi_word_entity(self):
        text = "Kuala Lumpur"
        pieces = ["Ku", "ala", "Lum", "pur"]
        labels = ["B-LOC", "I-LOC", "I-LOC", "O"]
        assert spans(labels, text, pieces, word_ids=[0, 0, 1, 1]) == [
            ("LOC", "Kuala Lumpur", 0, 12)
        ]

    def test_special_tokens_are_skipped(self):
        text = "Rome"
        offsets = [CLS, (0, 4), SEP]
        labels = ["B-LOC", "B-LOC", "B-PER"]
        result = aggregate(labels, [0.1, 0.9, 0.1], offsets, text, [None, 0, None])
        assert [(s.entity, s.text) for s in result] == [("LOC", "Rome")]
        no_word_ids = aggregate(labels, [0.1, 0.9, 0.1], offsets, text)
        assert [(s.entity, s.text) for s in no_word_ids] == [("LOC", "Rome")]

    def test_score_is_mean_of_all_tokens(self):
        text = "Wash ington Rome"
        offsets = tokens_of(text, ["Wash", "ington", "Rome"])
        result = aggregate(["B-LOC", "I-LOC", "O"], [0.9, 0.6, 0.99], offsets, text, [0, 0, 1])
        assert result[0].score == pytest.approx(0.75)
        piece = aggregate(
            ["B-LOC", "O"], [0.8, 0.4], tokens_of("Romeo", ["Ro", "meo"]), "Romeo", [0, 0]
        )
        assert piece[0].score == pytest.approx(0.6)

    def test_non_ascii_offsets(self):
        text = "Zoë Müller flog nach 東京."
        pieces = ["Zoë", "Müller", "flog", "nach", "東", "京", "."]
        labels = ["B-PER", "I-PER", "O", "O", "B-LOC", "I-LOC", "O"]
        got = spans(labels, text, pieces, word_ids=[0, 1, 2, 3, 4, 5, 6])
        assert got == [("PER", "Zoë Müller", 0, 10), ("LOC", "東京", 21, 23)]

    def test_as_dict(self):
        (span,) = aggregate(["B-X"], [1.0], [(0, 1)], "a")
        assert span.as_dict() == {"entity": "X", "text": "a", "start": 0, "end": 1, "score": 1.0}


def test_word_groups():
    offsets = [(0, 0), (0, 2), (2, 4), (5, 6), (0, 0)]
    assert word_groups(offsets, [None, 0, 0, 1, None]) == [[1, 2], [3]]
    assert word_groups(offsets) == [[1], [2], [3]]


def test_offsets_from_a_real_fast_tokenizer():
    chars = list("abcdefghijklmnopqrstuvwxyzäöüßé東京.")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars)]
    tok = BertTokenizer(
        vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True, strip_accents=False
    )
    assert tok.is_fast
    text = "Jürgen besuchte Köln und 東京."
    enc = tok(text, return_offsets_mapping=True)
    word_ids = enc.word_ids()
    # label every piece of word 0 and of the words of 東京 as entities, the rest O
    first_of = {}
    for i, w in enumerate(word_ids):
        if w is not None:
            first_of.setdefault(w, i)
    labels = ["O"] * len(word_ids)
    labels[first_of[0]] = "B-PER"
    labels[first_of[2]] = "B-LOC"
    tokyo = [w for w in first_of if text[enc["offset_mapping"][first_of[w]][0]] in "東京"]
    labels[first_of[tokyo[0]]] = "B-LOC"
    labels[first_of[tokyo[1]]] = "I-LOC"
    result = aggregate(labels, [1.0] * len(labels), enc["offset_mapping"], text, word_ids)
    assert [(s.entity, s.text) for s in result] == [
        ("PER", "Jürgen"),
        ("LOC", "Köln"),
        ("LOC", "東京"),
    ]
    assert all(text[s.start : s.end] == s.text for s in result)
