"""The graph spec: the one validated object that YAML files and the DSL both produce.

Pydantic checks the shape here (types, unknown fields, value ranges); checks that
need the whole graph (references, cycles, task/kind fit, templates) live in
``compile.py``, so one bad node does not hide the others' problems.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)
from typing_extensions import TypedDict  # pydantic needs it before Python 3.12

from trae_groups.engine.chat import TOOL_CALL_FORMATS
from trae_groups.engine.config import QUANTIZATIONS
from trae_groups.engine.spec_config import DEFAULT_MAX_BATCH, DEFAULT_NUM_TOKENS, SpeculativeConfig
from trae_groups.graphs.deploy import DeploySpec
from trae_groups.graphs.errors import SourceMap
from trae_groups.graphs.monitoring import MonitoringSpec
from trae_groups.graphs.nodes import (
    KIND_TASKS,
    KINDS,
    NODE_KINDS,
    RESULT_FIELDS,
    TASKS,
    ClassifyNode,
    EmbedNode,
    GenerateNode,
    GenerateParams,
    MessageTemplate,
    ModelNode,
    NodeBase,
    NodeSpec,
    PythonNode,
    RerankNode,
    TagNode,
)
from trae_groups.graphs.resources import ResourcesSpec
from trae_groups.graphs.types import (
    InputName,
    NodeName,
    Reference,
    Seconds,
    Slug,
    Spec,
)

Task = Literal[TASKS]  # type: ignore[valid-type]  (the model tasks the node kinds run on)
Quantization = Literal[("auto", "none", *QUANTIZATIONS)]  # type: ignore[valid-type]
ToolCallFormat = Literal[TOOL_CALL_FORMATS]  # type: ignore[valid-type]
InputType = Literal["str", "int", "float", "bool", "list[str]", "messages"]

__all__ = [
    "KINDS", "KIND_TASKS", "NODE_KINDS", "RESULT_FIELDS", "TASKS", "AdapterVersion", "ClassifyNode",
    "EmbedNode", "GenerateNode", "GenerateParams", "GraphSpec", "InputSpec",
    "MessageTemplate", "ModelNode", "ModelSpec", "NodeBase", "NodeSpec", "PythonNode",
    "RerankNode", "SharingPolicy", "TagNode",
]  # fmt: skip


# ---------------------------------------------------------------- models, inputs


class AdapterVersion(Spec):
    """A version that is a LoRA adapter (a PEFT folder) on the model's base: it costs no
    second copy of the base, and runs batched with the base's other requests."""

    adapter: str = Field(min_length=1)


class SpeculativeSpec(Spec):
    """A generate model's ``speculative:`` (engine/spec_config.py has the methods, ranges and
    defaults; the engine's checks are the ones applied here). ``draft``: another generate
    model of the graph (graphs/compile.py checks it exists; its tokenizer is compared with
    this model's when the graph's models load)."""

    method: str = "ngram"
    num_tokens: int = DEFAULT_NUM_TOKENS
    max_batch: int = DEFAULT_MAX_BATCH
    draft: str | None = None  # method "draft": the graph's model that proposes

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSpec:
        if self.method == "follows":
            raise ValueError(
                "method: follows is declared on a generate node (it drafts from the text of "
                "a node its prompt reads), not on a model"
            )
        self.config()
        return self

    def config(self, draft: str | None = None) -> SpeculativeConfig:
        """The engine's setting; ``draft``: the draft model's name on the engine (default:
        its name in the graph)."""
        name = draft or self.draft
        return SpeculativeConfig(self.method, self.num_tokens, self.max_batch, name)


