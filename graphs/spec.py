"""The graph spec: the one validated object that YAML files and the DSL both produce.

Pydantic checks the shape here (types, unknown fields, value ranges); checks that
need the whole graph (references, cycles, task/kind fit, templates) live in
``compile.py``, so one bad node does not hide the others' problems.
"""

from __future__ import annotations

import keyword
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    JsonValue,
    PrivateAttr,
    Tag,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)
from typing_extensions import TypedDict  # pydantic needs it before Python 3.12

from trae_groups.graphs.errors import SourceMap

Task = Literal["classify", "tag", "embed", "generate"]
NodeKind = Literal["classify", "tag", "embed", "generate", "python"]
InputType = Literal["str", "int", "float", "bool", "list[str]", "messages"]
TASKS: tuple[str, ...] = get_args(Task)
NODE_KINDS: tuple[str, ...] = get_args(NodeKind)

#: Which model tasks can run each model-backed node kind (a table, so adding e.g.
#: "embed on a generate model" later is one line).
KIND_TASKS: dict[str, frozenset[str]] = {kind: frozenset({kind}) for kind in TASKS}

#: The fields of each node kind's result (the executor shapes engine results into
#: these; an embedding's engine "vector" is "embedding" here). None: whatever a python
#: function returns.
RESULT_FIELDS: dict[str, frozenset[str] | None] = {
    "classify": frozenset({"label", "score", "scores", "truncated"}),
    "tag": frozenset({"spans", "truncated"}),
    "embed": frozenset({"embedding", "dim", "truncated"}),
    "generate": frozenset({"text", "tokens", "finish_reason"}),
    "python": None,
}

#: Names a node cannot take: they mean something else inside templates.
RESERVED_NAMES = frozenset(
    {"inputs", "and", "or", "not", "in", "is", "if", "else", "true", "false", "none"}
    | {"True", "False", "None", "loop", "self", "super", "caller", "varargs", "kwargs"}
    | {"range", "dict", "lipsum", "cycler", "joiner", "namespace"}
)

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SLUG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_REFERENCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")


# ---------------------------------------------------------------- small types


def _identifier(kind: str, reserved: frozenset[str] = frozenset()) -> AfterValidator:
    def check(name: str) -> str:
        if not _IDENT.match(name):
            raise ValueError(f"{kind} name {name!r} must be a letter or _ then letters, digits, _")
        if name in reserved:
            raise ValueError(f"{kind} name {name!r} is reserved in templates")
        return name

    return AfterValidator(check)


def _slug(name: str) -> str:
    if not _SLUG.match(name):
        raise ValueError(f"name {name!r} may use letters, digits, '_', '.', '-' only")
    return name


def _duration(value: Any) -> Any:
    """Seconds as a number, or a string such as "500ms", "2s", "1.5m"."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '500ms'")
    if isinstance(value, str):
        match = _DURATION.match(value)
        if not match:
            raise ValueError(f"bad duration {value!r}: use seconds or e.g. '500ms', '2s', '1m'")
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]
        return float(match.group(1)) * scale
    return value


def _function_ref(value: str) -> str:
    """'package.module:attr.path' syntax only; importing is resolve_functions()'s job."""
    module, sep, attr = value.partition(":")
    parts = module.split(".") + attr.split(".")
    if not sep or not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise ValueError("must look like 'package.module:function'")
    return value


def _reference(value: str) -> str:
    if not _REFERENCE.match(value):
        raise ValueError("must look like 'node.field' or 'inputs.name'")
    return value


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


NodeName = Annotated[str, _identifier("node", RESERVED_NAMES)]
InputName = Annotated[str, _identifier("input")]
ArgName = Annotated[str, _identifier("argument")]
Slug = Annotated[str, AfterValidator(_slug)]
Seconds = Annotated[float, BeforeValidator(_duration), Field(gt=0)]
FunctionRef = Annotated[str, AfterValidator(_function_ref)]
Reference = Annotated[str, AfterValidator(_reference)]
NameList = Annotated[list[str], BeforeValidator(_as_list)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# ---------------------------------------------------------------- models, inputs


class ModelSpec(_Spec):
    """A model the graph uses: where its weights are and what it can do.

    Either one ``source`` folder, or ``versions`` (name → folder) with a ``route``
    (version → percent, summing to 100; default: all traffic to the first version)
    and an optional ``sticky`` input whose value pins a user to one version.
    """

    source: str | None = Field(None, min_length=1)
    versions: dict[Slug, Annotated[str, Field(min_length=1)]] | None = None
    route: dict[Slug, Annotated[float, Field(ge=0, le=100)]] | None = None
    sticky: str | None = None
    task: Task
    max_batch_size: int | None = Field(None, gt=0)
    max_queue_delay_ms: float | None = Field(None, ge=0)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.source is None) == (self.versions is None):
            raise ValueError("a model needs exactly one of 'source' or 'versions'")
        if self.versions is not None and not self.versions:
            raise ValueError("'versions' needs at least one version")
        if self.route is not None:
            if self.versions is None:
                raise ValueError("'route' needs 'versions'")
            unknown = sorted(set(self.route) - set(self.versions))
            if unknown:
                raise ValueError(
                    f"route names unknown version(s) {unknown}; versions: {sorted(self.versions)}"
                )
            if abs(sum(self.route.values()) - 100) > 1e-6:
                raise ValueError(f"route weights must sum to 100, not {sum(self.route.values()):g}")
        if self.sticky is not None and self.versions is None:
            raise ValueError("'sticky' needs 'versions'")
        return self

    @property
    def sources(self) -> dict[str, str]:
        """Version name → folder; an unversioned model has one version, "default"."""
        return dict(self.versions) if self.versions is not None else {"default": self.source}

    @property
    def weights(self) -> dict[str, float]:
        """The route as version → percent, every version listed."""
        if self.route is not None:
            return {v: float(self.route.get(v, 0.0)) for v in self.sources}
        first = next(iter(self.sources))
        return {v: (100.0 if v == first else 0.0) for v in self.sources}


