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
seen both decodes and prompt tokens there is no estimate, and the scheduler does not cap.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

RECENT = 48  # steps of every kind in the fit
ANCHORS = 8  # the newest steps with prompt tokens, and without, kept however old
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
        self._coef: tuple[float, float, float] | None = None
        self._stale = False

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One step's size and wall time."""
        if seconds <= 0 or not math.isfinite(seconds) or decodes + prompt_tokens == 0:
            return
        step = (decodes, prompt_tokens, seconds)
        self._recent.append(step)
        (self._with_prompt if prompt_tokens else self._without_prompt).append(step)
        self._stale = True

    def estimate(self) -> tuple[float, float, float] | None:
        """(base, per decode, per prompt token) in seconds, or None while unknown."""
        if self._stale:
            self._coef, self._stale = self._fit(), False
        return self._coef

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
        coef = self.estimate()
        if coef is None:
            return None
        base, per_decode, per_token = coef
        if per_token <= 0:
            return ceiling
        decodes_alone = base + per_decode * decodes
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
        residuals = [abs(_predict(coef, s) - s[2]) for s in steps]
        spread = statistics.median(residuals)
        kept = [s for s, r in zip(steps, residuals, strict=True) if r <= OUTLIER_MADS * spread]
        if len(kept) >= 3 and len(kept) < len(steps):
            coef = _least_squares(kept) or coef
        base, per_decode, per_token = coef
        # a negative share is noise in a short history: no part of a step costs below zero
        return max(base, 0.0), max(per_decode, 0.0), max(per_token, 0.0)


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
