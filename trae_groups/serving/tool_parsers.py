"""Tool calls out of a model's reply, in the syntax its family writes them, whole or as
the reply streams.

Formats (names in ``trae_groups.engine.chat.TOOL_CALL_FORMATS``, the one list):

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call; text around the blocks is content.
- ``llama3``: the reply is ``{"name": ..., "parameters": {...}}`` (``arguments`` read too),
  after an optional ``<|python_tag|>``, several calls separated by ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; the marker is a
  special token the detokenizer drops, so a reply that starts ``[{`` is read the same.
- ``json``: the reply is one ``{"name": ..., "arguments": {...}}`` (what a forced call's
  constraint writes, and what a model without a known format is read for).

A call is kept only when its name is one of the request's tools; otherwise its text is
content. Arguments are the model's own JSON text, so the streamed pieces join to exactly
the text of the whole answer; a reply cut short (``max_tokens``) keeps the arguments
written so far.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from trae_groups.engine.chat import TOOL_CALL_FORMATS

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class Call:
    """One call as far as the text goes: ``done`` once its JSON object closed."""

    name: str | None
    arguments: str
    done: bool


@dataclass
class Scan:
    """What a reply's text holds so far: content, calls, and how many characters at its
    end are held back (they may open a call)."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)
    held: int = 0


def _call(text: str, start: int) -> tuple[Call, int | None]:
    """The call object that starts at ``text[start]`` ('{'), and the index after it
    (None while it is open)."""
    try:
        _, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        end = None
    body = text[start:end]
    named = _NAME.search(body)
    name = json.loads(f'"{named.group(1)}"') if named else None
    found = _ARGS.search(body)
    if found is None:
        return Call(name, "{}" if end is not None else "", end is not None), end
    at = start + found.end()
    try:
        _, args_end = _DECODER.raw_decode(text, at)
        arguments = text[at:args_end]
    except json.JSONDecodeError:  # still being written: everything after the key is its value
        arguments = text[at:] if end is None else text[at : end - 1].rstrip()
    return Call(name, arguments, end is not None), end


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _hermes(text: str) -> Scan:
    scan, at = Scan(), 0
    while True:
        start = text.find("<tool_call>", at)
        if start < 0:
            rest = text[at:]
            scan.held = _partial_marker(rest, "<tool_call>")
            scan.content += rest
            return scan
        scan.content += text[at:start]
        brace = text.find("{", start)
        if brace < 0:
            scan.held = len(text) - start
            scan.content += text[start:]
            return scan
        call, end = _call(text, brace)
        scan.calls.append(call)
        if end is None:
            return scan
        close = text.find("</tool_call>", end)
        if close < 0:
            return scan
        at = close + len("</tool_call>")
        while at < len(text) and text[at].isspace():
            at += 1  # blanks between calls are not content


def _separated(text: str, start: int, separators: str, closer: str = "") -> Scan:
    """Call objects from ``text[start]`` on, separated by ``separators`` (and blanks),
    up to ``closer`` or the end."""
    scan, at = Scan(), start
    while at < len(text):
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at >= len(text) or (closer and text[at] == closer):
            break
        if text[at] != "{":
            return Scan(content=text)  # not calls after all
        call, end = _call(text, at)
        scan.calls.append(call)
        if end is None:
            break
        at = end
    return scan


def _opening(text: str, marker: str, start: str) -> tuple[int, bool]:
    """Where a reply's calls begin (after ``marker`` or at a leading ``start``), and
    whether it may still turn out to be calls. (-1, False): plain text."""
    lead = len(text) - len(text.lstrip())
    body = text[lead:]
    if body.startswith(marker):
        return lead + len(marker), True
    if not body or marker.startswith(body) or start.startswith(body):
        return -1, True  # too short to say
    return (lead, True) if body.startswith(start) else (-1, False)


def _llama3(text: str) -> Scan:
    at, maybe = _opening(text, "<|python_tag|>", "{")
    if at < 0:
        return Scan(content=text, held=len(text) if maybe else 0)
    return _separated(text, at, ";")


