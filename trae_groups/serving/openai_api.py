"""OpenAI-compatible endpoints, so stock clients work: ``POST /v1/chat/completions``,
``POST /v1/completions`` (streamed or not), ``POST /v1/embeddings``, ``GET /v1/models``
and ``GET /v1/models/{id}``; ``/v1/responses`` (openai_responses.py) and ``/tokenize``,
``/detokenize`` (openai_tokenize.py) build on this module.

What ``model`` names (GET /v1/models lists every id):

1. A **chat graph**, by the graph's name: a graph with exactly one input of type
   ``messages`` (every other input optional) and exactly one output that reads a
   generate node's ``text`` (``reply.text``). The request's messages become that
   input; only that output is computed; its tokens stream as they are generated.
   The graph's own node parameters apply (sampling fields of the request do not; its
   ``max_tokens`` may lower the node's own).
2. An **LLM or embedding model of a served graph** as ``graph/model`` (the graph's
   name for the model).
3. The **bare model name**, when it reaches one model across every served graph and
   no graph has that name (a graph's name wins; ``graph/model`` always works).
4. A **LoRA adapter** of such an LLM as ``<LLM id>:<adapter>`` (``dialog:support-lora``,
   ``chat/dialog:support-lora``): one of the model's ``adapters``, or one of its versions
   that is an adapter (that version, whatever the route says).

Requests count against the named graph's in-flight limit. Completions take an LLM
only, embeddings an ``embed`` model only. Structured outputs (``response_format``,
``guided_*``, tools) are in trae_groups/serving/openai_structured.py; the logprobs shapes
in trae_groups/serving/openai_logprobs.py. Every field a request model declares is either
honoured or, for values it cannot honour (``n`` > 1, penalties, ``suffix``), a 422 that
names the field, never silently ignored; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trae_groups.engine.constraints import Constraint
from trae_groups.engine.deadlines import Priority, tightest
from trae_groups.engine.errors import DeadlineExceeded, RequestError
from trae_groups.engine.protocol import (
    EncodeOptions,
    EncodeRequest,
    GenerateRequest,
    GenerationChunk,
    ModelClient,
    Pooling,
    TokenLogprob,
    new_request_id,
)
from trae_groups.engine.sampling import BOUNDS, DESCRIPTIONS, SamplingParams
from trae_groups.graphs.errors import first_error
from trae_groups.graphs.executor import RunResult
from trae_groups.graphs.spec import GenerateNode, GraphSpec
from trae_groups.graphs.types import sampling_field
from trae_groups.serving.app_state import AppState, ServedGraph
from trae_groups.serving.call_tracing import CallTrace, ModelCall, carrying
from trae_groups.serving.http_errors import HTTPError, bad_request, error_body, not_found
from trae_groups.serving.http_io import Emit, header_deadline, read_json, sse, until_disconnect
from trae_groups.serving.openai_logprobs import MAX_LEGACY_LOGPROBS, chat_content, legacy
from trae_groups.serving.openai_structured import Structured, ToolFields, ToolReading, chat_tools
from trae_groups.serving.run_scope import CLIENT_GONE, RunScope

# ---------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


#: Prompts one /v1/completions request may carry (a list of texts or of token-id lists),
#: and sequences it may generate (prompts x n, or x best_of).
MAX_PROMPTS = 256
Bias = Annotated[float, Field(**BOUNDS["logit_bias"].pydantic())]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    # what a chat template may show of earlier tool calls and their results
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_message(self) -> dict:
        extras = self.model_dump(include={"tool_calls", "tool_call_id", "name"}, exclude_none=True)
        return {"role": self.role, "content": self.text(), **extras}

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(Structured):
    """The sampling fields: ranges, defaults and meanings are the engine's
    (engine/sampling.py). ``max_tokens`` null means that default. Structured-output
    fields come from trae_groups/serving/openai_structured.py."""

    model: str
    max_tokens: int | None = sampling_field("max_tokens", None)
    temperature: float = sampling_field("temperature")
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k")
    min_p: float = sampling_field("min_p")
    repetition_penalty: float = sampling_field("repetition_penalty")
    stop: str | list[str] | None = None
    seed: int | None = sampling_field("seed")
    ignore_eos: bool = sampling_field("ignore_eos")  # extension
    speculative: bool = sampling_field("speculative")  # extension: opt out with false
    timeout: float | None = Field(
        None, gt=0, description="extension: seconds to the request's deadline (docs/serving.md)"
    )
    n: int = sampling_field("n")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="with stream: true only")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="not supported: 0 only")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="not supported: 0 only")
    logit_bias: dict[str, Bias] | None = Field(
        None, description=f"token id (a string) -> bias: {DESCRIPTIONS['logit_bias']}"
    )
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with its keys as token ids (a key that is not one: 422)."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise HTTPError(
                    422, f"logit_bias: keys are token ids, got {key!r}", field="logit_bias"
                )
            pairs.append((int(key), value))
        return tuple(pairs)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise HTTPError(
                422, "stream_options: only with stream: true", field="stream_options"
            )  # fmt: skip


class ChatCompletionRequest(_Sampling, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = sampling_field("max_tokens", None)
    logprobs: bool | None = Field(None, description="return each generated token's logprob")
    top_logprobs: int | None = sampling_field("logprobs", None)

    def token_logprobs(self) -> int | None:
        """Alternatives per generated token (None: no logprobs asked for)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise HTTPError(
                422, "top_logprobs: needs logprobs: true", field="top_logprobs"
            )  # fmt: skip
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"a text, token ids, or a list of up to {MAX_PROMPTS} of either"
    )
    max_tokens: int | None = Field(
        None,
        ge=0,
        lt=BOUNDS["max_tokens"].high,
        description=f"{DESCRIPTIONS['max_tokens']}; 0 (with echo) scores the prompt only",
    )
    echo: bool = Field(False, description="the prompt comes back before the completion")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LEGACY_LOGPROBS, description=DESCRIPTIONS["logprobs"]
    )
    suffix: None = Field(None, description="not supported")
    best_of: int | None = sampling_field("best_of", None)

    def check_best_of(self) -> None:
        """OpenAI's rules: at least n, and not streamed (the best are known at the end)."""
        if self.best_of is not None and self.best_of < self.n:
            raise HTTPError(422, f"best_of: must be at least n ({self.n})", field="best_of")
        if self.stream and (self.best_of or self.n) > self.n:
            raise HTTPError(422, "best_of: more than n cannot be streamed", field="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids; choices are indexed in their order."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise HTTPError(422, f"prompt: 1 to {MAX_PROMPTS} prompts", field="prompt")
        if len(prompts) * (self.best_of or self.n) > MAX_PROMPTS:
            raise HTTPError(
                422, f"prompt: prompts x {'best_of' if self.best_of else 'n'} is at most "
                f"{MAX_PROMPTS} sequences", field="prompt",
            )  # fmt: skip
        return prompts

    @model_validator(mode="after")
    def _nothing_to_generate_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise _field_error("max_tokens", "0 only with echo (the prompt is scored)", 0)
        return self

    def prompt_logprobs(self, prompts: list[str | list[int]]) -> int | None:
        """Alternatives per prompt token when the prompt is scored: echo with logprobs,
        echo of token ids (their text comes from the scores) or echo with max_tokens 0."""
        if not self.echo:
            return None
        if self.logprobs is not None:
            return self.logprobs
        scored = self.max_tokens == 0 or not isinstance(prompts[0], str)
        return 0 if scored else None


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] = Field(description="a text, or up to 2048 texts")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = Field(None, description="not supported")
    user: str | None = None
    pooling: Pooling = Field(EncodeOptions().pooling, description="extension: mean or cls")
    normalize: bool = Field(EncodeOptions().normalize, description="extension: unit length")

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else self.input
        if not 1 <= len(texts) <= MAX_EMBEDDING_INPUTS:
            raise HTTPError(422, f"input: 1 to {MAX_EMBEDDING_INPUTS} texts", field="input")
        return texts


