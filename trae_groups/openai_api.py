"""OpenAI-compatible endpoints, so stock clients work: ``POST /v1/chat/completions``,
``POST /v1/completions`` (streamed or not) and ``GET /v1/models``.

What ``model`` names (GET /v1/models lists every id):

1. A **chat graph**, by the graph's name: a graph with exactly one input of type
   ``messages`` (every other input optional) and exactly one output that reads a
   generate node's ``text`` (``reply.text``). The request's messages become that
   input; only that output is computed; its tokens stream as they are generated.
   The graph's own node parameters apply (sampling fields of the request do not).
2. An **LLM of a served graph** as ``graph/model`` (the graph's name for the model).
3. The **bare model name**, when it reaches one LLM across every served graph and no
   graph has that name (a graph's name wins; ``graph/model`` always works).

Requests count against the named graph's in-flight limit. Completions take an LLM
only. Unsupported options (``n`` > 1, penalties, logprobs, echo) are a 422 that names
the field, never silently ignored; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trae_groups.app_state import CLIENT_GONE, AppState, ServedGraph
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.worker import Priority
from trae_groups.graphs.executor import Event
from trae_groups.graphs.spec import GenerateNode, GraphSpec
from trae_groups.http_errors import HTTPError, bad_request, error_body, not_found, status_of
from trae_groups.http_io import Emit, EventStream, read_json, sse, until_disconnect

MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1
UNLIMITED = 2**31 - 1  # max_tokens when none is asked: the model's length stops it


# ---------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="extension: 0 = off")
    min_p: float = Field(0.0, ge=0, lt=1, description="extension")
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="extension")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0, le=0, description="not supported: 0 only")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="not supported: 0 only")
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = Field(None, description="not supported")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = Field(False, description="not supported")
    logprobs: None = Field(None, description="not supported")
    suffix: None = Field(None, description="not supported")


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = f"{where}: {first['msg']}" if where else first["msg"]
        raise HTTPError(422, message, field=where, type="InvalidRequest") from None


# ---------------------------------------------------------------- what `model` names


@dataclass(frozen=True)
class Target:
    """What one ``model`` id reaches: a served graph, and an LLM of it or the graph."""

    id: str
    served: ServedGraph
    model: str | None = None  # an LLM: the graph's name for it
    messages_input: str | None = None  # a chat graph: where messages go
    output: str | None = None  # a chat graph: the output returned
    node: str | None = None  # a chat graph: the generate node that output reads


def chat_parts(spec: GraphSpec) -> tuple[str, str, str] | None:
    """(messages input, text output, its generate node) when the graph serves chat."""
    messages = [name for name, i in spec.inputs.items() if i.type == "messages"]
    if len(messages) != 1:
        return None
    if any(not i.optional for name, i in spec.inputs.items() if name != messages[0]):
        return None
    texts = []
    for output, reference in spec.outputs.items():
        node, _, rest = reference.partition(".")
        if rest == "text" and isinstance(spec.nodes.get(node), GenerateNode):
            texts.append((output, node))
    if len(spec.outputs) != 1 or len(texts) != 1:
        return None
    return messages[0], texts[0][0], texts[0][1]


def targets(graphs: Mapping[str, ServedGraph]) -> dict[str, Target]:
    """Every id ``model`` may take now, by the rule in this module's docstring."""
    found: dict[str, Target] = {}
    for served in graphs.values():
        parts = chat_parts(served.spec)
        if parts and served.executor is not None:
            found[served.name] = Target(served.name, served, None, *parts)
    bare: dict[str, list[tuple[str, Target]]] = {}
    for served in graphs.values():
        if served.executor is None:
            continue
        for model, spec in served.spec.models.items():
            if spec.task != "generate":
                continue
            target = Target(f"{served.name}/{model}", served, model)
            found[target.id] = target
            worker = served.executor.clients[model].worker.name
            bare.setdefault(model, []).append((worker, target))
    for model, entries in bare.items():
        if model not in found and len({worker for worker, _ in entries}) == 1:
            found[model] = Target(model, entries[0][1].served, model)
    return found


def resolve(state: AppState, name: str) -> Target:
    state.require_ready()
    found = targets(state.graphs)
    if name in found:
        return found[name]
    hint = ""
    if any(t.id.endswith(f"/{name}") for t in found.values()):
        hint = f"; '{name}' is ambiguous, name it as graph/{name}"
    raise not_found(f"unknown model '{name}'{hint}; GET /v1/models lists them", field="model")