def _mistral(text: str) -> Scan:
    marker = text.find("[TOOL_CALLS]")
    if marker > 0:  # text before the marker is content
        scan = _mistral(text[marker:])
        scan.content = text[:marker] + scan.content
        return scan
    at, maybe = _opening(text, "[TOOL_CALLS]", "[{")
    if at < 0:
        if not maybe:  # plain text, unless a marker may still come
            return Scan(content=text, held=_partial_marker(text, "[TOOL_CALLS]"))
        return Scan(content=text, held=len(text))
    while at < len(text) and text[at].isspace():
        at += 1
    if at >= len(text):
        return Scan()
    if text[at] != "[":
        return Scan(content=text)
    return _separated(text, at + 1, ",", closer="]")


def _json(text: str) -> Scan:
    body = text.lstrip()
    if not body:
        return Scan(content=text, held=len(text))
    if not body.startswith("{"):
        return Scan(content=text)
    found = _separated(text, len(text) - len(body), "")
    return found if len(found.calls) <= 1 else Scan(content=text)


SCANNERS = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral, "json": _json}
assert tuple(SCANNERS) == TOOL_CALL_FORMATS, "one scanner per format"


def scan(fmt: str, text: str, names: set[str], final: bool) -> Scan:
    """The reply's content and calls. A call whose name is known and not one of
    ``names`` makes the reply plain text; at the end (``final``) so does one with no
    name, and nothing is held."""
    found = SCANNERS[fmt](text)
    unknown = [c for c in found.calls if c.name is not None and c.name not in names]
    if unknown or (final and any(c.name is None for c in found.calls)):
        return Scan(content=text)
    if final and found.held:
        found.held = 0
    return found


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(fmt: str, text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """A whole reply as OpenAI's ``message.content`` (None when it is only calls; the
    blanks that end the text before a call dropped) and ``message.tool_calls``."""
    found = scan(fmt, text, names, final=True)
    calls = [
        {"id": call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in found.calls
    ]  # fmt: skip
    if not calls:
        return text, []
    return found.content.rstrip() or None, calls  # blanks before a call are not content


class ToolStream:
    """A streamed reply turned into chat deltas: content as soon as it cannot open a
    call, then per call one delta with its id and name and then pieces of its
    arguments (OpenAI's ``delta.tool_calls[i].function.arguments``)."""

    def __init__(self, fmt: str, names: set[str]):
        self.fmt, self.names = fmt, names
        self.text = ""
        self._content = 0  # content characters sent
        self._sent: list[tuple[str, int]] = []  # per call: its id, argument characters sent

    @property
    def called(self) -> bool:
        return bool(self._sent)

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        """The deltas the text so far allows (``final``: the reply ended)."""
        self.text += piece
        found = scan(self.fmt, self.text, self.names, final)
        if self.called and not found.calls:
            found = SCANNERS[self.fmt](self.text)  # calls already went out: keep them
        deltas: list[dict] = []
        visible = len(found.content) - (0 if final else found.held)
        pending = found.content[self._content : visible]
        if not (final and not found.calls):  # trailing blanks wait: a call may come next
            pending = pending.rstrip()
        if pending:
            deltas.append({"content": pending})
            self._content += len(pending)
        for index, call in enumerate(found.calls):
            if call.name is None or (call.name not in self.names):
                break  # a call goes out once its name is known
            if index == len(self._sent):
                self._sent.append((call_id(), 0))
                deltas.append(_call_delta(index, self._sent[index][0], call.name))
            ident, sent = self._sent[index]
            if len(call.arguments) > sent:
                deltas.append(_args_delta(index, call.arguments[sent:]))
                self._sent[index] = (ident, len(call.arguments))
        return deltas


def _call_delta(index: int, ident: str, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": ident, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}  # fmt: skip


def _args_delta(index: int, piece: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