MAX_EMBEDDING_INPUTS = 2048


def _field_error(name: str, message: str, value: Any) -> ValidationError:
    """A validation error of one field, raised by a check across fields."""
    error = InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=(name,), input=value
    )
    return ValidationError.from_exception_data("request", [error])


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        where, message = first_error(exc)
        message = f"{where}: {message}" if where else message
        raise HTTPError(422, message, field=where, type="InvalidRequest") from None


# ---------------------------------------------------------------- what `model` names


@dataclass(frozen=True)
class Target:
    """What one ``model`` id reaches: a served graph, and an LLM of it or the graph."""

    id: str
    served: ServedGraph
    model: str | None = None  # an LLM or an embedding model: the graph's name for it
    messages_input: str | None = None  # a chat graph: where messages go
    output: str | None = None  # a chat graph: the output returned
    node: str | None = None  # a chat graph: the generate node that output reads
    task: str = "generate"  # the model's task: generate, or embed (/v1/embeddings)
    adapter: str | None = None  # one of the LLM's adapters: every request runs with it
    version: str | None = None  # one of the LLM's versions that is an adapter: pinned to it
    parent: str | None = None  # an adapter's LLM id

    @property
    def kind(self) -> str:
        if self.parent is not None:
            return "adapter"
        return "graph" if self.model is None else ("llm" if self.task == "generate" else self.task)


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
            if spec.task not in ("generate", "embed"):
                continue
            target = Target(f"{served.name}/{model}", served, model, task=spec.task)
            found[target.id] = target
            engine_name = served.executor.clients[model].name
            bare.setdefault(model, []).append((engine_name, target))
    for model, entries in bare.items():
        if model not in found and len({worker for worker, _ in entries}) == 1:
            first = entries[0][1]
            found[model] = Target(model, first.served, model, task=first.task)
    for target in [t for t in found.values() if t.model is not None]:
        spec = target.served.spec.models[target.model]
        for name in spec.adapters or {}:
            found[f"{target.id}:{name}"] = _adapter_target(target, adapter=name)
        for name in _adapter_versions(target):
            found[f"{target.id}:{name}"] = _adapter_target(target, version=name)
    return found