class ChatTurn(TypedDict):
    """One chat message as a request sends it (the `messages` input type)."""

    role: str
    content: str


_ANNOTATIONS: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "list[str]": list[str],
    "messages": list[ChatTurn],
}
_ADAPTERS = {name: TypeAdapter(annotation) for name, annotation in _ANNOTATIONS.items()}


class InputSpec(_Spec):
    """A graph input. Short form `text: str`; an input with a default is optional."""

    type: InputType
    default: JsonValue = None
    optional: bool = False
    description: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"type": data}
        if isinstance(data, dict) and "default" in data:
            if "optional" not in data:
                return {**data, "optional": True}
            if data["optional"] is False and data["default"] is not None:
                raise ValueError("an input with a default is optional; drop 'optional: false'")
        return data

    @model_validator(mode="after")
    def _default_fits(self) -> InputSpec:
        if self.default is not None:
            try:
                _ADAPTERS[self.type].validate_python(self.default, strict=True)
            except ValidationError:
                raise ValueError(f"default {self.default!r} is not of type {self.type}") from None
        return self

    @property
    def annotation(self) -> Any:
        """The Python type a request value must have."""
        return _ANNOTATIONS[self.type]


# ---------------------------------------------------------------- nodes


class _NodeBase(_Spec):
    """What every node kind shares: condition, ordering, timeout, error policy."""

    when: str | None = None
    after: NameList = []
    optional: NameList = []
    timeout: Seconds | None = None
    on_error: Literal["fail", "skip", "default"] = "fail"
    default: JsonValue = None
    description: str | None = None

    @model_validator(mode="after")
    def _default_needs_policy(self) -> _NodeBase:
        if self.default is not None and self.on_error != "default":
            raise ValueError("'default' is only used with 'on_error: default'")
        return self


class ClassifyNode(_NodeBase):
    """Sequence classification: result {label, score, scores, truncated}."""

    kind: Literal["classify"]
    model: str
    input: str


class TagNode(_NodeBase):
    """Token classification: result {spans: [{entity, text, start, end, score}], truncated}."""

    kind: Literal["tag"]
    model: str
    input: str


class EmbedNode(_NodeBase):
    """Embedding: result {embedding: [float], dim, truncated}."""

    kind: Literal["embed"]
    model: str
    input: str
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = False


class MessageTemplate(_Spec):
    """One chat message of a generate node; `content` is a template."""

    role: str = Field(min_length=1)
    content: str


class GenerateParams(_Spec):
    """Sampling parameters; temperature 0 means greedy, top_k 0 means off."""

    max_tokens: int = Field(256, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(_as_list)] = []
    seed: int | None = None


def _messages_tag(value: Any) -> str:
    return "message-template" if isinstance(value, str) else "message-list"


#: A list of message templates, or one template that yields a whole message list.
Messages = Annotated[
    Annotated[list[MessageTemplate], Tag("message-list")] | Annotated[str, Tag("message-template")],
    Discriminator(_messages_tag),
]


class GenerateNode(_NodeBase):
    """Causal LM: result {text, tokens, finish_reason}.

    `prompt` is a template; or `messages` is a list of {role, content template}, or
    one template that yields a message list (e.g. "{{ inputs.history }}"). Messages
    go through the tokenizer's chat template at run time.
    """

    kind: Literal["generate"]
    model: str
    prompt: str | None = None
    messages: Messages | None = None
    params: GenerateParams = GenerateParams()

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateNode:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a generate node needs exactly one of 'prompt' or 'messages'")
        return self


class PythonNode(_NodeBase):
    """A user function 'module:function' (sync or async) called with rendered `args`.

    Every string inside `args` is a template; other values pass as they are.
    """

    kind: Literal["python"]
    function: FunctionRef
    args: dict[ArgName, JsonValue] = {}


