"""What a step of one model costs, learnt from its own steps: the scheduler's prompt budget.

A step that carries a prompt chunk next to running decodes makes every one of those decodes
wait for the chunk: on a CPU a 512-token chunk of the demo's model is ~0.8 s, twenty times a
decode step. To keep such steps near a target time the scheduler needs to know how many
prompt tokens fit beside ``n`` decodes, and that depends on the model, its dtype, the
machine and the context lengths of the moment. So it is measured, not configured: recent
steps' wall times are fitted to

    seconds ~= base + per_decode * decodes + per_prompt_token * prompt_tokens

by least squares. The fit is robust because its inputs are not clean: a step that builds a
new matmul shape, collects garbage or shares its cores with another process takes several
times its usual time, so steps the first fit explains worst are dropped before the second.
It reads the last ``RECENT`` steps (a model whose contexts grow, or a machine that gets
busier, is followed) plus the last ``ANCHORS`` steps with and without prompt tokens, however
old, so each coefficient stays grounded when recent steps are all of one kind. Until it has
seen both decodes and prompt tokens there is no estimate.

The budget itself does not trust that fit's intercept. Attention deep in a long context is
not linear in the step's tokens, and a fit over a 3,000-token prompt's chunks put the base at
64-128 ms where the decode step it stood for took ~25 ms (Zen 4, bf16): every held step was
priced as if the decodes alone took three times their time, and the chat beside the prompt
streamed at a third of its speed. So what the decodes cost alone is read off the steps that
were decodes alone (a robust line over their decode counts), and what a prompt token costs is
the median marginal cost of the newest steps of the same kind that carried prompt tokens
(beside decodes, or alone): what each of those steps took beyond its decodes' own step, per
prompt token. Both follow the context of the moment, and the kinds differ: a held step's few
tokens deep in a prompt cost ~1 ms each where the prompt's own first chunks cost ~0.5 ms
(SmolLM2 bf16, Zen 5), and a price from those chunks let the steps beside a chat take 4x its
own step, not 2x. The joint fit stands in for either while its steps have not been seen. Until one
of the two ways knows both, the scheduler does not cap (``known``): a fresh engine knows after
three decode-only steps and one with prompt tokens (a chat), not only after three of each.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

RECENT = 48  # steps of every kind in the fit
ANCHORS = 8  # the newest steps with prompt tokens, and without, kept however old
# the newest steps of one kind (prompt tokens beside decodes, or alone) that price a prompt
# token: few, because a long prompt's token grows dearer with every chunk (its attention
# reads the whole context), and a median of eight lagged four chunks behind
PRICE_STEPS = 4
MIN_STEPS = 3  # steps with prompt tokens, and with decodes, before there is an estimate
OUTLIER_MADS = 3.0  # a step further than this many median deviations from the fit is dropped
# features scaled to comparable sizes (decodes, prompt tokens of a step) for the solve
DECODE_SCALE = 32.0
TOKEN_SCALE = 512.0
RIDGE = 1e-6

Step = tuple[int, int, float]  # decodes, prompt tokens, seconds


class StepCost:
    """Robust fit of one model's step time (see the module docstring)."""

    def __init__(self) -> None:
        self._recent: deque[Step] = deque(maxlen=RECENT)
        self._with_prompt: deque[Step] = deque(maxlen=ANCHORS)
        self._without_prompt: deque[Step] = deque(maxlen=ANCHORS)
        self._decodes_only: deque[Step] = deque(maxlen=RECENT)
        self._prompt_beside: deque[Step] = deque(maxlen=PRICE_STEPS)  # and decodes
        self._prompt_alone: deque[Step] = deque(maxlen=PRICE_STEPS)
        self._last_price: dict[bool, float] = {}  # by beside_decodes
        self._line: tuple[float, float] | None = None
        self._coef: tuple[float, float, float] | None = None
        self._stale = False

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One step's size and wall time."""
        if seconds <= 0 or not math.isfinite(seconds) or decodes + prompt_tokens == 0:
            return
        step = (decodes, prompt_tokens, seconds)
        self._recent.append(step)
        (self._with_prompt if prompt_tokens else self._without_prompt).append(step)
        if decodes and not prompt_tokens:
            self._decodes_only.append(step)
        if prompt_tokens:
            (self._prompt_beside if decodes else self._prompt_alone).append(step)
        self._stale = True

    def estimate(self) -> tuple[float, float, float] | None:
        """(base, per decode, per prompt token) in seconds, or None while unknown."""
        if self._stale:
            self._coef, self._stale = self._fit(), False
            self._line = _robust_line(list(self._decodes_only), self._coef)
        return self._coef

    def decodes_alone(self, decodes: int) -> float | None:
        """Seconds of a step of ``decodes`` decodes and no prompt tokens: measured on such
        steps where there were some, else the joint fit's; None while unknown."""
        coef = self.estimate()
        if self._line is not None:
            base, per_decode = self._line
            return base + per_decode * decodes
        if coef is None:
            return None
        return coef[0] + coef[1] * decodes

    def per_prompt_token(self, beside_decodes: bool = True) -> float | None:
        """Seconds a prompt token adds to a step beside decodes (or, ``beside_decodes``
        false, with none): the median over the newest such steps of what each took beyond
        its decodes alone, per prompt token; over the steps of the other kind while there
        are none of this one; the last price above zero where the newest steps read as free
        (a few floor tokens beside a step's base are below the noise, and a free token
        would open the whole budget); the joint fit's share while no decode-only step was
        seen; None while unknown."""
        coef = self.estimate()
        if self._line is not None and self._with_prompt:
            base, per_decode = self._line
            same, other = (self._prompt_beside, self._prompt_alone)[:: 1 if beside_decodes else -1]
            price = statistics.median(
                max(seconds - base - per_decode * decodes, 0.0) / tokens
                for decodes, tokens, seconds in (same or other)
            )
        elif coef is not None:
            price = coef[2]
        else:
            return None
        if price > 0:
            self._last_price[beside_decodes] = price
        return self._last_price.get(beside_decodes, self._last_price.get(not beside_decodes, price))

    def known(self) -> bool:
        """Whether both what the decodes cost alone and what a prompt token adds are known:
        from MIN_STEPS decode-only steps and one with prompt tokens, or from the joint fit."""
        return self.decodes_alone(0) is not None and self.per_prompt_token() is not None

    def prompt_budget(
        self,
        decodes: int,
        target_s: float,
        floor: int,
        ceiling: int,
        stretch: float = 1.0,
        slowdown: float | None = None,
    ) -> int | None:
        """Prompt tokens that keep a step with ``decodes`` decodes near ``target_s``, or near
        ``stretch`` times the decodes' own step where that is longer, but (``slowdown``) not
        past that many times the decodes' own step; between ``floor`` (a long prompt always
        moves on) and ``ceiling``; None while unknown."""
        decodes_alone = self.decodes_alone(decodes)
        per_token = self.per_prompt_token(beside_decodes=decodes > 0)
        if decodes_alone is None or per_token is None:
            return None
        if per_token <= 0:
            return ceiling
        step = max(target_s, stretch * decodes_alone)
        if slowdown is not None:
            step = min(step, slowdown * decodes_alone)
        return max(floor, min(ceiling, int((step - decodes_alone) / per_token)))

    def _fit(self) -> tuple[float, float, float] | None:
        steps = list({id(s): s for s in (*self._recent, *self._with_prompt,
                                         *self._without_prompt)}.values())  # fmt: skip
        if sum(1 for s in steps if s[1]) < MIN_STEPS or sum(1 for s in steps if s[0]) < MIN_STEPS:
            return None
        coef = _least_squares(steps)
        if coef is None:
            return None
        kept = _inliers(steps, [abs(_predict(coef, s) - s[2]) for s in steps])
        if len(kept) >= 3 and len(kept) < len(steps):
            coef = _least_squares(kept) or coef
        base, per_decode, per_token = coef
        # a negative share is noise in a short history: no part of a step costs below zero
        return max(base, 0.0), max(per_decode, 0.0), max(per_token, 0.0)


