"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

A request is turned into the chat request it means (``input`` as text or messages,
``instructions`` as the system message first, ``tools`` and ``tool_choice``,
``text.format`` as ``response_format``, ``max_output_tokens``) and runs through
``chat_call``, the same engine call as ``/v1/chat/completions``; its reply comes back
as ``message`` and ``function_call`` output items, whole or as Responses events
(``response.created``, ``response.output_text.delta``, ``response.completed``, ...).

Stateless: ``store: true``, ``previous_response_id``, ``background`` and
``conversation`` are refused with a 422 naming the field (nothing is kept to refer to).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trae_groups.engine.protocol import new_request_id
from trae_groups.graphs.errors import first_error
from trae_groups.serving.app_state import AppState
from trae_groups.serving.http_errors import HTTPError, error_body
from trae_groups.serving.http_io import Emit, read_json, sse, until_disconnect
from trae_groups.serving.openai_api import (
    ChatCompletionRequest,
    _Body,
    _collect,
    _Limit,
    _parse,
    _Piece,
    _scope,
    chat_call,
    started,
)
from trae_groups.serving.run_scope import CLIENT_GONE, RunScope


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = InputMessage | FunctionCallItem | FunctionCallOutput


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "output"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat = TextFormat()


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = Field(None, description="stateless: only false")
    previous_response_id: None = Field(None, description="stateless: not supported")
    background: Literal[False] | None = Field(None, description="not supported")
    conversation: None = Field(None, description="stateless: not supported")

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("needs at least one item")
        return value

    def messages(self) -> list[dict]:
        """``instructions`` and ``input`` as chat messages."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, InputMessage):
                content = item.content
                text = content if isinstance(content, str) else "".join(p.text for p in content)
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def as_chat(self) -> dict:
        """The chat request body this request means (fields left out keep the chat
        route's defaults)."""
        chat: dict[str, Any] = {"model": self.model, "messages": self.messages()}
        fields = {"max_tokens": self.max_output_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "user": self.user}  # fmt: skip
        chat.update({k: v for k, v in fields.items() if v is not None})
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(
                    include={"name", "description", "parameters"}, exclude_none=True)}
                for t in self.tools
            ]  # fmt: skip
        if isinstance(self.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_ or {}}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        return chat


# the chat request's fields as this route names them (for a 422's param)
_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
          "response_format": "text.format", "tools": "tools", "tool_choice": "tool_choice"}  # fmt: skip


def _chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body.as_chat())
    except ValidationError as exc:
        where, message = first_error(exc)
        raise HTTPError(422, f"{where}: {message}", field=where, type="InvalidRequest") from None


def _renamed(field: str | None) -> str | None:
    if not field:
        return field
    head, dot, rest = field.partition(".")
    return _NAMES.get(head, head) + (dot + rest if head != "response_format" else "")


async def create(request: Request) -> Response:
    """A 422 from the chat path names this route's field (``text.format``, not
    ``response_format``)."""
    try:
        return await _create(request)
    except HTTPError as exc:
        renamed = _renamed(exc.field)
        if exc.field and renamed != exc.field and exc.message.startswith(exc.field):
            exc.message = renamed + exc.message[len(exc.field) :]
        exc.field = renamed
        raise


async def _create(request: Request) -> Response:
    state: AppState = request.app.state.trae
    body = _parse(ResponsesRequest, await read_json(request, state.config.max_body_bytes))
    target, start, reading = chat_call(request, state, _chat_body(body))
    shape = _Response(new_request_id("resp"), target.id, int(time.time()), body)
    async with _scope(state, target, "responses", request) as run:
        limit = _Limit(state.config.openai_timeout_s)
        call = started(run, start)
        run.closing(call.close)
        await limit.within(call.open)
        if body.stream:
            return run.stream(_events(run, call, shape, reading, limit))
        pieces, gone = await until_disconnect(
            request.receive, lambda: limit.within(lambda: _collect(call))
        )
        if gone:
            return Response(status_code=CLIENT_GONE)  # the scope records the 499
        run.succeeded(call.result)
        text = "".join(p.text for p in pieces)
        last = pieces[-1] if pieces else _Piece(finish_reason="stop")
        finish = last.finish_reason or "stop"
        if reading is None:
            message = {"content": text}
        else:
            message, finish = reading.message(text, finish)
        return JSONResponse(shape.whole(message, finish, last))