ModelNode = ClassifyNode | TagNode | EmbedNode | GenerateNode


def _node_tag(value: Any) -> str | None:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) and kind in NODE_KINDS else None


NodeSpec = Annotated[
    Annotated[ClassifyNode, Tag("classify")]
    | Annotated[TagNode, Tag("tag")]
    | Annotated[EmbedNode, Tag("embed")]
    | Annotated[GenerateNode, Tag("generate")]
    | Annotated[PythonNode, Tag("python")],
    Discriminator(
        _node_tag,
        custom_error_type="node_kind",
        custom_error_message="cannot tell the node's kind",
    ),
]


def infer_kind(node: Any, models: Any) -> str | None:
    """A node's kind when not given: its model's task, or python if it names a function."""
    if not isinstance(node, dict):
        return None
    model = node.get("model")
    if isinstance(model, str) and isinstance(models, dict):
        declared = models.get(model)
        task = declared.get("task") if isinstance(declared, dict) else None
        if isinstance(declared, ModelSpec):
            task = declared.task
        return task if task in TASKS else None
    if "function" in node and "model" not in node:
        return "python"
    return None


def with_inferred_kinds(data: Any) -> Any:
    """Raw graph data with `kind` filled in on every node where it can be inferred."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
        return data
    nodes = {}
    for name, node in data["nodes"].items():
        if isinstance(node, dict) and "kind" not in node:
            kind = infer_kind(node, data.get("models"))
            node = {"kind": kind, **node} if kind else node
        nodes[name] = node
    return {**data, "nodes": nodes}


# ---------------------------------------------------------------- the graph


class SharingPolicy(_Spec):
    """Hints for the engine: share the memory pool / the device across models, or not."""

    memory: Literal["shared", "isolated"] = "shared"
    gpu: Literal["shared", "dedicated"] = "shared"


class GraphSpec(_Spec):
    """A whole graph. Equality compares the declaration, not where it came from."""

    name: Slug
    description: str | None = None
    timeout: Seconds | None = None
    sharing: SharingPolicy = SharingPolicy()
    models: dict[Slug, ModelSpec] = {}
    inputs: dict[InputName, InputSpec] = {}
    nodes: dict[NodeName, NodeSpec] = {}
    outputs: dict[Annotated[str, Field(min_length=1)], Reference] = {}

    _source: SourceMap | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _infer_kinds(cls, data: Any) -> Any:
        return with_inferred_kinds(data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GraphSpec):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    @property
    def source(self) -> SourceMap | None:
        """Where the spec was declared (file and lines), if known."""
        return self._source

    def with_source(self, source: SourceMap | None) -> GraphSpec:
        """Attach the source map; returns self (a spec's fields never change)."""
        self._source = source
        return self

    def model_path(self, name: str, version: str | None = None) -> Path:
        """A model's folder (of ``version``, default its first); ``${VAR}`` reads the
        environment; relative paths count from the declaring file's folder."""
        sources = self.models[name].sources
        path = Path(os.path.expandvars(sources[version or next(iter(sources))])).expanduser()
        base = self._source.base_dir if self._source else None
        return path if path.is_absolute() or base is None else base / path

    def input_model(self) -> type[BaseModel]:
        """A pydantic model of a request body's inputs (the server answers 422 with it)."""
        fields = {
            name: (
                spec.annotation | None if spec.optional else spec.annotation,
                spec.default if spec.optional else ...,
            )
            for name, spec in self.inputs.items()
        }
        config = ConfigDict(extra="forbid", strict=True)
        return create_model(f"{self.name}_inputs", __config__=config, **fields)

    def to_yaml(self) -> str:
        """The spec as YAML; loading it gives an equal spec."""
        return yaml.dump(self._plain(), Dumper=_Dumper, sort_keys=False, allow_unicode=True)

    def _plain(self) -> dict:
        data = self.model_dump(mode="json", exclude_defaults=True)
        for name, spec in data.get("inputs", {}).items():
            if "default" in spec:
                spec.pop("optional", None)
            if list(spec) == ["type"]:
                data["inputs"][name] = spec["type"]
        nodes = data.get("nodes", {})
        for name, node in nodes.items():
            rest = {k: v for k, v in node.items() if k != "kind"}
            if infer_kind(rest, data.get("models")) == node["kind"]:
                node.pop("kind")
            nodes[name] = {k: node[k] for k in sorted(node, key=_NODE_KEY_ORDER.index)}
        return data


#: Field order of a node in a dump: what it is, what it reads, then how it runs.
_NODE_KEY_ORDER = [
    "kind", "model", "function", "description", "input", "pooling", "normalize", "prompt",
    "messages", "args", "params", "when", "after", "optional", "timeout", "on_error", "default",
]  # fmt: skip


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (prompts) as literal blocks, so dumps stay readable."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = None
    if "\n" in value:
        style = "|" if "\n" in value.strip() else '"'

    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)