def _adapter_versions(llm: Target) -> list[str]:
    """An LLM's versions that are adapters: the graph file's, and those uploaded since
    (served now, so an unloaded one is gone)."""
    named = list(llm.served.spec.models[llm.model].version_adapters)
    live = llm.served.executor.models[llm.model].clients
    uploaded = [v for v, c in live.items() if isinstance(getattr(c, "adapter", None), str)]
    return [v for v in dict.fromkeys(named + uploaded) if v in live]


def _adapter_target(llm: Target, **which: str) -> Target:
    name = next(iter(which.values()))
    return dataclasses.replace(llm, id=f"{llm.id}:{name}", parent=llm.id, **which)


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


def _card(state: AppState, target: Target) -> dict:
    """One model id as OpenAI's model object (with what it is here under ``trae``)."""
    return {
        "id": target.id,
        "object": "model",
        "created": state.created,
        "owned_by": "trae-groups",
        "trae": {"graph": target.served.name, "kind": target.kind},
        **({"parent": target.parent} if target.parent else {}),
    }


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.trae
    data = [_card(state, target) for target in targets(state.graphs).values()]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one id of the list; 404 naming it otherwise."""
    state: AppState = request.app.state.trae
    name = request.path_params["model"]
    found = targets(state.graphs).get(name)
    if found is None:
        raise not_found(f"unknown model '{name}'; GET /v1/models lists them", field="model")
    return JSONResponse(_card(state, found))


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.trae
    body = _parse(ChatCompletionRequest, await read_json(request, state.config.max_body_bytes))
    target, start, reading = chat_call(request, state, body)
    shows = body.token_logprobs() is not None
    return await _respond(
        request, state, target, body, start, chat=True, tools=reading, logprobs=shows
    )


def chat_call(
    request: Request, state: AppState, body: ChatCompletionRequest
) -> tuple[Target, Callable[[RunScope], Any], ToolReading | None]:
    """A checked chat request's target, the call that starts it on its run scope, and
    how its reply is read for tool calls (/v1/chat/completions and /v1/responses)."""
    target = resolve(state, body.model)
    messages = [m.as_message() for m in body.messages]
    constraint, source = body.constraint()
    _for_an_llm(target, "chat", constraint is not None or bool(body.tools))
    constraint, source, reading = chat_tools(body, target, state.config, constraint, source)
    body.check_stream_options()
    logprobs = body.token_logprobs()
    due = (body.timeout, header_deadline(request))
    max_tokens = body.max_completion_tokens or body.max_tokens
    if target.model is None:
        _for_a_graph(target, body, logprobs=logprobs is not None)
        return target, _GraphCall.factory(target, messages, body.user, due, max_tokens), None
    params = _params(body, target, max_tokens, constraint, logprobs=logprobs)
    start = _LLMCall.factory(
        target, params, messages=messages, user=body.user, tools=body.shown(), due=due,
        field=source,
    )  # fmt: skip
    return target, start, reading


async def completions(request: Request) -> Response:
    state: AppState = request.app.state.trae
    body = _parse(CompletionRequest, await read_json(request, state.config.max_body_bytes))
    target = resolve(state, body.model)
    if target.model is None:
        raise HTTPError(422, f"'{target.id}' is a graph: use /v1/chat/completions", field="model")
    constraint, source = body.constraint()
    _for_an_llm(target, "completions", False)
    body.check_stream_options()
    body.check_best_of()
    prompts = body.prompts()
    ranked = (body.best_of or body.n) > body.n  # best_of ranks by logprob: it needs them
    params = _params(
        body, target, body.max_tokens, constraint,
        logprobs=body.logprobs if body.logprobs is not None or not ranked else 0,
        prompt_logprobs=body.prompt_logprobs(prompts), best_of=body.best_of,
    )  # fmt: skip
    due = (body.timeout, header_deadline(request))
    start = _LLMCall.factory(
        target, params, prompts=prompts, user=body.user, due=due, field=source, echo=body.echo
    )
    shows = body.logprobs is not None
    return await _respond(request, state, target, body, start, chat=False, logprobs=shows)


async def embeddings(request: Request) -> Response:
    """``POST /v1/embeddings`` on an ``embed`` model of a served graph: every text is one
    item of the model's batches, with items of all other requests."""
    state: AppState = request.app.state.trae
    body = _parse(EmbeddingRequest, await read_json(request, state.config.max_body_bytes))
    target = resolve(state, body.model)
    if target.task != "embed":
        raise HTTPError(422, f"'{target.id}' is not an embedding model", field="model")
    texts = body.texts()
    options = EncodeOptions(pooling=body.pooling, normalize=body.normalize)
    request_id = new_request_id("embd")
    async with _scope(state, target, "embeddings", request) as run:
        client = _version(run.executor.models[target.model], body.user)
        traced = _model_call(run.trace, request_id, target, client, items=len(texts))

        async def encode_all() -> list[dict]:
            with carrying(run.trace):  # gather's tasks take the context as it is now
                results = await asyncio.gather(
                    *(
                        client.encode(EncodeRequest(text, f"{request_id}/{i}", options))
                        for i, text in enumerate(texts)
                    )
                )
            if traced is not None:
                traced.ended()
            return results

        results, gone = await until_disconnect(request.receive, encode_all)
        if gone:
            return Response(status_code=CLIENT_GONE)  # the scope records the 499
        run.succeeded()
    encode = _base64_floats if body.encoding_format == "base64" else list
    data = [
        {"object": "embedding", "index": i, "embedding": encode(r["vector"])}
        for i, r in enumerate(results)
    ]
    usage = {"prompt_tokens": 0, "total_tokens": 0}  # encoders do not count tokens
    return JSONResponse({"object": "list", "data": data, "model": target.id, "usage": usage})


