"""Constrained decoding: a generation that must match a JSON Schema, a regular
expression, one of some strings, or a Lark (or GBNF) grammar.

The grammar engine is llguidance (Rust; no Python dependencies): it computes, per
step, the set of tokens that keep the output inside the grammar as a bitmask, and
checks each sampled token. xgrammar, vLLM's default, was the other candidate; it
pulls triton and applies its mask with a ``torch.compile``d kernel, which on CPU
needs a C++ toolchain and a compile at first use. Here the mask is applied with
plain tensor ops, only to the rows that have a constraint.

A ``Constraint`` is a plain value (it pickles, it is part of ``SamplingParams``);
a ``Grammars`` per tokenizer turns it into a matcher for one sequence. Compiled
matchers are cached per (constraint, tokenizer) and copied per sequence, so one
schema used by many requests is compiled once, on the submitting thread, never in
the engine's step loop. A matcher follows the sequence's output tokens, so
preemption (which keeps them and recomputes only the KV) does not disturb it.

A compiled matcher can be large (a 25-byte regex such as ``((a{100}){100}){20}`` is
tens of MiB of lexer states), and llguidance reports no size. So its size is measured:
the C heap's bytes in use (glibc's ``mallinfo2``, all arenas) before and after it is
built and has computed its first mask (where the lexer builds its states), one
compilation at a time. Other threads' allocations in that window count too, so the
figure errs high, never low by much; where ``mallinfo2`` is missing the grammar text's
length stands in. A constraint over ``max_constraint_bytes`` is refused; the cache is
bounded by ``constraint_cache_bytes`` (EngineConfig).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from trae_groups.engine.config import DEFAULT_CONSTRAINT_CACHE_BYTES, DEFAULT_MAX_CONSTRAINT_BYTES
from trae_groups.engine.errors import RequestError

if TYPE_CHECKING:  # torch is imported where masks are built: a graph's validation needs none
    import torch

ConstraintKind = Literal["json_schema", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "regex", "choice", "grammar")
_FORMATS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
MAX_SPEC_CHARS = 100_000
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled matchers kept per tokenizer, at most (bytes bound them first)


@dataclass(frozen=True)
class Constraint:
    """What the output must match. ``spec``: a JSON Schema (JSON text), a regular
    expression, a JSON list of strings (``choice``), or a Lark/GBNF grammar."""

    kind: ConstraintKind
    spec: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RequestError("constraint", f"kind must be one of {KINDS}, not {self.kind!r}")
        if not isinstance(self.spec, str) or not self.spec.strip():
            raise RequestError("constraint", "needs a non-empty spec")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise RequestError("constraint", f"spec is over {MAX_SPEC_CHARS} characters")
        if self.kind == "choice":
            choices = _json(self.spec)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise RequestError("constraint", "choice needs a JSON list of strings")
        elif self.kind == "json_schema" and not isinstance(_json(self.spec), dict | bool):
            raise RequestError("constraint", "json_schema needs a JSON Schema object")
        error = _check(self.grammar())
        if error:
            raise RequestError("constraint", f"{self.kind}: {error}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> Constraint:
        return cls("json_schema", json.dumps(schema))

    def grammar_text(self) -> str:
        """The spec as llguidance reads it: JSON is written compactly (one space after
        ':' and ','), unless the schema's own ``x-guidance`` says otherwise, so that a
        model cannot wander in whitespace."""
        if self.kind != "json_schema":
            return self.spec
        schema = json.loads(self.spec)
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": COMPACT_JSON}
        return json.dumps(schema)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))

    def grammar(self) -> str:
        """The llguidance grammar this constraint means."""
        import llguidance

        try:
            return llguidance.grammar_from(_FORMATS[self.kind], self.grammar_text())
        except (ValueError, TypeError) as exc:
            raise RequestError("constraint", f"{self.kind}: {exc}") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError("constraint", f"spec is not JSON: {exc}") from None


def _check(grammar: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error and messages else ""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _mallinfo2() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()
_MEASURING = threading.Lock()  # one compilation measured at a time: two never count each other


def heap_bytes() -> int | None:
    """Bytes of the C heap in use (small chunks plus mmapped blocks), or None where
    glibc's ``mallinfo2`` is missing."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def vocabulary(tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> Any:
    """llguidance's view of a tokenizer: read from the tokenizer's own description when
    llguidance knows its kind, else built from the bytes the engine decodes for each token
    (a WordLevel tokenizer with a ``Fuse`` decoder, say). RequestError when neither works:
    the model cannot be constrained."""
    import llguidance
    import llguidance.hf

    eos = sorted(eos_ids) or None
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except (ValueError, TypeError, AttributeError):
        pass  # a decoder or model kind llguidance does not read: decode the tokens instead
    try:
        table = _DecodedVocabulary(tokenizer, vocab_size, eos_ids)
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(table), n_vocab=vocab_size, eos_token=eos
        )
    except Exception as exc:  # llguidance raises plain exceptions for a table it refuses
        raise RequestError(
            "constraint", f"this model's tokenizer cannot be constrained: {exc}"
        ) from None


