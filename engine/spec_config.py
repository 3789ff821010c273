"""How a model speculates: one frozen dataclass, checked once (engine/speculative.py runs it).

Kept apart from the proposers so that ``EngineConfig`` can hold it without importing them.
"""

from __future__ import annotations

from dataclasses import dataclass

# "ngram": prompt lookup (engine/speculative.py); "draft": another model on the same engine
# (engine/draft.py), named by ``draft``; "follows": lookup in a text the request carries
# (``Reference``), only for the requests that carry one (a graph's generate node declares it)
METHODS = ("ngram", "draft", "follows")
#: The one home of the speculative options' ranges and defaults.
RANGES = {"num_tokens": (1, 16), "max_batch": (1, 4096)}  # integers, both ends inclusive
DEFAULT_NUM_TOKENS = 4
# Above this many decoding sequences speculation is off for the step: a large batch's step is
# compute-bound, so rows for proposals cost about what they may save (bench/speculative.py)
DEFAULT_MAX_BATCH = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one model speculates (``EngineConfig.speculative``, a generate model's
    ``speculative:`` in a graph file, ``trae serve --speculative``)."""

    method: str = "ngram"
    num_tokens: int = DEFAULT_NUM_TOKENS
    max_batch: int = DEFAULT_MAX_BATCH
    draft: str | None = None  # method "draft": the engine's name of the draft model

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method: must be one of {list(METHODS)}, got {self.method!r}")
        if (self.method == "draft") != (self.draft is not None):
            raise ValueError("draft: names the draft model, with method 'draft' only")
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """``ngram`` or ``ngram:K`` (the CLI's form; a draft model is named in a graph)."""
        method, _, k = text.partition(":")
        if method == "draft":
            raise ValueError("method: draft names its model in the graph file, not here")
        if method == "follows":
            raise ValueError("method: follows is declared on a graph's generate node, not here")
        if not k:
            return cls(method=method)
        if not k.isdigit():
            raise ValueError(f"num_tokens: must be an integer, got {k!r}")
        return cls(method=method, num_tokens=int(k))


@dataclass(frozen=True)
class Reference:
    """A text one generation is likely to copy (``GenerateRequest.reference``): method
    ``follows`` proposes from its tokens first, then from the sequence's own. A graph's
    generate node sends the text of the node its prompt reads; the engine keeps the ids
    its tokenizer makes of it (token ids are taken as they are)."""

    text: str | tuple[int, ...]
    num_tokens: int = DEFAULT_NUM_TOKENS  # the most tokens proposed a step

    def __post_init__(self):
        if not isinstance(self.text, str | tuple):
            raise ValueError(f"reference: must be a text or token ids, got {self.text!r}")
        low, high = RANGES["num_tokens"]
        k = self.num_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= high:
            raise ValueError(f"num_tokens: must be an integer in [{low}, {high}], got {k!r}")