# ---------------------------------------------------------------- endpoints


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.trae
    data = [
        {
            "id": target.id,
            "object": "model",
            "created": state.created,
            "owned_by": "trae-groups",
            "trae": {"graph": target.served.name, "kind": "llm" if target.model else "graph"},
        }
        for target in targets(state.graphs).values()
    ]
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.trae
    body = _parse(ChatCompletionRequest, await read_json(request, state.config.max_body_bytes))
    target = resolve(state, body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    if target.model is None:
        target.served.executor.validate_inputs({target.messages_input: messages})
        start = _GraphCall.factory(target, messages)
    else:
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = _params(body, max_tokens)
        start = _LLMCall.factory(target, params, messages=messages, user=body.user)
    return await _respond(request, state, target, body, start, chat=True)


async def completions(request: Request) -> Response:
    state: AppState = request.app.state.trae
    body = _parse(CompletionRequest, await read_json(request, state.config.max_body_bytes))
    target = resolve(state, body.model)
    if target.model is None:
        raise HTTPError(422, f"'{target.id}' is a graph: use /v1/chat/completions", field="model")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise HTTPError(422, "prompt: one prompt per request", field="prompt")
        prompt = prompt[0]
    params = _params(body, body.max_tokens)
    start = _LLMCall.factory(target, params, prompt=prompt, user=body.user)
    return await _respond(request, state, target, body, start, chat=False)


def _version(model: Any, user: str | None) -> Any:
    """The client of the version the model's route picks; OpenAI's ``user`` is the
    sticky key when the model routes sticky."""
    inputs = {model.sticky: user} if model.sticky and user is not None else {}
    return model.clients[model.choose(inputs)]


def _params(body: _Sampling, max_tokens: int | None) -> SamplingParams:
    """Checked now, before admission (RequestError is a 422). No max_tokens: the
    model's length is the limit."""
    return SamplingParams(
        max_tokens=max_tokens or UNLIMITED,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=body.stops(),
    )


# ---------------------------------------------------------------- one call, two kinds


@dataclass
class _Piece:
    """What a call hands on as it goes: text deltas, then the end."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


OnPiece = Callable[[_Piece], Awaitable[None]]


class _LLMCall:
    """A prompt on one LLM of the engine, its outputs turned into pieces."""

    def __init__(self, state: AppState, target: Target, client: Any, prompt, params):
        self.state, self.target = state, target
        self.request_id = f"cmpl-{uuid.uuid4().hex[:16]}"
        self.model = client.worker.name
        self.stream = client.generate(
            prompt, params, request_id=self.request_id, priority=Priority()
        )  # RequestError (a 422) is raised here, before any work

    @classmethod
    def factory(
        cls, target: Target, params: SamplingParams, *, prompt=None, messages=None, user=None
    ):
        """Submits when called with the executor the request was admitted on."""

        def start(state: AppState, executor: Any) -> _LLMCall:
            client = _version(executor.models[target.model], user)
            text = client.chat_prompt(messages) if messages is not None else prompt
            return cls(state, target, client, text, params)

        return start

    def close(self) -> None:
        self.stream.abort()  # no-op once finished

    async def run(self, on_piece: OnPiece) -> None:
        last_time = None
        metrics = self.state.metrics
        async for out in self.stream:
            if out.error:
                raise HTTPError(500, f"generation failed: {out.error}", type="GenerationFailed")
            now = time.monotonic()
            if out.delta_token_ids:
                first = out.metrics.get("first_token_time")
                if last_time is None and first is not None:
                    metrics.ttft.labels(self.model).observe(first - out.metrics["arrival"])
                elif last_time is not None:
                    metrics.itl.labels(self.model).observe(now - last_time)
                last_time = now
            if out.finished and out.finish_reason == "abort":
                raise HTTPError(503, "generation was aborted", type="Aborted")
            await on_piece(
                _Piece(
                    out.delta_text,
                    out.finish_reason if out.finished else None,
                    len(out.prompt_token_ids),
                    len(out.token_ids),
                )
            )


class _GraphCall:
    """A chat graph run: the text output's node streams; the result ends it."""

    def __init__(self, state: AppState, target: Target, executor: Any, messages: list[dict]):
        self.state, self.target, self.executor = state, target, executor
        self.inputs = {target.messages_input: messages}
        self.request_id = f"chatcmpl-{uuid.uuid4().hex[:16]}"

    @classmethod
    def factory(cls, target: Target, messages: list[dict]):
        return lambda state, executor: cls(state, target, executor, messages)

    def close(self) -> None:
        pass  # the run lives inside run(): leaving it cancels the graph run

    async def run(self, on_piece: OnPiece) -> None:
        served, node, executor = self.target.served, self.target.node, self.executor
        clock = self.state.metrics.token_clock(served.nodes)
        send, receive = anyio.create_memory_object_stream[Event](math.inf)
        outcome: dict[str, Any] = {}
        start = time.perf_counter()

        def sink(event: Event) -> None:
            clock(event)
            if event.type == "token" and event.data.get("node") == node:
                send.send_nowait(event)

        async def run_graph() -> None:
            with send:
                try:
                    outcome["result"] = await executor.run(
                        self.inputs,
                        outputs=[self.target.output],
                        on_event=sink,
                        request_id=self.request_id,
                        timeout=served.spec.timeout,
                    )
                except Exception as exc:
                    outcome["error"] = exc

        streamed = []
        try:
            async with anyio.create_task_group() as group, receive:
                group.start_soon(run_graph)
                async for event in receive:
                    streamed.append(event.data.get("text", ""))
                    await on_piece(_Piece(streamed[-1]))
        except BaseException:
            self.state.record(served, start, None)  # the client left
            raise
        if "error" in outcome:
            self.state.record(served, start, None, outcome["error"])
            raise outcome["error"]
        self.state.record(served, start, outcome["result"])
        text, sent = outcome["result"].outputs.get(self.target.output) or "", "".join(streamed)
        rest = text[len(sent) :] if text.startswith(sent) else ""
        usage = outcome["result"].nodes[node].usage
        await on_piece(
            _Piece(
                rest,
                "length" if usage.get("finish_reason") == "length" else "stop",
                usage.get("prompt_tokens", 0),
                usage.get("tokens", clock.tokens.get(node, 0)),
            )
        )


# ---------------------------------------------------------------- responses


async def _respond(request: Request, state: AppState, target, body, start, *, chat: bool):
    """Admit, start the call, and answer: one JSON object, or SSE chunks then [DONE]."""
    endpoint = "chat" if chat else "completions"
    ticket = state.admit(target.served)
    try:
        call = start(state, ticket.executor)
    except Exception as exc:
        ticket.release()
        _count(state, endpoint, target, status_of(exc))
        raise
    shape = _Shape(call.request_id, target.id, int(time.time()), chat)

    def close() -> None:
        call.close()
        ticket.release()

    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(_stream(state, call, shape, endpoint, usage), close)
    try:
        pieces, gone = await until_disconnect(request.receive, lambda: _collect(call))
    except Exception as exc:
        _count(state, endpoint, target, status_of(exc))
        raise
    finally:
        close()
    if gone:
        _count(state, endpoint, target, CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    _count(state, endpoint, target, 200)
    return JSONResponse(shape.whole(pieces))


def _count(state: AppState, endpoint: str, target: Target, code: int) -> None:
    state.metrics.openai_requests.labels(endpoint, target.id, str(code)).inc()


async def _collect(call) -> list[_Piece]:
    pieces: list[_Piece] = []

    async def keep(piece: _Piece) -> None:
        pieces.append(piece)

    await call.run(keep)
    return pieces


def _stream(state: AppState, call, shape: _Shape, endpoint: str, include_usage: bool):
    async def produce(emit: Emit) -> None:
        last = _Piece()

        async def send(piece: _Piece) -> None:
            nonlocal last
            if piece.text:
                await emit(sse(None, shape.chunk(piece.text)))
            last = piece

        try:
            if shape.chat:
                await emit(sse(None, shape.chunk({"role": "assistant", "content": ""})))
            await call.run(send)
            await emit(sse(None, shape.chunk(None, last.finish_reason or "stop")))
            if include_usage:
                await emit(sse(None, {**shape.chunk(None), "choices": [], "usage": _usage(last)}))
            _count(state, endpoint, call.target, 200)
        except Exception as exc:
            _count(state, endpoint, call.target, status_of(exc))
            await emit(sse(None, error_body(exc, openai=True)))
        await emit(sse(None, "[DONE]"))

    return produce


def _usage(last: _Piece) -> dict:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }


@dataclass(frozen=True)
class _Shape:
    """The OpenAI response objects of one request."""

    id: str
    model: str
    created: int
    chat: bool

    def whole(self, pieces: list[_Piece]) -> dict:
        text = "".join(p.text for p in pieces)
        last = pieces[-1] if pieces else _Piece(finish_reason="stop")
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason or "stop"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(last),
        }

    def chunk(self, delta: dict | str | None, finish_reason: str | None = None) -> dict:
        if self.chat:
            content = {"content": delta} if isinstance(delta, str) else (delta or {})
            choice: dict[str, Any] = {"index": 0, "delta": content}
        else:
            choice = {"index": 0, "text": delta if isinstance(delta, str) else ""}
        choice["finish_reason"] = finish_reason
        choice["logprobs"] = None
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }


# ---------------------------------------------------------------- wiring


def routes() -> list[Route]:
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
