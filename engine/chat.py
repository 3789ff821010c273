"""Chat messages to a prompt's token ids, with what users wrote kept as plain text.

A chat template wraps each message in control tokens (``<|im_start|>user ...``). If
a message's content were tokenized with special tokens recognized, a user could
forge a turn by typing one. So, when some content holds a special token's text, the
template is rendered with a placeholder for each content; the template's own text
is tokenized with special tokens recognized, each content without them (its
``<|im_start|>`` stays the characters it is). Content without any special token's
text takes the plain path (render, then tokenize), which gives the same ids. A role
that holds a special token's text is refused.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from trae_groups.engine.errors import RequestError

log = logging.getLogger("trae_groups.engine")

# Longer texts are tokenized through the Rust tokenizer's batch call, which releases the GIL:
# its single-text call holds it throughout (~1 s for 0.9 MB), and the event loop on another
# thread of the process waits for it.
LONG_TEXT = 16_384

#: A probe of a long text (``probe``): this many characters a token it is to hold (English
#: prose is ~4, "word word ..." 5, code ~3: 8 reaches the count in all of them).
PROBE_CHARS_PER_TOKEN = 8


def probe(text: str, tokens: int) -> str | None:
    """The beginning of ``text`` long enough to hold ``tokens`` tokens, to be tokenized
    instead of a huge whole (the whole costs the tokenizer ~0.6 s a MB of both cores).
    A prefix cut anywhere tokenizes like the whole but for its last few tokens, so a
    caller asks for some tokens of slack. None when the text is at most twice the probe:
    tokenizing the whole then costs little more."""
    chars = PROBE_CHARS_PER_TOKEN * tokens
    return text[:chars] if len(text) > 2 * chars else None


_MARK = "\ue000trae-content-{}\ue001"  # private-use characters around a message's index


def encode(tokenizer: Any, text: str, *, specials: bool = True) -> list[int]:
    """Token ids of ``text`` (no BOS/EOS added); ``specials=False`` reads the text of a
    special token as plain characters."""
    if not text:
        return []
    backend = _rust_tokenizer(tokenizer, specials)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not specials)
    # the Rust tokenizer itself (a third of the cost per prompt)
    if len(text) > LONG_TEXT:  # encode_batch lets go of the GIL while it works
        return backend.encode_batch([text], add_special_tokens=False)[0].ids
    return backend.encode(text, add_special_tokens=False).ids


_plain_specials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rust_tokenizer(tokenizer: Any, specials: bool) -> Any:
    """The tokenizer's Rust tokenizer, or (``specials=False``) a copy of it made once that
    reads special tokens' text as plain characters; None without one. A copy, not the flag
    set per call: setting it waits for the tokenizer's lock while holding the GIL, so one
    thread tokenizing 0.9 MB (GIL released) froze every other thread of the process."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or specials:
        return backend
    plain = _plain_specials.get(tokenizer)
    if plain is None:
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        _plain_specials[tokenizer] = plain
    return plain


