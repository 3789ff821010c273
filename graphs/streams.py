"""Streamed edges: nodes that run on a generate node's text while it is generated.

A ``Feed`` holds one followed node's text for one request. The generate node pushes
each new chunk into it (``NodeCall.on_text``) and never waits: the engine's step loop
and the node's own stream are never blocked by a follower. Each follower reads the
text through a ``Subscription`` that cuts it into pieces at its granularity and keeps
at most ``follows.buffer`` pieces waiting; past that, new text joins the last waiting
piece, so a slow follower sees fewer, longer pieces and never misses text, and the
memory a stream holds stays bounded by its text.

Holding followers (guards) gate what the client sees: the followed node's text is
released, as token events, only up to the end of the last piece every holding
follower has passed. A guard whose ``cut_when`` is true stops the request there
(graphs/executor.py), so text it did not pass never leaves the server.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from trae_groups.graphs.nodes import Follows

#: A sentence ends at . ! ? (and closing quotes or brackets) before white space, or at a
#: line break; a line at a line break. The white space belongs to the piece it ends.
_BOUNDARY = {
    "sentence": re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*\s+|\n+"),
    "line": re.compile(r"\n+"),
}
#: Marks where the followed text ends in a rendered prompt (a private-use character
#: that no model text holds), so the prompt can be cut right after the text so far.
TEXT_END = "\ue000trae-followed-text-end\ue001"


@dataclass
class Piece:
    """Text ``[start, end)`` of the followed node's output; ``index`` counts pieces."""

    index: int
    start: int
    end: int
    tokens: int  # the followed node's tokens up to ``end``
    last: bool = False


class Segmenter:
    """Where one follower's pieces end, as the text grows."""

    def __init__(self, follows: Follows):
        self.follows = follows
        self.start = 0  # where the piece being built starts
        self.start_tokens = 0

    def cut(self, text: str, tokens: int) -> list[tuple[int, int]]:
        """(end, tokens) of every piece the text now completes."""
        f, ends = self.follows, []
        if f.tokens is not None:
            if tokens - self.start_tokens >= f.tokens and len(text) > self.start:
                ends.append(len(text))
        elif f.chars is not None:
            end = self.start + f.chars
            while end <= len(text):
                ends.append(end)
                end += f.chars
        else:
            pattern = _BOUNDARY[f.every]
            for match in pattern.finditer(text, self.start):
                if match.end() < len(text):  # white space may go on in the next chunk
                    ends.append(match.end())
        out = []
        for end in ends:
            if text[self.start : end].strip():  # white space alone joins the next piece
                out.append((end, tokens))
                self.start, self.start_tokens = end, tokens
        return out


class Subscription:
    """One follower's pieces of one feed: bounded, merged when full, never dropped."""

    def __init__(self, follows: Follows):
        self.segmenter = Segmenter(follows)
        self.buffer = follows.buffer
        self.waiting: deque[Piece] = deque()
        self.count = 0
        self.last_end = 0  # where the newest piece ends (the next one starts there)
        self.merged = 0  # pieces that joined a waiting one because the buffer was full
        self.closed = False
        self._ready = anyio.Event()

    def offer(self, text: str, tokens: int, *, last: bool = False) -> None:
        ends = self.segmenter.cut(text, tokens)
        if last and len(text) > self.segmenter.start:
            ends.append((len(text), tokens))
            self.segmenter.start = len(text)
        for end, at_tokens in ends:
            if len(self.waiting) >= self.buffer:
                self.waiting[-1].end, self.waiting[-1].tokens = end, at_tokens
                self.merged += 1
            else:
                self.waiting.append(Piece(self.count, self.last_end, end, at_tokens))
                self.count += 1
            self.last_end = end
        if last:
            if self.waiting:
                self.waiting[-1].last = True
            self.closed = True
        self._ready.set()

    async def pieces(self) -> AsyncIterator[Piece]:
        while True:
            if self.waiting:
                yield self.waiting.popleft()
                continue
            if self.closed:
                return
            self._ready = anyio.Event()
            await self._ready.wait()


class Feed:
    """One followed generate node of one request: its text so far, its followers'
    subscriptions, and the gate that holds text back from the client until every
    holding follower has passed it."""

    def __init__(
        self,
        node: str,
        followers: Mapping[str, Follows],
        holders: set[str],
        emit: Callable[[str, dict], None],
    ):
        self.node = node
        self.text = ""
        self.tokens = 0
        self.finished = False
        self.subscriptions = {name: Subscription(f) for name, f in followers.items()}
        self.passed = {name: 0 for name in holders}  # characters each holder has passed
        self.released = 0
        self._emit = emit
        self.opened = anyio.Event()  # the followed node started, or will not run
        self._all_passed = anyio.Event()
        if not holders:
            self._all_passed.set()

    # -- the followed node's side ------------------------------------------------
    def push(self, text: str, tokens: int) -> None:
        """New text from the generation (never blocks)."""
        self.text += text
        self.tokens += tokens
        for subscription in self.subscriptions.values():
            subscription.offer(self.text, self.tokens)
        self._release()

    def finish(self) -> None:
        """The generation ended: what is left is every follower's last piece."""
        self.finished = True
        for subscription in self.subscriptions.values():
            subscription.offer(self.text, self.tokens, last=True)
        self._release()

    async def wait_passed(self) -> None:
        """Until every holding follower has passed the whole text."""
        await self._all_passed.wait()

    # -- the followers' side ------------------------------------------------------
    def view(self, piece: Piece | None, *, text_end: str = "") -> dict[str, Any]:
        """What a follower's templates read as the followed node (FOLLOWED_FIELDS)."""
        if piece is None:
            return {"text": self.text + text_end, "piece": "", "index": -1, "tokens": self.tokens}
        return {
            "text": self.text[: piece.end] + text_end,
            "piece": self.text[piece.start : piece.end],
            "index": piece.index,
            "tokens": piece.tokens,
        }

    def passed_through(self, holder: str, end: int) -> None:
        self.passed[holder] = max(self.passed[holder], end)
        self._release()

    def stop_holding(self, holder: str) -> None:
        """A holder that will pass nothing more (skipped, or failed with on_error)."""
        if self.passed.pop(holder, None) is not None:
            self._release()

    # -- the gate -----------------------------------------------------------------
    def _release(self) -> None:
        upto = min(self.passed.values(), default=len(self.text))
        if upto > self.released:
            self._emit("token", {"node": self.node, "text": self.text[self.released : upto]})
            self.released = upto
        if self.finished and self.released >= len(self.text):
            self._all_passed.set()


