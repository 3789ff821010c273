"""Per-request sampling parameters, applied to a whole batch in one pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trae_groups.engine.constraints import Constraint, apply_masks
from trae_groups.engine.errors import RequestError

if TYPE_CHECKING:  # the functions that sample import torch; the parameters need none (a
    import torch  # graph is validated against them without it)


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
    "prompt_logprobs": Bound(0, 20, integer=True),
    "logit_bias": Bound(-100.0, 100.0),
    "n": Bound(1, 32, integer=True),
    "best_of": Bound(1, 32, integer=True),
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
    "ignore_eos": "keep generating past the end-of-sequence token, up to max_tokens",
    "logprobs": "also return this many top alternatives per token",
    "prompt_logprobs": "score the prompt: each prompt token's logprob and this many alternatives",
    "logit_bias": "added to a token's logit before sampling (-100 bans it, 100 all but forces it)",
    "n": "completions of the prompt to return (they share the prompt's pages)",
    "best_of": "completions to generate, of which the n most likely are returned (>= n)",
    "speculative": "false: no speculative decoding for this request (same tokens either way)",
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
    #: score the prompt too (its logits come from the prefill that runs anyway; a request
    #: that asks computes its whole prompt: a cached prefix has no logits)
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    n: int = 1  # sequences of one prompt that come back (choices 0 .. n-1)
    best_of: int | None = None  # sequences generated (None: n); the caller keeps n of them
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # the output must match it (engine/constraints.py)
    #: False: this request opts out of speculative decoding (engine/speculative.py); its
    #: tokens are the same either way, only how many one step can yield changes
    speculative: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        self.validate()

    def validate(self) -> None:
        for name, bound in BOUNDS.items():
            if name == "logit_bias":
                continue
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if name == "max_tokens" and value == 0 and self.scores_prompt_only:
                continue
            if not bound.admits(value):
                raise RequestError(name, f"{bound.describe()}, got {value!r}")
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError("best_of", f"must be at least n ({self.n}), got {self.best_of}")
        bias = BOUNDS["logit_bias"]
        for token, value in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or not bias.admits(value):
                raise RequestError(
                    "logit_bias", f"token ids map to biases that {bias.describe()}, got "
                    f"{token!r}: {value!r}"
                )  # fmt: skip
        if not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop", f"must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_sequences(self) -> int:
        """Sequences the engine generates for the prompt: ``best_of``, else ``n``."""
        return self.best_of or self.n

    @property
    def scores_prompt_only(self) -> bool:
        """``max_tokens`` 0 with ``prompt_logprobs``: the prompt is scored, nothing is
        generated (OpenAI's ``echo`` with ``max_tokens: 0``)."""
        return self.max_tokens == 0 and self.prompt_logprobs is not None


_OPTIONAL = ("seed", "logprobs", "prompt_logprobs", "best_of")  # None: not asked for


@dataclass
class SampleResult:
    """One token per row; ``logprobs``/``top_logprobs`` are None for rows that did not
    ask (and None as a whole when no row did)."""

    token_ids: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None


def apply_repetition_penalty(
    logits: torch.Tensor, seen: list[list[int]], penalties: list[float]
) -> None:
    """HF's rule: divide positive logits of seen tokens by the penalty, multiply negative."""
    import torch

    for row, (tokens, penalty) in enumerate(zip(seen, penalties, strict=True)):
        if penalty == 1.0 or not tokens:
            continue
        idx = torch.tensor(sorted(set(tokens)), dtype=torch.long, device=logits.device)
        vals = logits[row, idx]
        logits[row, idx] = torch.where(vals > 0, vals / penalty, vals * penalty)


def filter_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on a batch of rows that sample."""
    import torch

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


def apply_logit_bias(logits: torch.Tensor, biases: list[tuple[tuple[int, float], ...]]) -> None:
    """OpenAI's ``logit_bias``: each row's biases added to its logits, in place."""
    import torch

    for row, bias in enumerate(biases):
        if bias:
            ids = torch.tensor([token for token, _ in bias], device=logits.device)
            values = torch.tensor([value for _, value in bias], dtype=logits.dtype)
            logits[row, ids] += values.to(logits.device)


def score_tokens(
    logits: torch.Tensor, targets: list[int], top: int
) -> list[tuple[float, dict[int, float]]]:
    """Each row's log-probability of its target token and its ``top`` most likely tokens,
    from the model's own distribution (no temperature, penalty or bias): what a prompt's
    tokens score (``prompt_logprobs``)."""
    import torch

    logp = logits.float().log_softmax(-1)
    index = torch.tensor(targets, device=logp.device)[:, None]
    picked = logp.gather(1, index).squeeze(1).tolist()
    if not top:
        return [(value, {}) for value in picked]
    vals, ids = logp.topk(top)
    tops = [dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return list(zip(picked, tops, strict=True))


def _plain_greedy(p: SamplingParams) -> bool:
    """A row whose token is the argmax of its raw logits and that asks for no logprobs."""
    return p.greedy and p.repetition_penalty == 1.0 and not p.logit_bias and p.logprobs is None


class Sampler:
    """Samples one token per row. Seeded rows draw from their own generator, so a
    seeded request gives the same tokens whatever else shares its batch."""

    def __init__(self):
        import torch

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
        other rows are sampled exactly as without them. Logprobs (rows that ask only) are
        of the distribution sampled from: after repetition penalty, ``logit_bias`` and
        temperature, before top-k/top-p/min-p and constraint masks."""
        import torch

        from trae_groups.kernels import cpu_native

        if masks is None and all(_plain_greedy(p) for p in params):  # the logits as they are
            return SampleResult(cpu_native.argmax(logits).tolist())
        scored, logits = self.adjust(logits, params, seen, masks)
        tokens = cpu_native.argmax(logits)  # logits.argmax(-1), the same indices
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows)
            probs = filter_probs(logits[idx], [params[i] for i in rows])
            tokens[idx] = self.draw(probs, [generators[i] for i in rows])
        result = SampleResult(tokens.tolist())
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asked:
            add_logprobs(result, scored, tokens, params, asked)
        return result

    def adjust(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seen: list[list[int]],
        masks: tuple[list[int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scored, logits): float32 logits after repetition penalty and ``logit_bias``
        (what logprobs are of), and the same with constraint masks applied (what is sampled
        from). Speculative verification (engine/verify.py) adjusts its rows the same way."""
        logits = logits.float()
        raw = logits
        if any(p.repetition_penalty != 1.0 for p in params):
            logits = logits.clone()
            apply_repetition_penalty(logits, seen, [p.repetition_penalty for p in params])
        if any(p.logit_bias for p in params):
            logits = logits.clone() if logits is raw else logits
            apply_logit_bias(logits, [p.logit_bias for p in params])
        scored = logits
        if masks is not None:
            rows, bits = masks
            logits = logits.clone()
            constrained = logits[rows]
            apply_masks(constrained, bits)
            logits[rows] = constrained
        return scored, logits

    def draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of ``probs`` [rows, vocab], one uniform from each row's
        generator (the sampler's own for None)."""
        import torch

        uniform = 1.0 - torch.stack(  # in (0, 1]: never picks a zero-probability token
            [torch.rand((), generator=g or self._default) for g in generators]
        )
        cdf = probs.cumsum(-1)
        picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
        return picked.clamp(max=probs.shape[-1] - 1)

    def uniform(self, generator: torch.Generator | None) -> float:
        """A uniform in [0, 1) from ``generator`` (the sampler's own for None)."""
        import torch

        return float(torch.rand((), generator=generator or self._default))


def add_logprobs(
    result: SampleResult,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    params: list[SamplingParams],
    asked: list[int],
) -> None:
    """The chosen tokens' logprobs and top alternatives of the rows that ask (None for
    the others), at each row's temperature (greedy rows: 1)."""
    import torch

    idx = torch.tensor(asked)
    temps = torch.tensor([params[i].temperature or 1.0 for i in asked], dtype=logits.dtype)
    logp = (logits[idx] / temps[:, None]).log_softmax(-1)
    chosen = logp.gather(1, tokens[idx][:, None]).squeeze(1).tolist()
    top = max(params[i].logprobs for i in asked)
    vals, ids = logp.topk(top) if top else (torch.empty(len(asked), 0), torch.empty(len(asked), 0))
    vals, ids = vals.tolist(), ids.long().tolist()
    result.logprobs = [None] * len(params)
    result.top_logprobs = [None] * len(params)
    for j, i in enumerate(asked):
        n = params[i].logprobs
        result.logprobs[i] = chosen[j]
        result.top_logprobs[i] = dict(zip(ids[j][:n], vals[j][:n], strict=True))