def render(
    tokenizer: Any,
    messages: Sequence[dict],
    tools: list[dict] | None = None,
    generation_prompt: bool = True,
) -> str:
    """The prompt text of chat messages (and function tools, for templates that show
    them): the tokenizer's chat template, or a plain transcript the model can continue
    when it has none. ``generation_prompt``: end with the opening of the assistant's turn."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if tools and "tools" not in str(template or ""):
        raise RequestError(
            "tools",
            "the model's chat template does not show tools; tool_choice 'required' or a "
            "named function constrains the reply to a call instead",
        )
    if not template:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + ("\nassistant:" if generation_prompt else "")
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def chat_token_ids(
    tokenizer: Any,
    messages: Sequence[dict],
    tools: list[dict] | None = None,
    generation_prompt: bool = True,
) -> list[int]:
    """The prompt's token ids for these messages (see the module docstring)."""
    if not messages:
        raise RequestError("messages", "needs at least one message")
    specials = special_texts(tokenizer)
    for i, m in enumerate(messages):
        if any(s in m["role"] for s in specials):
            raise RequestError(f"messages.{i}.role", "holds a special token's text")
    if not any(s in m["content"] for m in messages for s in specials):
        return encode(tokenizer, render(tokenizer, messages, tools, generation_prompt))
    marks = [_MARK.format(i) for i in range(len(messages))]
    masked = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    text = render(tokenizer, masked, tools, generation_prompt)
    ids: list[int] = []
    for mark, message in zip(marks, messages, strict=True):
        before, found, text = text.partition(mark)
        if not found:  # the template rewrote a content: drop the special texts instead
            log.warning("chat template does not keep contents verbatim; special tokens dropped")
            plain = _without(messages, specials)
            return encode(tokenizer, render(tokenizer, plain, tools, generation_prompt))
        ids += encode(tokenizer, before) + encode(tokenizer, message["content"], specials=False)
    return ids + encode(tokenizer, text)


def prompt_token_ids(tokenizer: Any, text: str, inlined: Sequence[tuple[int, int]]) -> list[int]:
    """A text prompt's ids where ``inlined`` spans came from request values: as for chat
    contents, a special token's text inside a span is read as characters, the rest of the
    text keeps its control tokens. Spans without any special token's text take the plain
    path, which gives the same ids as tokenizing the whole text."""
    specials = special_texts(tokenizer)
    spans = [(a, b) for a, b in inlined if any(s in text[a:b] for s in specials)]
    if not spans:
        return encode(tokenizer, text)
    ids: list[int] = []
    at = 0
    for start, end in sorted(spans):
        ids += encode(tokenizer, text[at:start]) + encode(
            tokenizer, text[start:end], specials=False
        )
        at = end
    return ids + encode(tokenizer, text[at:])


_END = "\ue000trae-prefix-end\ue001"


def prefix_token_ids(
    tokenizer: Any, messages: Sequence[dict], tools: list[dict] | None = None
) -> list[int]:
    """The token ids of these messages up to the end of the last one's content, with
    nothing after it: the start of the prompt of any conversation that continues the last
    message's text. Empty when a content holds a special token's text (its ids would not
    be the plain-text ids the full prompt gets), or when the template rewrites contents."""
    specials = special_texts(tokenizer)
    if any(s in m["role"] or s in m["content"] for m in messages for s in specials):
        return []
    last = {**messages[-1], "content": messages[-1]["content"] + _END}
    text, found, _ = render(tokenizer, [*messages[:-1], last], tools).partition(_END)
    return encode(tokenizer, text) if found else []


@lru_cache(maxsize=64)
def _special_texts(tokenizer: Any) -> tuple[str, ...]:
    found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.add(str(token))
    return tuple(sorted(t for t in found if t))


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of a tokenizer's special tokens (cached per tokenizer)."""
    return _special_texts(tokenizer) if tokenizer is not None else ()


def _without(messages: Sequence[dict], specials: Sequence[str]) -> list[dict]:
    out = []
    for m in messages:
        content = m["content"]
        for s in specials:
            content = content.replace(s, "")
        out.append({**m, "content": content})
    return out


#: How a model family writes tool calls (parsed in trae_groups/serving/tool_parsers.py);
#: ``json``: one ``{"name", "arguments"}`` object, for a model of no known family.
TOOL_CALL_FORMATS = ("hermes", "llama3", "mistral", "json")
_FORMAT_MARKS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
)


def tool_call_format(tokenizer: Any) -> str:
    """The tool-call syntax a model was trained on, read from its chat template and its
    added tokens (Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``, Llama 3's
    ``<|python_tag|>`` or its template's ``"parameters"`` calls); ``json`` otherwise."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    added = {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    for mark, fmt in _FORMAT_MARKS:
        if mark in template or mark in added:
            return fmt
    if '"parameters"' in template and "ipython" in template:
        return "llama3"
    return "json"
