"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response fields
(benchmark and evaluation clients count tokens through them).

``/tokenize`` takes a ``prompt`` (``add_special_tokens`` default true, as vLLM's) or chat
``messages`` (the engine's own path: the chat template, what users wrote kept as text;
``add_generation_prompt`` default true, optional ``tools``), and answers
``{count, max_model_len, tokens, token_strs}``. ``/detokenize`` takes ``tokens`` and
answers ``{prompt}``. ``model`` may be left out when one LLM is served.
"""

from __future__ import annotations

from typing import Literal

import anyio
from jinja2 import TemplateError
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trae_groups.engine import chat
from trae_groups.engine.errors import RequestError
from trae_groups.serving import model_files
from trae_groups.serving.app_state import AppState
from trae_groups.serving.http_errors import HTTPError
from trae_groups.serving.http_io import read_json
from trae_groups.serving.openai_api import ChatMessage, Target, _Body, _parse, resolve, targets
from trae_groups.serving.openai_structured import Tool


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt; false for messages (not supported true)"
    )
    add_generation_prompt: bool = True
    continue_final_message: Literal[False] = Field(False, description="not supported")
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _target(state: AppState, model: str | None) -> Target:
    """The named LLM, or the only one served when ``model`` is left out."""
    if model is not None:
        found = resolve(state, model)
    else:
        state.require_ready()
        llms = [t for t in targets(state.graphs).values() if t.kind == "llm" and "/" in t.id]
        if len(llms) != 1:
            ids = ", ".join(t.id for t in llms)
            raise HTTPError(422, f"model: name one of {ids}", field="model")
        found = llms[0]
    if found.model is None or found.task != "generate":
        raise HTTPError(422, f"'{found.id}' is not an LLM", field="model")
    return found


def _ids(request: TokenizeRequest, tokenizer) -> list[int]:
    if (request.prompt is None) == (request.messages is None):
        raise HTTPError(422, "prompt: give exactly one of prompt or messages", field="prompt")
    if request.prompt is not None:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return tokenizer.encode(request.prompt, add_special_tokens=special)
    if request.add_special_tokens:
        raise HTTPError(
            422,
            "add_special_tokens: the chat template writes the special tokens of messages",
            field="add_special_tokens",
        )
    messages = [m.as_message() for m in request.messages]
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    try:
        return chat.chat_token_ids(tokenizer, messages, tools, request.add_generation_prompt)
    except RequestError as exc:
        raise HTTPError(422, f"{exc.field}: {exc.message}", field=exc.field) from None
    except TemplateError as exc:  # the model's own template refuses these messages
        raise HTTPError(422, f"messages: the chat template says: {exc}", field="messages") from None


async def tokenize(request: Request) -> Response:
    state: AppState = request.app.state.trae
    body = _parse(TokenizeRequest, await read_json(request, state.config.max_body_bytes))
    target = _target(state, body.model)

    def work() -> dict:
        tokenizer = model_files.tokenizer(target)
        ids = _ids(body, tokenizer)
        configured = state.config.engine.max_model_len if state.config.engine else None
        return {
            "count": len(ids),
            "max_model_len": model_files.context_length(target, configured),
            "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }

    return JSONResponse(await anyio.to_thread.run_sync(work))


async def detokenize(request: Request) -> Response:
    state: AppState = request.app.state.trae
    body = _parse(DetokenizeRequest, await read_json(request, state.config.max_body_bytes))
    target = _target(state, body.model)

    def work() -> dict:
        tokenizer = model_files.tokenizer(target)
        known = len(tokenizer)
        bad = [i for i in body.tokens if not 0 <= i < known]
        if bad:
            raise HTTPError(
                422, f"tokens: {bad[0]} is not a token id (0 to {known - 1})", field="tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    return JSONResponse(await anyio.to_thread.run_sync(work))


def routes() -> list[Route]:
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