def _robust_line(
    steps: list[Step], coef: tuple[float, float, float] | None
) -> tuple[float, float] | None:
    """(base, per decode) of decode-only steps: least squares, then again without the steps
    it explains worst (a step that built a matmul shape or shared its cores); None with fewer
    than MIN_STEPS of them. Where the steps had one decode count (a batch-1 chat) or came out
    sloping down, the slope is the joint fit ``coef``'s per-decode share (0 without it)."""
    if len(steps) < MIN_STEPS:
        return None
    slope = 0.0 if coef is None else coef[1]
    line = _line(steps, slope)
    kept = _inliers(steps, [abs(line[0] + line[1] * s[0] - s[2]) for s in steps])
    return _line(kept, slope) if len(kept) >= 2 else line


def _inliers(steps: list[Step], residuals: list[float]) -> list[Step]:
    """The steps within OUTLIER_MADS median deviations of a first fit (``residuals``)."""
    spread = statistics.median(residuals)
    return [s for s, r in zip(steps, residuals, strict=True) if r <= OUTLIER_MADS * spread]


def _line(steps: list[Step], fallback_slope: float) -> tuple[float, float]:
    """Least-squares seconds ~= base + per_decode * decodes; through the steps' median at
    their median decode count with ``fallback_slope`` where theirs is unknown or negative."""
    mean_d = statistics.fmean(s[0] for s in steps)
    mean_t = statistics.fmean(s[2] for s in steps)
    sxx = sum((s[0] - mean_d) ** 2 for s in steps)
    slope = sum((s[0] - mean_d) * (s[2] - mean_t) for s in steps) / sxx if sxx > 0 else 0.0
    if slope > 0:
        return max(mean_t - slope * mean_d, 0.0), slope
    mid_t = statistics.median(s[2] for s in steps)
    mid_d = statistics.median(s[0] for s in steps)
    return max(mid_t - fallback_slope * mid_d, 0.0), fallback_slope


def _features(step: Step) -> tuple[float, float, float]:
    return 1.0, step[0] / DECODE_SCALE, step[1] / TOKEN_SCALE


def _predict(coef: tuple[float, float, float], step: Step) -> float:
    return coef[0] + coef[1] * step[0] + coef[2] * step[1]


def _least_squares(steps: list[Step]) -> tuple[float, float, float] | None:
    """(base, per decode, per prompt token) minimising the squared error over ``steps``."""
    xx = [[RIDGE if i == j else 0.0 for j in range(3)] for i in range(3)]
    xy = [0.0, 0.0, 0.0]
    for step in steps:
        x = _features(step)
        for i in range(3):
            xy[i] += x[i] * step[2]
            for j in range(3):
                xx[i][j] += x[i] * x[j]
    solved = _solve3(xx, xy)
    if solved is None:
        return None
    return solved[0], solved[1] / DECODE_SCALE, solved[2] / TOKEN_SCALE


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """x with a x = b for a 3x3 system (Gaussian elimination with pivoting); None if singular."""
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, 4):
                    m[r][c] -= f * m[col][c]
    return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]
