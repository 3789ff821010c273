"""Per-request sampling parameters, applied to a whole batch in one pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trae_groups.engine.constraints import Constraint, apply_masks
from trae_groups.engine.errors import RequestError


@dataclass(frozen=True)
class Bound:
    """The allowed values of one numeric option: ``low``/``high`` (None: unbounded),
    each inclusive or not. Upper layers turn it into their own checks (pydantic's
    ``ge``/``gt``/``le``/``lt``) so a value is refused where it enters."""

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    integer: bool = False

    def admits(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if self.low is not None and (
            value < self.low or (value == self.low and not self.low_inclusive)
        ):
            return False
        return self.high is None or not (
            value > self.high or (value == self.high and not self.high_inclusive)
        )

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        left = "[" if self.low_inclusive else "("
        right = "]" if self.high_inclusive else ")"
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"must be {kind} in {left}{low}, {high}{right}"

    def pydantic(self) -> dict[str, float]:
        """The same bound as pydantic Field keywords."""
        out: dict[str, float] = {}
        if self.low is not None:
            out["ge" if self.low_inclusive else "gt"] = self.low
        if self.high is not None:
            out["le" if self.high_inclusive else "lt"] = self.high
        return out


#: The one home of every sampling option's range. The graph spec and the OpenAI
#: request models derive their checks from it (graphs.types.sampling_field).
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, 2**31, high_inclusive=False, integer=True),
    "temperature": Bound(0.0, 2.0),
    "top_k": Bound(0, 2**31, high_inclusive=False, integer=True),
    "top_p": Bound(0.0, 1.0, low_inclusive=False),
    "min_p": Bound(0.0, 1.0, high_inclusive=False),
    "repetition_penalty": Bound(0.0, 10.0, low_inclusive=False),
    "seed": Bound(0, 2**63, high_inclusive=False, integer=True),
    "logprobs": Bound(0, 20, integer=True),
}

#: What each option means, written once (docs, the OpenAPI schema and --help read it).
DESCRIPTIONS: dict[str, str] = {
    "max_tokens": "tokens to generate at most",
    "temperature": "0 is greedy decoding (the default); higher samples more freely",
    "top_k": "sample among the k most likely tokens; 0 = off",
    "top_p": "sample among the most likely tokens holding this probability mass",
    "min_p": "drop tokens less likely than min_p x the most likely one",
    "repetition_penalty": "divide the logits of tokens already seen (1 = off)",
    "seed": "a seed makes sampling reproducible whatever shares the batch",
    "stop": "strings that end the generation (not included in the text)",
    "logprobs": "also return this many top alternatives per token",
}


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The defaults are the project's defaults everywhere
    (graph nodes, the OpenAI routes): greedy decoding of up to 256 tokens."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top alternatives per token
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # the output must match it (engine/constraints.py)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs"):
                continue
            if not bound.admits(value):
                raise RequestError(name, f"{bound.describe()}, got {value!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop", f"must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


def apply_repetition_penalty(
    logits: torch.Tensor, seen: list[list[int]], penalties: list[float]
) -> None:
    """HF's rule: divide positive logits of seen tokens by the penalty, multiply negative."""
    for row, (tokens, penalty) in enumerate(zip(seen, penalties, strict=True)):
        if penalty == 1.0 or not tokens:
            continue
        idx = torch.tensor(sorted(set(tokens)), dtype=torch.long, device=logits.device)
        vals = logits[row, idx]
        logits[row, idx] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on a batch of rows that sample."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits = logits / temps[:, None]
    ks = [p.top_k for p in params]
    if any(ks):
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in ks])
        sorted_vals = logits.sort(dim=-1, descending=True).values
        kth = sorted_vals.gather(1, (k.clamp(max=vocab) - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    tops = [p.top_p for p in params]
    if any(t < 1.0 for t in tops):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        drop_sorted = before >= torch.tensor(tops)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    mins = [p.min_p for p in params]
    if any(mins):
        floor = probs.max(-1, keepdim=True).values * torch.tensor(mins)[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


class Sampler:
    """Samples one token per row. Seeded rows draw from their own generator, so a
    seeded request gives the same tokens whatever else shares its batch."""

    def __init__(self):
        self._default = torch.Generator().manual_seed(torch.seed() % (2**63))

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seen: list[list[int]],
        generators: list[torch.Generator | None],
        masks: tuple[list[int], torch.Tensor] | None = None,
    ) -> SampleResult:
        """``masks``: the rows that have a constraint and their token bitmasks; the
        other rows are sampled exactly as without them."""
        logits = logits.float()
        raw = logits
        if any(p.repetition_penalty != 1.0 for p in params):
            logits = logits.clone()
            apply_repetition_penalty(logits, seen, [p.repetition_penalty for p in params])
        if masks is not None:
            rows, bits = masks
            logits = logits.clone() if logits is raw else logits
            constrained = logits[rows]
            apply_masks(constrained, bits)
            logits[rows] = constrained
        tokens = logits.argmax(-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows)
            probs = _filter(logits[idx], [params[i] for i in rows])
            uniform = 1.0 - torch.stack(  # in (0, 1]: never picks a zero-probability token
                [torch.rand((), generator=generators[i] or self._default) for i in rows]
            )
            cdf = probs.cumsum(-1)
            picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
            picked = picked.clamp(max=probs.shape[-1] - 1)
            tokens[idx] = picked
        result = SampleResult(tokens.tolist())
        if any(p.logprobs is not None for p in params):
            logp = raw.log_softmax(-1)
            result.logprobs = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
            result.top_logprobs = []
            for i, p in enumerate(params):
                n = p.logprobs or 0
                vals, ids = logp[i].topk(n) if n else (torch.empty(0), torch.empty(0))
                result.top_logprobs.append(dict(zip(ids.tolist(), vals.tolist(), strict=True)))
        return result