# ---------------------------------------------------------------- running followers


@dataclass(frozen=True)
class Cut:
    """A guard stopped the followed node's stream: nothing after ``safe_text`` was shown."""

    node: str
    follows: str
    index: int
    safe_text: str
    result: dict[str, Any]  # the guard's result: its pieces up to the one that cut

    def body(self) -> dict[str, Any]:
        return {"node": self.node, "follows": self.follows, "piece": self.index}


async def follow_pieces(
    feed: Feed,
    name: str,
    *,
    run_piece: Callable[[dict[str, Any]], Awaitable[Any]],
    should_cut: Callable[[dict[str, Any], Any], bool] | None,
    emit: Callable[[str, dict], None],
) -> dict[str, Any] | Cut:
    """Run a follower once per piece; its result lists every piece's result. Returns a
    Cut when ``should_cut`` (the node's ``cut_when``) is true for a piece."""
    results: list[Any] = []
    holds = name in feed.passed
    async for piece in feed.subscriptions[name].pieces():
        view = feed.view(piece)
        if not view["piece"].strip():  # a last piece of white space: nothing to judge
            if holds:
                feed.passed_through(name, piece.end)
            continue
        value = await run_piece(view)
        results.append(value)
        emit("piece", {"node": name, "follows": feed.node, "index": piece.index, "result": value})
        if should_cut is not None and should_cut(view, value):
            return Cut(name, feed.node, piece.index, feed.text[: feed.released], _result(results))
        if holds:
            feed.passed_through(name, piece.end)
    return _result(results)


def _result(results: list[Any]) -> dict[str, Any]:
    return {"pieces": results, "last": results[-1] if results else None}


async def follow_with_generator(
    feed: Feed,
    name: str,
    *,
    start: Callable[[AsyncIterator[str]], AsyncIterator[Any]],
    should_cut: Callable[[dict[str, Any], Any], bool] | None,
    emit: Callable[[str, dict], None],
) -> dict[str, Any] | Cut:
    """A python follower that is an async generator: it takes the pieces' texts as an
    async iterator and yields values (events); a holder passes a piece when it asks for
    the next one, or ends."""
    holds = name in feed.passed
    current: list[Piece] = []

    async def texts() -> AsyncIterator[str]:
        async for piece in feed.subscriptions[name].pieces():
            if holds and current:
                feed.passed_through(name, current[-1].end)
            current[:] = [piece]
            yield feed.text[piece.start : piece.end]

    results: list[Any] = []
    async for value in start(texts()):
        results.append(value)
        index = current[-1].index if current else -1
        emit("piece", {"node": name, "follows": feed.node, "index": index, "result": value})
        view = feed.view(current[-1] if current else None)
        if should_cut is not None and should_cut(view, value):
            return Cut(name, feed.node, index, feed.text[: feed.released], _result(results))
    return _result(results)


async def prefill_as_text_arrives(
    feed: Feed, name: str, *, prefill: Callable[[dict[str, Any]], Awaitable[None]]
) -> int:
    """A generate follower: for each piece, cache the KV of its prompt so far (one at a
    time; pieces that arrive meanwhile merge), so that when the followed node ends only
    the last piece is left to prefill. Returns how many prefixes it cached."""
    count = 0
    async for piece in feed.subscriptions[name].pieces():
        if piece.last:
            break
        await prefill(feed.view(piece, text_end=TEXT_END))
        count += 1
    return count


def cut_at_text_end(payload: Mapping[str, Any]) -> dict[str, Any] | None:
    """A rendered generate payload cut right after the followed text (TEXT_END): the
    prompt, or the messages up to the one holding it, that one's content cut there.
    None when the mark did not come through the templates (nothing to cache)."""
    prompt = payload.get("prompt")
    if prompt is not None:
        head, found, _ = str(prompt).partition(TEXT_END)
        return {"prompt": head} if found else None
    messages = []
    for message in payload.get("messages") or ():
        head, found, _ = message["content"].partition(TEXT_END)
        messages.append({**message, "content": head})
        if found:
            return {"messages": messages}
    return None