class ModelSpec(Spec):
    """A model the graph uses: where its weights are and what it can do.

    Either one ``source`` folder, or ``versions`` (name → folder, or ``{adapter: folder}``
    for a LoRA adapter on the model's first folder version) with a ``route`` (version →
    percent, summing to 100; default: all traffic to the first version) and an optional
    ``sticky`` input whose value pins a user to one version. A generate model may carry
    ``adapters`` (name → PEFT LoRA folder) that its generate nodes pick with ``adapter:``.
    """

    source: str | None = Field(None, min_length=1)
    versions: dict[Slug, Annotated[str, Field(min_length=1)] | AdapterVersion] | None = None
    adapters: dict[Slug, Annotated[str, Field(min_length=1)]] | None = None
    route: dict[Slug, Annotated[float, Field(ge=0, le=100)]] | None = None
    sticky: str | None = None
    task: Task
    max_batch_size: int | None = Field(None, gt=0)
    max_queue_delay_ms: float | None = Field(None, ge=0)
    # "auto": picked from the hardware and checked by the accuracy gate (engine/auto_weights.py)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    quantization: Quantization | None = None
    # the accuracy gate's bound for "auto" choices; None: DEFAULT_MAX_DROP
    max_accuracy_drop: float | None = Field(None, gt=0, lt=1)
    # classify models: a JSONL file of {"text", "label"} lines the gate scores accuracy on
    eval_set: str | None = Field(None, min_length=1)
    max_prompt_tokens: int | None = Field(None, gt=0)  # generate models: longer prompts refused
    max_tokens_limit: int | None = Field(None, gt=0)  # generate models: the most one request asks
    # "on_demand": loaded at its first request, evicted when idle and the weight budget
    # needs room (generate models; engine/residency.py); "always": never evicted; unset:
    # always, unless the weight budget cannot hold every model of the graphs at once,
    # then on demand (generate models)
    resident: Literal["always", "on_demand"] | None = None
    # generate models with adapters: resident at once, and the highest rank (engine defaults)
    max_loras: int | None = Field(None, gt=0)
    max_lora_rank: int | None = Field(None, gt=0)
    # generate models: how replies write tool calls on the OpenAI routes; None: read from
    # the chat template (engine/chat.py tool_call_format)
    tool_call_parser: ToolCallFormat | None = None
    # generate models: speculative decoding (docs/engine.md); unset: the engine's setting
    speculative: SpeculativeSpec | None = None

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
        self._check_adapters()
        limits = [
            f
            for f in (
                "max_prompt_tokens",
                "max_tokens_limit",
                "max_loras",
                "max_lora_rank",
                "tool_call_parser",
                "speculative",
            )
            if getattr(self, f)
        ]
        if limits and self.task != "generate":
            raise ValueError(f"{limits[0]} is for generate models, not {self.task}")
        if self.resident == "on_demand" and self.task != "generate":
            raise ValueError(f"resident: on_demand is for generate models, not {self.task}")
        if self.quantization == "int8" and self.dtype not in (None, "float32"):
            raise ValueError(
                f"quantization: int8 runs from float32 weights, not dtype {self.dtype}"
            )
        auto = "auto" in (self.dtype, self.quantization)
        for name in ("max_accuracy_drop", "eval_set"):
            if getattr(self, name) is not None and not auto:
                raise ValueError(f"{name} is for an 'auto' dtype or quantization; set one")
        if self.eval_set is not None and self.task != "classify":
            raise ValueError(f"eval_set is for classify models, not {self.task}")
        return self

    def _check_adapters(self) -> None:
        adapted = sorted(self.version_adapters)
        if (adapted or self.adapters) and self.task != "generate":
            raise ValueError(f"LoRA adapters are for generate models, not {self.task}")
        if adapted and len(adapted) == len(self.versions):
            raise ValueError(
                f"version(s) {adapted} are adapters: they need a version that is a model "
                "folder to run on"
            )
        both = sorted(set(adapted) & set(self.adapters or {}))
        if both:
            raise ValueError(f"{both} name both a version and an adapter; rename one")
        if (adapted or self.adapters) and self.resident == "on_demand":
            raise ValueError(
                "LoRA adapters need their base model resident: resident: on_demand cannot "
                "have adapters (use resident: always, or no resident)"
            )

    @property
    def sources(self) -> dict[str, str]:
        """Version name → model folder; an unversioned model has one version, "default".
        A version that is an adapter runs on the first folder version: that folder."""
        if self.versions is None:
            return {"default": self.source}
        base = next(v for v in self.versions.values() if isinstance(v, str))
        return {n: v if isinstance(v, str) else base for n, v in self.versions.items()}

    @property
    def version_adapters(self) -> dict[str, str]:
        """Version name → adapter folder, for the versions that are LoRA adapters."""
        versions = self.versions or {}
        return {n: v.adapter for n, v in versions.items() if isinstance(v, AdapterVersion)}

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


class InputSpec(Spec):
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


class SharingPolicy(Spec):
    """Hints for the engine: share the memory pool / the device across models, or not."""

    memory: Literal["shared", "isolated"] = "shared"
    gpu: Literal["shared", "dedicated"] = "shared"


class GraphSpec(Spec):
    """A whole graph. Equality compares the declaration, not where it came from."""

    name: Slug
    description: str | None = None
    timeout: Seconds | None = None
    # past a request's deadline (the tightest of this timeout, the request's and its
    # X-Request-Deadline): "drop" ends it (504) and frees its work at once, and refuses
    # at admission what cannot make it (503); "finish" answers late. Default "drop": a
    # timeout has always ended a request at it, so a late answer is one nobody waits for.
    on_deadline: Literal["drop", "finish"] = "drop"
    sharing: SharingPolicy = SharingPolicy()
    models: dict[Slug, ModelSpec] = {}
    inputs: dict[InputName, InputSpec] = {}
    nodes: dict[NodeName, NodeSpec] = {}
    outputs: dict[Annotated[str, Field(min_length=1)], Reference] = {}
    deploy: DeploySpec = DeploySpec()
    resources: ResourcesSpec = ResourcesSpec()
    monitoring: MonitoringSpec = MonitoringSpec()  # histogram buckets (graphs/monitoring.py)

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

    def eval_path(self, name: str) -> Path | None:
        """A model's ``eval_set`` file, resolved like its source."""
        given = self.models[name].eval_set
        if given is None:
            return None
        path = Path(os.path.expandvars(given)).expanduser()
        base = self._source.base_dir if self._source else None
        return path if path.is_absolute() or base is None else base / path

    def adapter_path(self, folder: str) -> Path:
        """An adapter folder the graph names, resolved as model folders are."""
        path = Path(os.path.expandvars(folder)).expanduser()
        base = self._source.base_dir if self._source else None
        return path if path.is_absolute() or base is None else base / path

    def input_model(self) -> type[BaseModel]:
        """A pydantic model of a request body's inputs (the server answers 422 with it)."""
        fields = {  # null is a value only of an input whose default is null
            name: (
                spec.annotation | None
                if spec.optional and spec.default is None
                else spec.annotation,
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
_NODE_KEY_ORDER = list(
    dict.fromkeys(
        ["kind", "model", "function", "description"]
        + [f for k in KINDS.values() for f in k.spec.model_fields if f not in NodeBase.model_fields]
        + list(NodeBase.model_fields)
    )
)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (prompts) as literal blocks, so dumps stay readable."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = None
    if "\n" in value:
        style = "|" if "\n" in value.strip() else '"'

    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)