def _base64_floats(vector: list[float]) -> str:
    """OpenAI's base64 embedding: little-endian float32, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _version(model: Any, user: str | None) -> Any:
    """The client of the version the model's route picks; OpenAI's ``user`` is the
    sticky key when the model routes sticky."""
    inputs = {model.sticky: user} if model.sticky and user is not None else {}
    return model.clients[model.choose(inputs)]


def _for_an_llm(target: Target, route: str, structured: bool) -> None:
    """Embedding models answer /v1/embeddings only; a chat graph's own node decides its
    sampling, so structured-output fields cannot apply to it."""
    if target.task == "embed":
        raise HTTPError(
            422, f"'{target.id}' is an embedding model: use /v1/embeddings", field="model"
        )
    if structured and target.model is None:
        raise HTTPError(
            422,
            f"'{target.id}' is a graph: its node's parameters apply; response_format, "
            "guided_* and tools apply to an LLM (graph/model)",
            field="model",
        )


def _for_a_graph(target: Target, body: _Sampling, logprobs: bool) -> None:
    """A chat graph's node samples as the graph says: the fields that would change what
    comes back per token cannot apply to it."""
    fields = (("logprobs", logprobs), ("logit_bias", body.logit_bias), ("n", body.n > 1))
    asked = [name for name, given in fields if given]
    if asked:
        raise HTTPError(
            422,
            f"{asked[0]}: '{target.id}' is a graph: its node's parameters apply; "
            f"{asked[0]} applies to an LLM (graph/model)",
            field=asked[0],
        )


def _params(
    body: _Sampling,
    target: Target,
    max_tokens: int | None,
    constraint: Constraint | None = None,
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    best_of: int | None = None,
) -> SamplingParams:
    """Checked now, before admission (RequestError is a 422). No max_tokens: the
    engine's default, or the model's ``max_tokens_limit`` when that is lower."""
    default = SamplingParams.__dataclass_fields__["max_tokens"].default
    limit = target.served.spec.models[target.model].max_tokens_limit or default
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else min(default, limit),
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=body.stops(),
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        constraint=constraint,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=body.bias(),
        n=body.n,
        best_of=best_of,
    )


# ---------------------------------------------------------------- one call, two kinds


@dataclass
class _Piece:
    """What a call hands on as it goes: text deltas (and their tokens' logprobs when
    asked), then the end; ``index`` is the choice it belongs to."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt: bool = False  # the prompt itself (echo)