class _DecodedVocabulary:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads it: each token's bytes as
    the tokenizer decodes that token alone (ids past the tokenizer's own are empty, never
    allowed), and an encoder for the text a grammar forces."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]):
        self._tokenizer = tokenizer
        known = len(tokenizer)
        self.tokens = [
            tokenizer.decode([i]).encode("utf-8") if i < known else b"" for i in range(vocab_size)
        ]
        self.special_token_ids = sorted(
            i for i in getattr(tokenizer, "all_special_ids", ()) if i < vocab_size
        )
        self.eos_token_id = min(eos_ids) if eos_ids else tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._ids = {
            b: i for i, b in enumerate(self.tokens) if b and i not in self.special_token_ids
        }
        self._longest = max((len(b) for b in self._ids), default=1)

    def __call__(self, text: bytes) -> list[int]:
        """The tokenizer's own ids when they decode back to ``text``; else the longest
        tokens of the table that spell it (a word-level tokenizer maps unknown words to
        one id that spells nothing)."""
        string = text.decode("utf-8", errors="replace")
        ids = self._tokenizer.encode(string, add_special_tokens=False)
        if self._tokenizer.decode(ids).encode("utf-8") == text:
            return ids
        out, at = [], 0
        while at < len(text):
            for size in range(min(self._longest, len(text) - at), 0, -1):
                token = self._ids.get(text[at : at + size])
                if token is not None:
                    out.append(token)
                    at += size
                    break
            else:
                at += 1  # no token spells this byte: the grammar cannot force it
        return out


class Grammars:
    """Matchers for one tokenizer: its llguidance tokenizer (built once, ~1 s for a
    large vocabulary) and a cache of compiled matchers to copy from, bounded in bytes."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: set[int],
        max_bytes: int = DEFAULT_MAX_CONSTRAINT_BYTES,
        cache_limit: int = DEFAULT_CONSTRAINT_CACHE_BYTES,
    ):
        self.vocab_size = vocab_size
        self.max_bytes, self.cache_limit = max_bytes, cache_limit
        self._tokenizer = vocabulary(tokenizer, vocab_size, eos_ids)
        self._compiled: OrderedDict[Constraint, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_bytes = 0  # measured bytes of the cached matchers
        self.refusals = 0  # constraints refused for their size

    @property
    def cache_entries(self) -> int:
        return len(self._compiled)

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for one sequence (RequestError if the grammar is refused, or
        compiles to more than ``max_bytes``)."""
        with self._lock:
            entry = self._compiled.get(constraint)
            if entry is not None:
                self._compiled.move_to_end(constraint)
        if entry is None:
            entry = self._compile(constraint)
            with self._lock:
                if constraint not in self._compiled:
                    self._compiled[constraint] = entry
                    self.cache_bytes += entry[1]
                while self._compiled and (
                    self.cache_bytes > self.cache_limit or len(self._compiled) > CACHE_SIZE
                ):
                    _, (_, size) = self._compiled.popitem(last=False)
                    self.cache_bytes -= size
        return entry[0].deep_copy()

    def _compile(self, constraint: Constraint) -> tuple[Any, int]:
        """The compiled matcher and its measured bytes (see the module docstring)."""
        import torch
        from llguidance import LLMatcher

        grammar = constraint.grammar()
        scratch = torch.empty(self.words(), dtype=torch.int32)
        with _MEASURING:
            before = heap_bytes()
            compiled = LLMatcher(self._tokenizer, grammar, log_level=0)
            if not compiled.is_error():  # the lexer builds its states here
                compiled.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
            after = heap_bytes()
        if compiled.is_error():
            raise RequestError("constraint", compiled.get_error())
        measured = after - before if before is not None and after is not None else 0
        size = max(measured, len(grammar))
        if size > self.max_bytes:
            del compiled  # its memory goes back now, not when the cache would drop it
            with self._lock:
                self.refusals += 1
            raise RequestError(
                "constraint",
                f"{constraint.kind} compiles to {_mib(size)}; a request's constraint may "
                f"take at most {_mib(self.max_bytes)} (max_constraint_bytes)",
            )
        return compiled, size

    def words(self) -> int:
        """int32 words per row of a token bitmask."""
        return (self.vocab_size + 31) // 32


def fill_masks(matchers: list[Any], words: int) -> torch.Tensor:
    """One bitmask row per matcher: bit t of a row set when token t is allowed."""
    import torch

    masks = torch.empty((len(matchers), words), dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        view = masks[row]
        matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
    return masks


@functools.cache
def _bits() -> torch.Tensor:
    """0..31, the shifts that spread an int32 word into its bits (made once)."""
    import torch

    return torch.arange(32, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens the bitmasks do not allow."""
    vocab = logits.shape[-1]
    allowed = ((masks.unsqueeze(-1) >> _bits()) & 1).reshape(masks.shape[0], -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))
