"""One LLM worker's counters and windows of recent values, in one place.

The engine thread updates them as it steps; metrics read them at scrape time
(``ModelStats``), so the engine never pays for metrics. A window keeps the last values
and its count says how many there have been in all, so a reader takes only new ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trae_groups.engine.protocol import Window
from trae_groups.engine.sequence import Sequence

WINDOW = 4096  # recent values kept per window


def _window() -> deque:
    return deque(maxlen=WINDOW)


@dataclass
class LLMCounters:
    steps: int = 0
    generated: int = 0  # tokens sampled
    prompt_tokens: int = 0  # of requests that got their first token
    cached_tokens: int = 0  # of those, served by the prefix cache
    deadline_drops: int = 0  # sequences ended because their deadline passed
    started: int = 0  # requests a step took for the first time
    first_tokens: int = 0
    itl_count: int = 0
    batch_tokens: deque[int] = field(default_factory=_window)  # tokens per step
    # seconds from submit to the first step that took each request
    queue_waits: deque[float] = field(default_factory=_window)
    # time to first token: submit to the step that sampled it (the one definition)
    ttft: deque[float] = field(default_factory=_window)
    # inter-token latency: between two tokens of one sequence
    itl: deque[float] = field(default_factory=_window)

    def step(self, num_tokens: int) -> None:
        self.steps += 1
        self.batch_tokens.append(num_tokens)

    def first_scheduled(self, seq: Sequence, now: float) -> None:
        """``now`` (monotonic): a step takes ``seq`` for the first time."""
        seq.first_scheduled = now
        self.queue_waits.append(now - seq.arrival)
        self.started += 1

    def token(self, seq: Sequence, now: float) -> None:
        """``seq`` got a token at the end of the step that ended at ``now`` (monotonic)."""
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.ttft.append(now - seq.arrival)
            self.first_tokens += 1
            self.prompt_tokens += len(seq.prompt_token_ids)
            self.cached_tokens += seq.num_cached_tokens
        else:
            self.itl.append(now - seq.last_token_time)
            self.itl_count += 1
        seq.last_token_time = now
        self.generated += 1

    def windows(self) -> dict[str, Window]:
        return {
            "queue_seconds": Window(tuple(self.queue_waits), self.started),
            "ttft_seconds": Window(tuple(self.ttft), self.first_tokens),
            "itl_seconds": Window(tuple(self.itl), self.itl_count),
            "batch_tokens": Window(tuple(self.batch_tokens), self.steps),
        }