OnPiece = Callable[[_Piece], Awaitable[None]]


class _LLMCall:
    """Prompts (or chat messages) on one LLM, each ``n`` generations (forked from one
    prefill by the engine), their chunks turned into pieces: choice ``p * n + i`` is
    prompt ``p``'s ``i``-th, as OpenAI indexes them. All prompts are submitted at once
    (they batch together); their pieces are handed on one prompt after the other. With
    ``best_of`` > n, the n of highest cumulative logprob are kept, most likely first."""

    result: RunResult | None = None  # a model call has no graph run
    traced: ModelCall | None = None  # traced: what the request's model span shows

    def __init__(
        self,
        target: Target,
        client: ModelClient,
        requests: list[GenerateRequest],
        field: str | None = None,
        echo: bool = False,
    ):
        self.target, self.client = target, client
        self.field = field  # the body's field that asked for the constraint, if any
        self.echo = echo  # each choice's text starts with its prompt
        self.request_id = requests[0].request_id.partition("/")[0]  # the response's id
        self.requests = requests
        self.streams = []
        try:
            for request in requests:
                self.streams.append(client.generate(request))  # a RequestError here is a 422
        except RequestError as exc:
            self.close()
            raise self._named(exc) from None
        self._first: list[GenerationChunk | None] = [None] * len(requests)

    @classmethod
    def factory(
        cls,
        target: Target,
        params: SamplingParams,
        *,
        prompts=None,
        messages=None,
        user=None,
        tools=None,
        due: tuple[float | None, float | None] = (None, None),
        field: str | None = None,
        echo: bool = False,
    ):
        """Submits when called with the request's run scope, on the executor it was
        admitted on. ``due``: the body's ``timeout`` and the X-Request-Deadline header's
        time; the tightest is the request's deadline, dropped or finished as the target's
        graph says."""

        def start(run: RunScope) -> _LLMCall:
            model = run.executor.models[target.model]
            client = model.clients[target.version] if target.version else _version(model, user)
            drop = target.served.spec.on_deadline == "drop"
            request_id = new_request_id("cmpl" if messages is None else "chatcmpl")
            each = [None] if prompts is None else prompts
            requests = [
                GenerateRequest(
                    request_id if len(each) == 1 else f"{request_id}/{i}",
                    params,
                    prompt=tuple(prompt) if isinstance(prompt, list) else prompt,
                    messages=tuple(messages) if messages is not None else None,
                    priority=Priority(deadline=tightest(*due, drop=drop)),
                    session=user,
                    tools=tuple(tools) if tools else None,
                    adapter=target.adapter,
                )
                for i, prompt in enumerate(each)
            ]
            return cls(target, client, requests, field, echo)

        return start

    async def open(self) -> None:
        """Wait for each first chunk, so an error before any output keeps its status. All
        at once: a client that submits at the first step (the engine process's) then has
        every prompt in the engine together."""
        firsts = await asyncio.gather(
            *(anext(stream, None) for stream in self.streams), return_exceptions=True
        )
        for first in firsts:
            if isinstance(first, RequestError):
                raise self._named(first)
            if isinstance(first, BaseException):
                raise first
        self._first = list(firsts)

    def _named(self, exc: RequestError) -> Exception:
        """The engine's ``constraint`` is the body's field that asked for it."""
        if exc.field != "constraint" or self.field is None:
            return exc
        return HTTPError(422, f"{self.field}: {exc.message}", field=self.field)

    def close(self) -> None:
        for request in self.requests:
            self.client.abort(request.request_id)  # a no-op once the generation finished

    async def run(self, on_piece: OnPiece) -> None:
        params = self.requests[0].params
        for index, stream in enumerate(self.streams):
            if params.num_sequences == params.n:
                await self._run_one(index, stream, on_piece)
                continue
            pieces: list[_Piece] = []
            await self._run_one(index, stream, _keep(pieces))
            for piece in _best(pieces, params.n, index * params.n):
                await on_piece(piece)

    async def _run_one(self, index: int, stream, on_piece: OnPiece) -> None:
        """Prompt ``index``'s sequences, their pieces numbered as choices."""
        n = self.requests[0].params.n
        chunk = self._first[index]
        started: set[int] = set()
        while chunk is not None:
            choice = index * n + chunk.index
            if self.echo and chunk.index not in started:
                await on_piece(self._prompt_piece(index, choice, chunk))
            started.add(chunk.index)
            if chunk.error:
                raise HTTPError(500, f"generation failed: {chunk.error}", type="GenerationFailed")
            if chunk.finished and self.traced is not None:
                self.traced.ended(chunk)
            if chunk.finished and chunk.finish_reason == "abort":
                raise HTTPError(503, "generation was aborted", type="Aborted")
            if chunk.finished and chunk.finish_reason == "deadline":
                raise DeadlineExceeded("the request's deadline passed; its generation was dropped")
            await on_piece(
                _Piece(
                    chunk.text,
                    chunk.finish_reason,
                    chunk.prompt_tokens,
                    chunk.completion_tokens,
                    choice,
                    chunk.logprobs,
                )
            )
            chunk = await anext(stream, None)

    def _prompt_piece(self, index: int, choice: int, first: GenerationChunk) -> _Piece:
        """``echo``: the prompt as text (token ids: their texts, from the prompt's
        scores) and, when scored, its tokens' logprobs."""
        prompt, scores = self.requests[index].prompt, first.prompt_logprobs
        text = prompt if isinstance(prompt, str) else "".join(e.text for e in scores or ())
        return _Piece(text, index=choice, logprobs=scores, prompt=True)


