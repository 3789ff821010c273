"""Per-request sampling parameters, applied to a whole batch in one pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trae_groups.engine.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """Defaults are greedy decoding of up to 16 tokens."""

    max_tokens: int = 16
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
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        checks = [
            (
                "max_tokens",
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "must be an integer >= 1",
            ),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            (
                "top_k",
                isinstance(self.top_k, int) and 0 <= self.top_k < 2**31,
                "must be an integer in [0, 2^31) (0 = off)",
            ),
            (
                "seed",
                self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
                "must be an integer in [0, 2^63)",
            ),
            ("max_tokens", self.max_tokens < 2**31, "must be below 2^31"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p < 1.0, "must be in [0, 1)"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise RequestError(name, f"{message}, got {getattr(self, name)!r}")

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
    ) -> SampleResult:
        logits = logits.float()
        raw = logits
        if any(p.repetition_penalty != 1.0 for p in params):
            logits = logits.clone()
            apply_repetition_penalty(logits, seen, [p.repetition_penalty for p in params])
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
