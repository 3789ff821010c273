"""EncoderWorker: one encoder backbone (one or more heads) behind a dynamic batcher.

Any thread calls ``submit`` and gets a ``concurrent.futures.Future``; the engine
thread calls ``step``, which takes a batch (similar lengths, oldest first), holds
pages of the unified memory pool for its working memory while it runs, and resolves
every item's future with that item's own result. Items with the same text in one
batch share one row, so a classify node and a tag node on one shared backbone run
the backbone once for that text. A batch holds texts or (query, document) pairs for
a rerank head, never both. A bad item fails only its own future.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch

from trae_groups.engine.batcher import BatcherConfig, DynamicBatcher
from trae_groups.engine.deadlines import Priority, due, expired
from trae_groups.engine.encoder_runner import PAIR_TASKS, Encoded, EncoderRunner, Text, check_text
from trae_groups.engine.errors import (
    DeadlineExceeded,
    EngineStopped,
    RequestAborted,
    RequestError,
)
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.protocol import EncodeOptions, ModelStats, Window
from trae_groups.engine.weights import LoadedModel
from trae_groups.engine.worker import Urgency, Worker

log = logging.getLogger("trae_groups.engine")
_BLOCKED_RETRY_S = 0.002  # pool full: try again this much later (LLM steps free pages)


@dataclass(eq=False)
class EncoderItem:
    text: Text
    heads: tuple[str, ...]
    many: bool  # the caller asked for several heads: result is {head: result}
    options: EncodeOptions
    request_id: str
    priority: Priority
    queued_at: float
    length: int  # estimated tokens, for length bucketing
    future: Future = field(default_factory=Future)


def estimate_tokens(text: Text, max_length: int) -> int:
    """About four UTF-8 bytes per token plus specials; only used to bucket lengths."""
    size = sum(len(t.encode()) for t in text) if isinstance(text, tuple) else len(text.encode())
    return min(max_length, size // 4 + 2)


class EncoderWorker(Worker):
    def __init__(
        self,
        name: str,
        model: LoadedModel | Mapping[str, LoadedModel],
        *,
        batcher: BatcherConfig | None = None,
        pool: MemoryPool | None = None,
        wake: Callable[[], None] | None = None,
        activation_factor: int = 8,
    ):
        self.name = name
        self.runner = EncoderRunner(model)
        self.batcher: DynamicBatcher[EncoderItem] = DynamicBatcher(batcher or BatcherConfig())
        self.pool = pool
        self._wake = wake or (lambda: None)
        self._factor = activation_factor
        self._lock = threading.Lock()
        self._inflight: list[EncoderItem] = []
        self._blocked_until = 0.0
        self._closed = False
        self.batches = 0
        self.items_done = 0
        self.batch_sizes: Counter[int] = Counter()
        self.padded_tokens = 0
        self.real_tokens = 0
        self.pool_shrinks = 0
        self.peak_pages = 0
        self.deadline_drops = 0  # items failed unrun because their deadline passed
        # seconds each item waited from submit to its batch's start (recent window;
        # num_started counts them all, so a reader can tell which ones are new)
        self.queue_waits: deque[float] = deque(maxlen=4096)
        self.num_started = 0

    @property
    def owner(self) -> str:
        return f"encoder:{self.name}"

    # -- any thread ------------------------------------------------------------------
    def submit(
        self,
        text: Text,
        *,
        head: str | Sequence[str] | None = None,
        request_id: str = "",
        priority: Priority | None = None,
        options: EncodeOptions = EncodeOptions(),
    ) -> Future:
        """Queue one text (a (query, document) pair for a rerank head); the future
        resolves to the head's result (or, when ``head`` is a sequence, to
        ``{head: result}``). Bad input raises RequestError here, before any work."""
        heads = (head,) if isinstance(head, str) or head is None else tuple(head)
        heads = tuple(h or self.runner.default_head for h in heads)
        pair = {task in PAIR_TASKS for task in self.runner.tasks(heads)}
        if len(pair) > 1:
            raise RequestError("head", "a pair task and a text task cannot share one item")
        text = check_text(text, pair.pop())
        item = EncoderItem(
            text=text,
            heads=heads,
            many=not (isinstance(head, str) or head is None),
            options=options,
            request_id=request_id,
            priority=priority or Priority(),
            queued_at=time.monotonic(),
            length=estimate_tokens(text, self.runner.primary.max_length),
        )
        with self._lock:
            if self._closed:
                raise EngineStopped(f"encoder worker {self.name!r} is closed")
            self.batcher.add(item)
        self._wake()
        return item.future

    def abort(self, request_id: str) -> None:
        with self._lock:
            gone = self.batcher.remove(lambda it: it.request_id == request_id)
            gone += [it for it in self._inflight if it.request_id == request_id]
        for item in gone:
            _fail(item, RequestAborted(f"request {request_id!r} was aborted"))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            gone = self.batcher.remove(lambda it: True)
        for item in gone:
            _fail(item, EngineStopped(f"encoder worker {self.name!r} stopped"))

    def stats(self) -> dict:
        with self._lock:
            queue = len(self.batcher)
        return {
            "name": self.name,
            "batches": self.batches,
            "items": self.items_done,
            "batch_sizes": dict(sorted(self.batch_sizes.items())),
            "queue": queue,
            "padding_ratio": self.padded_tokens / self.real_tokens if self.real_tokens else 0.0,
            "pool_shrinks": self.pool_shrinks,
            "peak_pages": self.peak_pages,
            "deadline_drops": self.deadline_drops,
        }

    def model_stats(self) -> ModelStats:
        """The typed form of ``stats()`` that the layers above read."""
        s = self.stats()
        with self._lock:
            running = len(self._inflight)
        keys = ("batches", "items", "padding_ratio", "pool_shrinks", "deadline_drops")
        counters = {k: float(s[k]) for k in keys}
        return ModelStats(
            self.name,
            "encoder",
            running=running,
            waiting=s["queue"],
            counters=counters,
            windows={"queue_seconds": Window(tuple(self.queue_waits), self.num_started)},
            batch_sizes=s["batch_sizes"],
        )

    # -- engine loop -----------------------------------------------------------------
    def urgency(self, now: float) -> Urgency | None:
        with self._lock:
            if now < self._blocked_until or not self.batcher.ready(now):
                return None
            timeout = self.batcher.config.timeout
            return max(
                Urgency.of(now >= it.queued_at + timeout, it.priority).for_policy(self.policy)
                for it in self.batcher
            )

    def next_wakeup(self, now: float) -> float | None:
        with self._lock:
            if not len(self.batcher):
                return None
            deadline = self.batcher.next_deadline() or now
            return max(deadline, self._blocked_until)

    def step(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = self.batcher.remove(lambda it: expired(it.priority, time.time()))
            first = _due if self.policy == "deadline" else None  # else the oldest
            items = [it for it in self.batcher.take(now, first=first) if not it.future.done()]
            items, later = _one_shape(items)
            if later:
                self.batcher.put_back(later)
            self._inflight = items  # abort() sees them from here on
        self.deadline_drops += len(late)
        for item in late:
            _fail(item, DeadlineExceeded(f"request {item.request_id!r} passed its deadline"))
        if not items:
            return
        pages: list[int] = []
        try:
            items, encoded, pages = self._fit_in_pool(items)
            if items:
                self._run(items, encoded)
        except Exception:  # tokenizing the batch failed: find the item that breaks
            log.exception("%s: batch failed before running; running its items alone", self.name)
            with self._lock:
                mine = list(self._inflight)
            for item in mine:
                if item.future.running() or _mark_running(item):
                    self._run_alone(item)
        finally:
            if pages:
                self.pool.release(pages)
            with self._lock:
                self._inflight = []

    # -- step, one job each ----------------------------------------------------------
    def _rows(self, items: list[EncoderItem]) -> tuple[list[str], list[int]]:
        """Unique texts of the batch and, per item, its row."""
        rows: dict[str, int] = {}
        for it in items:
            rows.setdefault(it.text, len(rows))
        return list(rows), [rows[it.text] for it in items]

    def _pages_for(self, encoded: Encoded) -> int:
        batch, seq = encoded.shape
        config = self.runner.primary.config
        heads = int(getattr(config, "num_attention_heads", 1))
        itemsize = torch.empty((), dtype=self.runner.primary.dtype).element_size()
        per_batch = batch * seq * (self.runner.hidden_size * self._factor + heads * seq)
        return math.ceil(per_batch * itemsize / self.pool.page_bytes)

    def _fit_in_pool(
        self, items: list[EncoderItem]
    ) -> tuple[list[EncoderItem], Encoded | None, list[int]]:
        """Encode the batch and hold pool pages for it, halving the batch while the
        pool has no room; no room even for one item defers the batch a moment."""
        while True:
            texts, _ = self._rows(items)
            encoded = self.runner.encode(texts)
            if self.pool is None:
                return self._start(items), encoded, []
            need = self._pages_for(encoded)
            pages = self.pool.allocate(self.owner, need)
            if pages is not None:
                self.peak_pages = max(self.peak_pages, len(pages))
                return self._start(items), encoded, pages
            if need > self.pool.num_pages and len(items) == 1:
                log.warning(
                    "%s: one item needs %d pages > pool; running unaccounted", self.name, need
                )
                return self._start(items), encoded, []
            keep = len(items) // 2
            with self._lock:
                self.batcher.put_back(items[keep:] if keep else items)
                self._inflight = items[:keep]
                if not keep:
                    self._blocked_until = time.monotonic() + _BLOCKED_RETRY_S
            if not keep:
                return [], None, []
            self.pool_shrinks += 1
            items = items[:keep]

    def _start(self, items: list[EncoderItem]) -> list[EncoderItem]:
        started = [it for it in items if _mark_running(it)]
        now = time.monotonic()
        self.queue_waits.extend(now - it.queued_at for it in started)
        self.num_started += len(started)
        return started

    def _run(self, items: list[EncoderItem], encoded: Encoded) -> None:
        texts, rows = self._rows(items)
        if len(texts) != len(encoded.texts):  # some items were cancelled meanwhile
            encoded = self.runner.encode(texts)
        heads = sorted({h for it in items for h in it.heads})
        try:
            outputs = self.runner.forward(encoded, heads)
        except Exception:
            log.exception(
                "%s: batch of %d failed; running its items one by one", self.name, len(items)
            )
            outcomes = [self._alone(item) for item in items]
        else:
            outcomes = [
                _attempt(lambda it=item, r=row: self._results(it, outputs, encoded, r))
                for item, row in zip(items, rows, strict=True)
            ]
        # counted before any future resolves: a caller that has its results sees them counted
        self._count(items, encoded)
        for item, outcome in zip(items, outcomes, strict=True):
            _settle(item, outcome)

    def _run_alone(self, item: EncoderItem) -> None:
        _settle(item, self._alone(item))

    def _alone(self, item: EncoderItem) -> tuple[Any, BaseException | None]:
        def work() -> Any:
            encoded = self.runner.encode([item.text])
            return self._results(item, self.runner.forward(encoded, list(item.heads)), encoded, 0)

        return _attempt(work)

    def _results(self, item: EncoderItem, outputs: dict, encoded: Encoded, row: int) -> Any:
        results = {
            h: self.runner.result(h, outputs[h], encoded, row, item.options) for h in item.heads
        }
        return results if item.many else results[item.heads[0]]

    def _count(self, items: list[EncoderItem], encoded: Encoded) -> None:
        batch, seq = encoded.shape
        self.batches += 1
        self.items_done += len(items)
        self.batch_sizes[len(items)] += 1
        self.padded_tokens += batch * seq
        self.real_tokens += int(encoded.inputs["attention_mask"].sum())


def _due(item: EncoderItem) -> float:
    """A batch is built around the item due first (the oldest among equals)."""
    return due(item.priority)


def _one_shape(items: list[EncoderItem]) -> tuple[list[EncoderItem], list[EncoderItem]]:
    """A batch is texts or (query, document) pairs, never both (heads of both kinds
    can share a backbone): the oldest item's kind runs now, the others next."""
    if not items:
        return items, []
    pair = isinstance(items[0].text, tuple)
    now = [it for it in items if isinstance(it.text, tuple) == pair]
    return now, [it for it in items if isinstance(it.text, tuple) != pair]


def _mark_running(item: EncoderItem) -> bool:
    """False when the caller cancelled it or abort() failed it meanwhile."""
    try:
        return item.future.set_running_or_notify_cancel()
    except RuntimeError:  # already finished (aborted)
        return False


def _attempt(work: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``work()``'s value, or the exception it raised (the item's, not the batch's)."""
    try:
        return work(), None
    except Exception as exc:
        return None, exc


def _settle(item: EncoderItem, outcome: tuple[Any, BaseException | None]) -> None:
    value, exc = outcome
    if exc is not None:
        _fail(item, exc)
        return
    with contextlib.suppress(InvalidStateError):  # aborted while it ran
        item.future.set_result(value)


def _fail(item: EncoderItem, exc: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):  # already resolved, failed or cancelled
        item.future.set_exception(exc)