def _keep(pieces: list[_Piece]) -> OnPiece:
    async def keep(piece: _Piece) -> None:
        pieces.append(piece)

    return keep


def _best(pieces: list[_Piece], n: int, first: int) -> list[_Piece]:
    """Of one prompt's choices, the ``n`` whose generated tokens have the highest summed
    logprob, renumbered ``first``, ``first + 1``, ... from the most likely."""
    by_choice: dict[int, list[_Piece]] = {}
    for piece in pieces:
        by_choice.setdefault(piece.index, []).append(piece)

    def score(choice: int) -> float:
        generated = [p for p in by_choice[choice] if not p.prompt]
        return sum(e.logprob for e in _entries(generated) if e.logprob is not None)

    kept = sorted(by_choice, key=score, reverse=True)[:n]
    return [
        dataclasses.replace(p, index=first + rank)
        for rank, c in enumerate(kept)
        for p in by_choice[c]
    ]


class _GraphCall:
    """A chat graph run: the text output's node streams; the result ends it."""

    def __init__(
        self,
        target: Target,
        run: RunScope,
        messages: list[dict],
        user=None,
        due: tuple[float | None, float | None] = (None, None),
        max_tokens: int | None = None,
    ):
        self.target, self.executor = target, run.executor
        self.prepared = run.prepare(
            {target.messages_input: messages},
            outputs=[target.output],
            request_id=new_request_id("chatcmpl"),
            session=user,
            timeout=due[0],
            deadline=due[1],
            max_tokens={target.node: max_tokens} if max_tokens else None,
            traceparent=run.trace.parent() if run.trace is not None else None,
        )  # an InputError here is a 422; past the deadline estimate, 503
        self.request_id = self.prepared.request_id
        self.result: RunResult | None = None  # the graph run's, once it ends

    @classmethod
    def factory(
        cls,
        target: Target,
        messages: list[dict],
        user: str | None = None,
        due: tuple[float | None, float | None] = (None, None),
        max_tokens: int | None = None,
    ):
        return lambda run: cls(target, run, messages, user, due, max_tokens)

    async def open(self) -> None:
        pass  # graph errors come as the run's own events

    def close(self) -> None:
        pass  # the run lives inside run(): leaving it cancels the graph run

    async def run(self, on_piece: OnPiece) -> None:
        """The run's outcome is recorded by the request's scope (``self.result``)."""
        node = self.target.node
        streamed: list[str] = []
        async for event in self.executor.stream(self.prepared):
            if event.type == "token" and event.data.get("node") == node:
                streamed.append(event.data.get("text", ""))
                await on_piece(_Piece(streamed[-1]))
            elif event.type == "error":
                raise event.error
            elif event.type in ("result", "cut"):
                self.result = result = event.result
        text, sent = result.outputs.get(self.target.output) or "", "".join(streamed)
        rest = text[len(sent) :] if text.startswith(sent) else ""
        usage = result.nodes[node].usage
        reason = usage.get("finish_reason")
        await on_piece(
            _Piece(
                rest,
                {"length": "length", "cut": "content_filter"}.get(reason, "stop"),
                usage.get("prompt_tokens", 0),
                usage.get("tokens", 0),
            )
        )


