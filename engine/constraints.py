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
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trae_groups.engine.errors import RequestError

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
CACHE_SIZE = 64  # compiled matchers kept per tokenizer


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


class Grammars:
    """Matchers for one tokenizer: its llguidance tokenizer (built once, ~1 s for a
    large vocabulary) and a small cache of compiled matchers to copy from."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]):
        import llguidance.hf

        self.vocab_size = vocab_size
        eos = sorted(eos_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for one sequence (RequestError if the grammar is refused)."""
        from llguidance import LLMatcher

        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
        if compiled is None:
            compiled = LLMatcher(self._tokenizer, constraint.grammar(), log_level=0)
            if compiled.is_error():
                raise RequestError("constraint", compiled.get_error())
            with self._lock:
                self._compiled[constraint] = compiled
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def words(self) -> int:
        """int32 words per row of a token bitmask."""
        return (self.vocab_size + 31) // 32


def fill_masks(matchers: list[Any], words: int) -> torch.Tensor:
    """One bitmask row per matcher: bit t of a row set when token t is allowed."""
    masks = torch.empty((len(matchers), words), dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        view = masks[row]
        matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
    return masks


_BITS = torch.arange(32, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens the bitmasks do not allow."""
    vocab = logits.shape[-1]
    allowed = ((masks.unsqueeze(-1) >> _BITS) & 1).reshape(masks.shape[0], -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))