class _Response:
    """The Responses objects of one request: its output items and the response."""

    def __init__(self, id: str, model: str, created: int, body: ResponsesRequest):
        self.id, self.model, self.created, self.body = id, model, created, body
        self.message_id = f"msg_{id.removeprefix('resp-')}"

    def response(self, status: str, output: list[dict], last: _Piece | None = None) -> dict:
        body = self.body
        usage = None
        if last is not None:
            usage = {
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": last.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": last.prompt_tokens + last.completion_tokens,
            }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": _dump(body.tool_choice) or "auto", "parallel_tool_calls": True,
            "text": {"format": _dump(body.text.format if body.text else None) or {"type": "text"}},
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens, "previous_response_id": None,
            "store": False, "metadata": body.metadata or {},
        }  # fmt: skip

    def text_item(self, text: str, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": [part]}  # fmt: skip

    def whole(self, message: dict, finish: str, last: _Piece) -> dict:
        status = "incomplete" if finish == "length" else "completed"
        output = [self.text_item(message["content"], status)] if message.get("content") else []
        output += [_call_item(c, status) for c in message.get("tool_calls") or []]
        return self.response(status, output, last)


def _dump(value: Any) -> Any:
    return (
        value.model_dump(by_alias=True, exclude_none=True)
        if hasattr(value, "model_dump")
        else value
    )


def _call_item(call: dict, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}  # fmt: skip


def _events(run: RunScope, call, shape: _Response, reading, limit: _Limit):
    """The streamed answer as Responses events, each numbered."""

    async def produce(emit: Emit) -> None:
        events = _EventWriter(emit, shape)
        deltas = reading.streaming() if reading else None
        last = _Piece()

        async def on_piece(piece: _Piece) -> None:
            nonlocal last
            last = piece
            if piece.text:
                for delta in deltas.feed(piece.text) if deltas else [{"content": piece.text}]:
                    await events.delta(delta)

        try:
            await events.send("response.created", response=shape.response("in_progress", []))
            await events.send("response.in_progress", response=shape.response("in_progress", []))
            await limit.within(lambda: call.run(on_piece))
            finish = last.finish_reason or "stop"
            if deltas:
                rest, finish = deltas.end(finish)
                for delta in rest:
                    await events.delta(delta)
            status = "incomplete" if finish == "length" else "completed"
            output = await events.close(status)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            await events.send(kind, response=shape.response(status, output, last))
            run.succeeded(call.result)
        except Exception as exc:
            run.failed(exc)
            error = error_body(exc, openai=True)["error"]
            await events.send("error", code=error.get("code"), message=error["message"],
                              param=error.get("param"))  # fmt: skip

    return produce


class _EventWriter:
    """Writes one response's events in order: items open as their first delta comes
    and close at the end."""

    def __init__(self, emit: Emit, shape: _Response):
        self.emit, self.shape = emit, shape
        self.number = 0
        self.text: str | None = None  # the message item's text, once it opened
        self.text_index = -1
        self.calls: dict[int, dict] = {}  # call index -> its item, as it grows
        self.order: list[tuple[str, int]] = []  # ("text", 0) / ("call", i), by output index

    async def send(self, kind: str, **fields: Any) -> None:
        await self.emit(sse(kind, {"type": kind, "sequence_number": self.number, **fields}))
        self.number += 1

    async def delta(self, delta: dict) -> None:
        if delta.get("content"):
            await self._text(delta["content"])
        for piece in delta.get("tool_calls") or []:
            await self._call(piece)

    async def _text(self, piece: str) -> None:
        ids = {"item_id": self.shape.message_id}
        if self.text is None:
            self.text, self.text_index = "", len(self.order)
            self.order.append(("text", 0))
            item = {**self.shape.text_item("", "in_progress"), "content": []}
            await self.send("response.output_item.added", output_index=self.text_index, item=item)
            await self.send("response.content_part.added", **ids, output_index=self.text_index,
                            content_index=0, part=_part(""))  # fmt: skip
        self.text += piece
        await self.send("response.output_text.delta", **ids, output_index=self.text_index,
                        content_index=0, delta=piece, logprobs=[])  # fmt: skip

    async def _call(self, piece: dict) -> None:
        index = piece["index"]
        if index not in self.calls:
            call = {"id": piece["id"], "function": {**piece["function"], "arguments": ""}}
            self.calls[index] = _call_item(call, "in_progress")
            self.order.append(("call", index))
            await self.send("response.output_item.added", output_index=len(self.order) - 1,
                            item=self.calls[index])  # fmt: skip
        arguments = piece["function"].get("arguments") or ""
        if arguments:
            item = self.calls[index]
            item["arguments"] += arguments
            await self.send("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self._index("call", index), delta=arguments)  # fmt: skip

    def _index(self, kind: str, index: int) -> int:
        return self.order.index((kind, index))

    async def close(self, status: str) -> list[dict]:
        """Every open item done; the output list."""
        output = []
        for at, (kind, index) in enumerate(self.order):
            if kind == "text":
                ids = {"item_id": self.shape.message_id, "output_index": at, "content_index": 0}
                await self.send("response.output_text.done", **ids, text=self.text, logprobs=[])
                await self.send("response.content_part.done", **ids, part=_part(self.text))
                item = self.shape.text_item(self.text, status)
            else:
                item = {**self.calls[index], "status": status}
                await self.send("response.function_call_arguments.done", item_id=item["id"],
                                output_index=at, arguments=item["arguments"])  # fmt: skip
            await self.send("response.output_item.done", output_index=at, item=item)
            output.append(item)
        return output


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def routes() -> list[Route]:
    return [Route("/v1/responses", create, methods=["POST"])]