# ---------------------------------------------------------------- responses


def _scope(state: AppState, target: Target, endpoint: str, request: Request) -> RunScope:
    """The run scope of one OpenAI request: a chat graph's outcome is its graph's too;
    traced, its span's parent is the request's W3C trace context."""
    return RunScope(
        state, target.served, graph=target.model is None, endpoint=(endpoint, target.id),
        trace=CallTrace.start(endpoint, target.id, request.headers),
    )  # fmt: skip


def started(run: RunScope, start: Callable[[RunScope], Any]) -> Any:
    """The call made on its run scope; traced, its engine work carries the model span's
    context, and the span reads what the call saw."""
    with carrying(run.trace):
        call = start(run)
    if run.trace is not None:
        run.trace.request_id = call.request_id
    if isinstance(call, _LLMCall):
        call.traced = _model_call(
            run.trace, call.request_id, call.target, call.client, prompts=len(call.requests)
        )
    return call


def _model_call(
    trace: CallTrace | None, request_id: str, target: Target, client: Any, **counts: int
) -> ModelCall | None:
    """The record of a request's work on its model, for its span (None: not traced)."""
    if trace is None:
        return None
    trace.request_id = request_id
    return trace.model_call(target.model, target.task, client.name, target.adapter, **counts)


async def _respond(
    request: Request, state: AppState, target, body, start, *, chat: bool, tools=None,
    logprobs: bool = False,
):  # fmt: skip
    """Admit, start the call, and answer: one JSON object, or SSE chunks then [DONE]."""
    async with _scope(state, target, "chat" if chat else "completions", request) as run:
        limit = _Limit(state.config.openai_timeout_s)
        call = started(run, start)
        run.closing(call.close)
        await limit.within(call.open)
        shape = _Shape(call.request_id, target.id, int(time.time()), chat, tools, logprobs, body.n)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return run.stream(_stream(run, call, shape, usage, limit))
        pieces, gone = await until_disconnect(
            request.receive, lambda: limit.within(lambda: _collect(call))
        )
        if gone:
            return Response(status_code=CLIENT_GONE)  # the scope records the 499
        run.succeeded(call.result)
        return JSONResponse(shape.whole(pieces))


