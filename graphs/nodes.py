"""Node kinds: the one place that says, for each kind, what a node declares, what its
result holds, which model task runs it, and how one node of one request runs.

Everything else derives from ``KINDS``: the spec's node union and model tasks, the
loader's messages, reference checks, the result schemas of ``GET /v1/graphs/{name}``
and the OpenAPI document, the DSL, and the executor. A node spec converts itself to
the typed engine request it means (``EmbedNode.options()``, ``GenerateNode.sampling()``),
which the kind's ``run`` passes down whole.

Adding a kind: its spec class and its ``run`` here, one ``NodeKind`` entry, and (for a
new model task) its head in the engine.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import anyio
from pydantic import Discriminator, Field, JsonValue, PrivateAttr, Tag, model_validator

from trae_groups.engine.constraints import Constraint
from trae_groups.engine.deadlines import Priority
from trae_groups.engine.errors import DeadlineExceeded, RequestError
from trae_groups.engine.protocol import (
    EncodeOptions,
    EncodeRequest,
    GenerateRequest,
    ModelClient,
    Pooling,
)
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.spec_config import DEFAULT_NUM_TOKENS, RANGES, Reference
from trae_groups.graphs.errors import TemplateRenderError
from trae_groups.graphs.types import (
    ArgName,
    FunctionRef,
    NameList,
    Seconds,
    Spec,
    sampling_field,
)

# ---------------------------------------------------------------- what every node shares


class Follows(Spec):
    """A streamed edge: the node runs on a generate node's text while it is generated,
    once per piece (docs/graphs.md, "Streamed edges"). A piece ends at a sentence or line
    end (``every``), or every ``tokens`` tokens, or every ``chars`` characters; the text
    left when the generation ends is the last piece."""

    node: str
    every: Literal["sentence", "line"] | None = None
    tokens: int | None = Field(None, ge=1)
    chars: int | None = Field(None, ge=1)
    #: Pieces that may wait for a slow follower; past that, new text joins the last one.
    buffer: int = Field(16, ge=1, le=4096)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        value = {"node": value} if isinstance(value, str) else value
        if isinstance(value, Mapping) and all(
            value.get(k) is None for k in ("every", "tokens", "chars")
        ):
            value = {**value, "every": "sentence"}
        return value

    @model_validator(mode="after")
    def _one_granularity(self) -> Follows:
        given = [k for k in ("every", "tokens", "chars") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of every, tokens or chars, not {' and '.join(given)}")
        return self


#: What a follower's templates read of the node it follows, while it streams.
FOLLOWED_FIELDS = ("text", "piece", "index", "tokens")
#: What a per-piece follower's result holds: every piece's result, and the last one's.
FOLLOWER_RESULT = {
    "pieces": {"type": "array", "description": "the result for each piece, in order"},
    "last": {"description": "the result for the last piece (null before any)"},
}


class NodeBase(Spec):
    """What every node kind shares: condition, ordering, timeout, error policy, and
    following a generate node's stream."""

    #: Fields whose strings are templates (rendered per request, in this order).
    TEMPLATES: ClassVar[tuple[str, ...]] = ()
    #: Of those, the ones a model tokenizes as one text: the values they inline keep their
    #: special tokens' text as characters (graphs/templates.PromptText).
    TEXT_FIELDS: ClassVar[tuple[str, ...]] = ()

    when: str | None = None
    after: NameList = []
    optional: NameList = []
    timeout: Seconds | None = None
    on_error: Literal["fail", "skip", "default"] = "fail"
    default: JsonValue = None
    description: str | None = None
    follows: Follows | None = None
    #: A condition on each piece's result (the node's own name): true cuts the stream.
    cut_when: str | None = None
    #: The followed text reaches the client only once this node has passed it
    #: (default: true for a node with ``cut_when``, a guard).
    hold: bool | None = None

    @model_validator(mode="after")
    def _default_needs_policy(self) -> NodeBase:
        if self.default is not None and self.on_error != "default":
            raise ValueError("'default' is only used with 'on_error: default'")
        return self

    @model_validator(mode="after")
    def _guards_follow(self) -> NodeBase:
        for key in ("cut_when", "hold"):
            if getattr(self, key) is not None and self.follows is None:
                raise ValueError(f"'{key}' is for a node that follows a stream ('follows:')")
        return self

    @property
    def holds(self) -> bool:
        """Whether the followed text waits for this node before the client sees it."""
        return self.follows is not None and (
            self.hold if self.hold is not None else self.cut_when is not None
        )

    @property
    def per_piece(self) -> bool:
        """Runs once per piece of a followed stream (a generate follower runs once)."""
        return self.follows is not None

    def check_rendered(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The rendered templates, checked for the shapes this kind needs."""
        return payload


@dataclass(frozen=True)
class NodeCall:
    """One node of one request, ready to run: its spec, its rendered templates, and
    what it runs on (a model client, or a python function)."""

    name: str
    node: Any  # the kind's spec class
    payload: dict[str, Any]
    request_id: str
    priority: Priority
    session: str | None = None
    client: ModelClient | None = None
    function: Callable[..., Any] | None = None
    emit: Callable[[str, dict], None] = lambda type, data: None
    #: Where a followed generate node's new text goes (with its token count) instead of
    #: straight to the client as token events: the nodes that follow it (graphs/streams.py).
    on_text: Callable[[str, int], None] | None = None
    max_tokens: int | None = None  # the request's cap on a generate node's own max_tokens
    #: A generate node with ``speculative: {method: follows}``: the text of the node it
    #: drafts from, as this request's run produced it (None: that node gave none)
    reference: str | None = None
    #: What the engine reported about this call beyond its result (a generation's phases,
    #: for traces: graphs/tracing.py); filled by the kind's run, read by the executor
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def work_id(self) -> str:
        """The id of this node's engine work: the request's id and the node's name, so
        two nodes of one request on one model are two requests to it."""
        return f"{self.request_id}/{self.name}"

    def encode(self, text: str | tuple[str, str], options: EncodeOptions = EncodeOptions()):
        request = EncodeRequest(text, self.work_id, options, self.priority)
        return self.client.encode(request)


@dataclass(frozen=True)
class NodeKind:
    """Everything about one kind of node (see the module docstring)."""

    name: str
    spec: type[NodeBase]
    task: str | None  # the model task that runs it; None: no model (python)
    result: Mapping[str, dict] | None  # result field -> JSON schema; None: any value
    run: Callable[[NodeCall], Awaitable[Any]]
    doc: str = ""


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must render to a string, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------- encoder kinds


class ClassifyNode(NodeBase):
    """Sequence classification: result {label, score, scores, truncated}."""

    TEMPLATES: ClassVar = ("input",)
    kind: Literal["classify"]
    model: str
    input: str


class TagNode(NodeBase):
    """Token classification: result {spans: [{entity, text, start, end, score}], truncated}."""

    TEMPLATES: ClassVar = ("input",)
    kind: Literal["tag"]
    model: str
    input: str


class EmbedNode(NodeBase):
    """Embedding: result {embedding: [float], dim, truncated}."""

    TEMPLATES: ClassVar = ("input",)
    kind: Literal["embed"]
    model: str
    input: str
    pooling: Pooling = EncodeOptions().pooling
    normalize: bool = EncodeOptions().normalize

    def options(self) -> EncodeOptions:
        return EncodeOptions(pooling=self.pooling, normalize=self.normalize)


class RerankNode(NodeBase):
    """Cross-encoder reranking: result {scores, order, top}.

    ``query`` is a template giving a string; ``documents`` a template giving a list of
    strings. Every (query, document) pair is one item of the model's batches.
    """

    TEMPLATES: ClassVar = ("query", "documents")
    kind: Literal["rerank"]
    model: str
    query: str
    documents: str

    def check_rendered(self, payload: dict[str, Any]) -> dict[str, Any]:
        docs = payload["documents"]
        if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
            raise TemplateRenderError("documents must render to a list of strings")
        return payload


async def _encode(call: NodeCall) -> dict:
    return await call.encode(_text(call.payload["input"], "input"))


async def _embed(call: NodeCall) -> dict:
    result = await call.encode(_text(call.payload["input"], "input"), call.node.options())
    vector = result.pop("vector")
    return {"embedding": vector, **result}


async def _rerank(call: NodeCall) -> dict:
    query = _text(call.payload["query"], "query")
    documents = call.payload["documents"]
    scores: list[float] = [0.0] * len(documents)

    async def score(i: int) -> None:
        try:
            scores[i] = (await call.encode((query, documents[i])))["score"]
        except RequestError as exc:  # say which pair the model refused
            raise RequestError(exc.field, f"query and document {i}: {exc.message}") from None

    try:
        async with anyio.create_task_group() as group:
            for i in range(len(documents)):
                group.start_soon(score, i)
    except BaseExceptionGroup as failed:  # the node fails with the first pair's own error
        raise _first(failed) from None
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    return {"scores": scores, "order": order, "top": documents[order[0]] if order else None}


def _first(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first


# ---------------------------------------------------------------- generate


class MessageTemplate(Spec):
    """One chat message of a generate node; `content` is a template."""

    role: str = Field(min_length=1)
    content: str


class GenerateParams(Spec):
    """Sampling parameters: ranges, defaults and meanings are the engine's
    (engine/sampling.py), so a value the engine would refuse is refused at load."""

    max_tokens: int = sampling_field("max_tokens")
    temperature: float = sampling_field("temperature")
    top_k: int = sampling_field("top_k")
    top_p: float = sampling_field("top_p")
    min_p: float = sampling_field("min_p")
    repetition_penalty: float = sampling_field("repetition_penalty")
    stop: NameList = sampling_field("stop")
    ignore_eos: bool = sampling_field("ignore_eos")
    seed: int | None = sampling_field("seed")
    speculative: bool = sampling_field("speculative")

    @model_validator(mode="after")
    def _stops(self) -> GenerateParams:
        if any(not s for s in self.stop):
            raise ValueError("stop: strings must not be empty")
        return self


class NodeSpeculative(Spec):
    """A generate node's ``speculative:``: method ``follows`` drafts its reply from the text
    of another generate node that its prompt reads (``{{ reply.text }}``, or the node it
    follows on a streamed edge), which a rewrite copies in good part. ``node`` names that
    node when the prompt reads several; graphs/compile.py finds and checks it. A model's
    ``speculative:`` (ngram, draft) is for all its requests; this node's draft from the text."""

    method: str = "follows"
    num_tokens: int = Field(
        DEFAULT_NUM_TOKENS, ge=RANGES["num_tokens"][0], le=RANGES["num_tokens"][1]
    )
    node: str | None = None

    @model_validator(mode="after")
    def _follows_only(self) -> NodeSpeculative:
        if self.method != "follows":
            raise ValueError(
                f"method: a node speculates with 'follows', not {self.method!r} (ngram and "
                "draft are set on its model's speculative:)"
            )
        return self


def _messages_tag(value: Any) -> str:
    return "message-template" if isinstance(value, str) else "message-list"


#: A list of message templates, or one template that yields a whole message list.
Messages = Annotated[
    Annotated[list[MessageTemplate], Tag("message-list")] | Annotated[str, Tag("message-template")],
    Discriminator(_messages_tag),
]


class GenerateNode(NodeBase):
    """Causal LM: result {text, tokens, finish_reason}, and ``json`` (the parsed
    object) when the node declares an ``output_schema``: a JSON Schema the output is
    constrained to, so that downstream nodes read typed fields (``extract.json.id``).

    `prompt` is a template; or `messages` is a list of {role, content template}, or
    one template that yields a message list (e.g. "{{ inputs.history }}"). Messages
    go through the model tokenizer's chat template.
    """

    TEMPLATES: ClassVar = ("prompt", "messages")
    TEXT_FIELDS: ClassVar = ("prompt",)
    kind: Literal["generate"]
    model: str
    prompt: str | None = None
    messages: Messages | None = None
    params: GenerateParams = GenerateParams()
    output_schema: dict[str, JsonValue] | None = None
    adapter: str | None = None  # one of the model's LoRA ``adapters`` (None: the base)
    speculative: NodeSpeculative | None = None  # drafts from the text of a node it reads
    _sampling: SamplingParams | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateNode:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a generate node needs exactly one of 'prompt' or 'messages'")
        return self

    @model_validator(mode="after")
    def _follows_once(self) -> GenerateNode:
        if self.follows is not None and (self.cut_when is not None or self.hold):
            raise ValueError(
                "a generate node that follows a stream runs once, at its end (its prompt "
                "is prefilled as the text arrives): it cannot cut_when or hold"
            )
        return self

    @property
    def per_piece(self) -> bool:
        return False

    @model_validator(mode="after")
    def _schema_compiles(self) -> GenerateNode:
        if self.output_schema is not None:
            try:
                self.sampling()  # checked (and compiled to a grammar) once, at load
            except RequestError as exc:
                raise ValueError(f"output_schema: {exc.message}") from None
        return self

    def sampling(self) -> SamplingParams:
        """The engine's parameters for this node (made once: a spec never changes)."""
        if self._sampling is None:
            fields = {**self.params.model_dump(), "stop": tuple(self.params.stop)}
            if self.output_schema is not None:
                fields["constraint"] = Constraint.json_schema(self.output_schema)
            self._sampling = SamplingParams(**fields)
        return self._sampling

    def check_rendered(self, payload: dict[str, Any]) -> dict[str, Any]:
        messages = payload.get("messages")
        if messages is None:
            return payload
        if isinstance(self.messages, list):  # per-message templates: each renders to text
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        ok = isinstance(messages, list) and all(
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok:
            raise TemplateRenderError(
                "messages must be a list of {role, content} with string values"
            )
        if not messages:  # the request's doing (an empty messages input): a 422, not a 500
            raise RequestError("messages", "the request gives no messages; send at least one")
        return {
            **payload,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        }


def generate_request(
    call: NodeCall, payload: Mapping[str, Any], request_id: str, **extra: Any
) -> GenerateRequest:
    """A generate node's engine request from its rendered prompt or messages. A node
    that follows a stream keeps to one replica (its prefixes were cached there)."""
    node: GenerateNode = call.node
    session = call.session or (call.work_id if node.follows is not None else None)
    if node.prompt is not None:
        prompt = payload["prompt"]
        text = {"prompt": str(prompt), "inlined": getattr(prompt, "inlined", None) or None}
    else:
        text = {"messages": tuple(payload["messages"])}
    params = node.sampling()
    if call.max_tokens is not None and call.max_tokens < params.max_tokens:
        params = dataclasses.replace(params, max_tokens=call.max_tokens)
    if call.reference and node.speculative is not None:
        extra = {**extra, "reference": Reference(call.reference, node.speculative.num_tokens)}
    return GenerateRequest(
        request_id,
        params,
        priority=call.priority,
        session=session,
        adapter=node.adapter,
        **text,
        **extra,
    )


async def _generate(call: NodeCall) -> dict:
    node: GenerateNode = call.node
    request = generate_request(call, call.payload, call.work_id)
    pieces: list[str] = []
    last = None
    async with aclosing(call.client.generate(request)) as chunks:  # leaving aborts the work
        async for chunk in chunks:
            if call.on_text is not None:
                call.on_text(chunk.text, len(chunk.token_ids))
            elif chunk.text or chunk.token_ids:
                call.emit("token", {"node": call.name, "text": chunk.text})
            pieces.append(chunk.text)
            last = chunk
    if last is None or last.error:
        raise RuntimeError(last.error if last else "no output")
    if last.phases is not None:
        call.engine["phases"] = last.phases
    if last.finish_reason == "abort":
        raise RuntimeError("generation was aborted")
    if last.finish_reason == "deadline":
        raise DeadlineExceeded(f"node '{call.name}': the request's deadline passed")
    result = {
        "text": "".join(pieces),
        "tokens": last.completion_tokens,
        "finish_reason": last.finish_reason,
        "prompt_tokens": last.prompt_tokens,
    }
    if node.output_schema is not None:
        if last.finish_reason != "stop":
            raise RuntimeError(
                f"the output stopped ({last.finish_reason}) before it completed its "
                f"output_schema; raise max_tokens ({node.params.max_tokens})"
            )
        result["json"] = json.loads(result["text"])
    return result


# ---------------------------------------------------------------- python


class PythonNode(NodeBase):
    """A user function 'module:function' (sync or async) called with rendered `args`.

    Every string inside `args` is a template; other values pass as they are.
    """

    TEMPLATES: ClassVar = ("args",)
    kind: Literal["python"]
    function: FunctionRef
    args: dict[ArgName, JsonValue] = {}


async def _python(call: NodeCall) -> Any:
    args = call.payload["args"]
    function = call.function
    if inspect.iscoroutinefunction(function):
        return await function(**args)
    # a sync function cannot be interrupted: on timeout or cancel the request moves on
    # and the thread finishes on its own
    return await anyio.to_thread.run_sync(lambda: function(**args), abandon_on_cancel=True)


# ---------------------------------------------------------------- the registry

_ENCODED = {"truncated": {"type": "boolean"}}

KINDS: dict[str, NodeKind] = {
    kind.name: kind
    for kind in (
        NodeKind(
            "classify", ClassifyNode, "classify",
            {"label": {"type": "string"}, "score": {"type": "number"},
             "scores": {"type": "object", "additionalProperties": {"type": "number"}}, **_ENCODED},
            _encode, "sequence classification",
        ),
        NodeKind(
            "tag", TagNode, "tag",
            {"spans": {"type": "array", "items": {"type": "object"}}, **_ENCODED},
            _encode, "token classification (entity spans)",
        ),
        NodeKind(
            "embed", EmbedNode, "embed",
            {"embedding": {"type": "array", "items": {"type": "number"}},
             "dim": {"type": "integer"}, **_ENCODED},
            _embed, "a text's embedding",
        ),
        NodeKind(
            "rerank", RerankNode, "rerank",
            {"scores": {"type": "array", "items": {"type": "number"}},
             "order": {"type": "array", "items": {"type": "integer"}},
             "top": {"type": ["string", "null"]}},
            _rerank, "documents scored against a query by a cross-encoder",
        ),
        NodeKind(
            "generate", GenerateNode, "generate",
            {"text": {"type": "string"}, "tokens": {"type": "integer"},
             "finish_reason": {"type": "string"},
             "json": {"description": "the parsed output, with an output_schema"}},
            _generate, "a causal LM's reply",
        ),
        NodeKind("python", PythonNode, None, None, _python, "a user function"),
    )
}  # fmt: skip

NODE_KINDS: tuple[str, ...] = tuple(KINDS)
TASKS: tuple[str, ...] = tuple(dict.fromkeys(k.task for k in KINDS.values() if k.task))
#: Which model tasks can run each model-backed node kind.
KIND_TASKS: dict[str, frozenset[str]] = {
    k.name: frozenset({k.task}) for k in KINDS.values() if k.task
}
#: The fields of each kind's result; None: whatever a python function returns.
RESULT_FIELDS: dict[str, frozenset[str] | None] = {
    k.name: None if k.result is None else frozenset(k.result) for k in KINDS.values()
}
#: Every field that is a template in some kind (to check nodes that failed their shape).
TEMPLATE_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(f for k in KINDS.values() for f in k.spec.TEMPLATES)
)


def result_schema(node: NodeBase) -> Mapping[str, dict] | None:
    """Each field of this node's result, as JSON Schema (a per-piece follower's result
    lists its pieces' results, whatever its kind); None: whatever a function returns."""
    return FOLLOWER_RESULT if node.per_piece else KINDS[node.kind].result


def result_fields(node: NodeBase) -> frozenset[str] | None:
    """The fields of this node's result (see result_schema)."""
    schema = result_schema(node)
    return None if schema is None else frozenset(schema)


def _node_tag(value: Any) -> str | None:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) and kind in KINDS else None


def _node_union() -> Any:
    members = tuple(Annotated[k.spec, Tag(k.name)] for k in KINDS.values())
    return Annotated[
        Union[members],  # noqa: UP007 (a union built from the registry)
        Discriminator(
            _node_tag,
            custom_error_type="node_kind",
            custom_error_message="cannot tell the node's kind",
        ),
    ]


#: Any node, told apart by its ``kind``.
NodeSpec = _node_union()
#: Any node that runs on a model (every kind with a task).
ModelNode = Union[tuple(k.spec for k in KINDS.values() if k.task)]  # noqa: UP007
