"""Incremental detokenization and stop-string handling for one sequence."""

from __future__ import annotations

from trae_groups.engine.sequence import Sequence


def update_text(
    seq: Sequence, tokenizer, skip_special: bool, final: bool = False, upto: int | None = None
) -> None:
    """Append the text of the newest tokens to ``seq.text``.

    The tokens decoded last time are decoded again with the new ones, so that merges
    across token boundaries (sentencepiece spaces, byte pieces) come out right; a
    partial UTF-8 character (U+FFFD) is held back until a later token completes it,
    or until the sequence ends (``final``).
    """
    ids = seq.output_token_ids[:upto]
    lo, mid = seq.detok_prefix, seq.detok_read
    before = tokenizer.decode(ids[lo:mid], skip_special_tokens=skip_special)
    after = tokenizer.decode(ids[lo:], skip_special_tokens=skip_special)
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        seq.text += after[len(before) :]
        seq.detok_prefix, seq.detok_read = mid, len(ids)


def find_stop(text: str, stops: tuple[str, ...], searched_upto: int) -> int | None:
    """Index where the earliest stop string starts, looking only at new text."""
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, searched_upto - longest + 1)
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None