class _Limit:
    """The server's time limit for one OpenAI request, from its admission on."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    async def within(self, work: Callable[[], Awaitable[Any]]) -> Any:
        with anyio.move_on_after(max(0.0, self.deadline - time.monotonic())):
            return await work()
        raise HTTPError(
            504,
            f"the request ran past the server's {self.seconds:g} s limit "
            "(ServerConfig.openai_timeout_s)",
            type="Timeout",
        )


async def _collect(call) -> list[_Piece]:
    pieces: list[_Piece] = []

    async def keep(piece: _Piece) -> None:
        pieces.append(piece)

    await call.run(keep)
    return pieces


def _stream(run: RunScope, call, shape: _Shape, include_usage: bool, limit: _Limit):
    async def produce(emit: Emit) -> None:
        last: dict[int, _Piece] = {}  # each choice's latest piece
        readers: dict[int, Any] = {}  # with tools: each choice's text-or-call deltas
        offsets: dict[int, int] = {}  # completions: where each choice's next token starts

        def reader(index: int) -> Any:
            return readers.setdefault(index, shape.tools.streaming())

        async def send(piece: _Piece) -> None:
            last[piece.index] = piece
            if piece.text and shape.tools is not None:  # deltas as the reply allows them
                at = _Piece(index=piece.index)
                for delta in reader(piece.index).feed(piece.text):
                    await emit(sse(None, shape.chunk(delta, None, at)))
            elif piece.text or (piece.logprobs and shape.logprobs):
                await emit(sse(None, shape.chunk(piece.text, None, piece, offsets)))

        try:
            if shape.chat:
                await emit(sse(None, shape.chunk({"role": "assistant", "content": ""})))
            await limit.within(lambda: call.run(send))
            for index in sorted(last) or [0]:
                finish = last.get(index, _Piece()).finish_reason or "stop"
                at = _Piece(index=index)
                if shape.tools is not None:
                    deltas, finish = reader(index).end(finish)
                    for delta in deltas:
                        await emit(sse(None, shape.chunk(delta, None, at)))
                await emit(sse(None, shape.chunk(None, finish, at)))
            if include_usage:
                usage = _usage(last.values(), shape.n)
                await emit(sse(None, {**shape.chunk(None), "choices": [], "usage": usage}))
            run.succeeded(call.result)
        except Exception as exc:
            run.failed(exc)
            await emit(sse(None, error_body(exc, openai=True)))
        await emit(sse(None, "[DONE]"))  # the client leaving mid-stream: the scope's 499

    return produce


def _entries(pieces: list[_Piece]) -> tuple[TokenLogprob, ...]:
    return tuple(e for p in pieces for e in p.logprobs or ())


def _usage(last: Any, n: int = 1) -> dict:
    """Usage over each choice's last piece; a prompt counts once, not once a choice
    (``n``: choices per prompt)."""
    last = list(last)
    prompt = sum(p.prompt_tokens for p in last if p.index % n == 0)
    completion = sum(p.completion_tokens for p in last)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@dataclass(frozen=True)
class _Shape:
    """The OpenAI response objects of one request."""

    id: str
    model: str
    created: int
    chat: bool
    tools: ToolReading | None = None  # how a chat reply is read for tool calls
    logprobs: bool = False  # the request asked for logprobs: choices carry them
    n: int = 1  # choices per prompt

    def whole(self, pieces: list[_Piece]) -> dict:
        by_index: dict[int, list[_Piece]] = {}
        for piece in pieces:
            by_index.setdefault(piece.index, []).append(piece)
        choices = [self._choice(i, got) for i, got in sorted(by_index.items())]
        if not choices:
            choices = [self._choice(0, [])]
        last = [got[-1] for got in by_index.values()]
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(last, self.n),
        }

    def _choice(self, index: int, pieces: list[_Piece]) -> dict:
        text = "".join(p.text for p in pieces)
        last = pieces[-1] if pieces else _Piece(finish_reason="stop")
        choice: dict[str, Any] = {"index": index, "finish_reason": last.finish_reason or "stop"}
        if self.tools is not None:
            choice["message"], choice["finish_reason"] = self.tools.message(
                text, choice["finish_reason"]
            )
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(_entries(pieces), {})
        return choice

    def _logprobs(self, entries, offsets: dict[int, int], index: int = 0) -> dict | None:
        """A choice's (or one chunk's) ``logprobs``; None when the request did not ask.
        ``offsets``: where each choice's next token starts in its text (completions)."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": chat_content(entries), "refusal": None}
        shape, offsets[index] = legacy(entries, offsets.get(index, 0))
        return shape

    def chunk(
        self,
        delta: dict | str | None,
        finish_reason: str | None = None,
        piece: _Piece | None = None,
        offsets: dict[int, int] | None = None,
    ) -> dict:
        """One streamed chunk of ``piece``'s choice; its logprobs when there are some."""
        index = piece.index if piece is not None else 0
        if self.chat:
            content = {"content": delta} if isinstance(delta, str) else (delta or {})
            choice: dict[str, Any] = {"index": index, "delta": content}
        else:
            choice = {"index": index, "text": delta if isinstance(delta, str) else ""}
        choice["finish_reason"] = finish_reason
        entries = piece.logprobs if piece is not None else None
        choice["logprobs"] = (
            self._logprobs(entries, offsets, index) if entries and offsets is not None else None
        )
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }


# ---------------------------------------------------------------- wiring


def routes() -> list[Route]:
    from trae_groups.serving import openai_responses, openai_tokenize  # they build on this one

    return [
        *openai_tokenize.routes(),
        *openai_responses.routes(),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
    ]
