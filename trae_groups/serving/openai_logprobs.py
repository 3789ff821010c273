"""OpenAI's two shapes of token logprobs, from the engine's ``TokenLogprob`` entries.

Chat (``choices[].logprobs.content``): per token its text, logprob, UTF-8 bytes and its
``top_logprobs`` alternatives. Completions, the legacy shape: parallel lists ``tokens``,
``token_logprobs``, ``top_logprobs`` (a dict of text to logprob per token) and
``text_offset`` (where each token starts in the choice's text). With ``echo`` the prompt's
tokens come first, the first of them with null logprob and null alternatives (nothing
predicts it), as OpenAI and vLLM return them. Offsets add up each token's own text, so a
character split across tokens (each showing U+FFFD) shifts the offsets after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trae_groups.engine.protocol import TokenLogprob

#: The most alternatives per token /v1/completions' ``logprobs`` takes (OpenAI's limit).
MAX_LEGACY_LOGPROBS = 5


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_content(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """``logprobs.content`` of a chat choice (or of one streamed chunk)."""
    return [
        {
            "token": e.text,
            "logprob": e.logprob,
            "bytes": _bytes(e.text),
            "top_logprobs": [
                {"token": text, "logprob": lp, "bytes": _bytes(text)} for _, text, lp in e.top
            ],
        }
        for e in entries
    ]


def legacy(entries: Sequence[TokenLogprob], offset: int = 0) -> tuple[dict[str, Any], int]:
    """The completions shape of ``entries`` whose text starts at ``offset`` of the
    choice's text; and the offset after them (a stream's next chunk starts there)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    shape = {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None else {text: lp for _, text, lp in e.top} for e in entries
        ],
        "text_offset": offsets,
    }
    return shape, offset
