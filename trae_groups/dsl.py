"""The Python DSL: builds the same GraphSpec a YAML file does. Nothing runs here.

    group = ModelGroup("support")
    group.add_model("intent", path="models/intent", task="classify")
    text = group.input("text", str)
    intent = group.classify("intent", model="intent", input=text)
    reply = group.generate("reply", model="dialog", prompt=f"Intent: {intent.label}\\n{text}")
    group.output("intent", intent.label)
    spec = group.spec()

Every node kind of the registry (graphs/nodes.py ``KINDS``) is a method:
``group.<kind>(name, **fields)`` (or ``group.node(name, kind, **fields)``), so a new
kind needs nothing here. ``generate`` and ``python`` add conveniences (sampling
parameters as keywords; a function itself for its name).

A node handle's attributes are references (`intent.label`); in an f-string a
reference becomes the template `{{ intent.label }}`. Errors come from `spec()`,
with the file and line of the DSL call that declared the offending part.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from trae_groups.graphs.errors import Location, SourceMap, ValidationIssue
from trae_groups.graphs.loader import parse_graph
from trae_groups.graphs.nodes import KINDS, NodeBase
from trae_groups.graphs.spec import GraphSpec

_PYTHON_TYPES: dict[Any, str] = {str: "str", int: "int", float: "float", bool: "bool"}
_PYTHON_TYPES[list[str]] = "list[str]"
#: What every node kind takes (when, after, optional, timeout, on_error, ...).
_COMMON = frozenset(NodeBase.model_fields)


class Ref:
    """A reference to a graph input, a node's result, or a field inside one."""

    __slots__ = ("_path",)

    def __init__(self, path: str):
        self._path = path

    def __getattr__(self, name: str) -> Ref:
        if name.startswith("_"):
            raise AttributeError(name)
        return Ref(f"{self._path}.{name}")

    def __getitem__(self, key: str | int) -> Ref:
        return Ref(f"{self._path}.{key}")

    def __str__(self) -> str:
        return "{{ " + self._path + " }}"

    def __repr__(self) -> str:
        return f"Ref({self._path!r})"


def path_of(ref: Ref) -> str:
    """The dotted path of a reference, e.g. 'intent.label'."""
    return ref._path


class ModelGroup:
    """Declares a graph in Python; `spec()` validates it exactly as YAML is validated."""

    def __init__(
        self,
        name: str,
        *,
        description: str | None = None,
        timeout: Any = None,
        on_deadline: str | None = None,
    ):
        self._file, line = _caller()
        self._source = SourceMap(self._file, {(): Location(line)}, _folder(self._file))
        self._issues: list[ValidationIssue] = []
        self._data: dict[str, Any] = _clean(
            {"name": name, "description": description, "timeout": timeout,
             "on_deadline": on_deadline}
        )  # fmt: skip
        for section in ("models", "inputs", "nodes", "outputs"):
            self._data[section] = {}
            self._source.locations[(section,)] = Location(line)

    # ------------------------------------------------------------ graph parts

    def add_model(
        self, name: str, path: str | None = None, *, task: str, source: str | None = None, **options
    ) -> str:
        """Declare a model (`path` is its local folder); returns its name."""
        self._put("models", name, _clean({"source": path or source, "task": task, **options}))
        return name

    def set_sharing_policy(self, memory: str = "shared", gpu: str = "shared") -> None:
        """Whether models share the memory pool and the device (engine hints)."""
        self._data["sharing"] = {"memory": memory, "gpu": gpu}
        self._mark(("sharing",))

    def set_resources(self, **settings: Any) -> None:
        """The graph's ``resources:`` (weight_budget, load_wait_s, pool_bytes,
        gpu_memory_reservation): the engine's memory; see docs/memory.md."""
        self._data["resources"] = settings
        self._mark(("resources",))

    def input(
        self,
        name: str,
        type: Any = str,
        *,
        default: Any = None,
        optional: bool = False,
        description: str | None = None,
    ) -> Ref:
        """Declare an input; returns a reference to it (`inputs.<name>`)."""
        spec = {"type": _PYTHON_TYPES.get(type, type), "description": description}
        if default is not None:
            spec["default"] = default
        elif optional:
            spec["optional"] = True
        self._put("inputs", name, _clean(spec))
        return Ref(f"inputs.{name}")

    def output(self, name: str, ref: Ref | str) -> None:
        """Expose a reference (`intent.label`, `reply.text`) as an output."""
        self._put("outputs", name, path_of(ref) if isinstance(ref, Ref) else ref)

    # ------------------------------------------------------------ nodes

    def node(self, name: str, kind: str, **fields: Any) -> Ref:
        """A node of any kind the registry knows (graphs/nodes.py ``KINDS``), its
        fields as keywords, as in YAML; a reference given for a field becomes its
        template. ``group.<kind>(name, ...)`` is the same call, for every kind:
        ``group.rerank("rank", model="rr", query=q, documents=docs)``."""
        common = {key: fields.pop(key) for key in list(fields) if key in _COMMON}
        return self._node(name, kind, _template_values(fields), common)

    def __getattr__(self, kind: str) -> Callable[..., Ref]:
        if kind.startswith("_") or kind not in KINDS:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {kind!r}")

        def add(name: str, **fields: Any) -> Ref:
            return self.node(name, kind, **fields)

        add.__name__ = add.__qualname__ = kind
        add.__doc__ = f"A {kind} node: {KINDS[kind].doc}.\n\n{KINDS[kind].spec.__doc__ or ''}"
        return add

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *KINDS})

    def generate(
        self,
        name: str,
        *,
        model: str,
        prompt: Ref | str | None = None,
        messages: Ref | str | Iterable[Mapping[str, Any]] | None = None,
        when: Ref | str | None = None,
        after: Iterable[Ref | str] = (),
        optional: Iterable[Ref | str] = (),
        timeout: Any = None,
        on_error: str = "fail",
        default: Any = None,
        description: str | None = None,
        output_schema: Any = None,
        follows: Ref | str | Mapping[str, Any] | None = None,
        adapter: str | None = None,
        speculative: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Ref:
        """Causal LM from a prompt or chat messages; sampling parameters as keywords
        (``max_tokens=64``) or as one ``params={...}`` mapping, as in YAML.
        ``output_schema``: a JSON Schema, or a pydantic model class (its schema).
        ``follows``: a generate node whose text this prompt reads, prefilled as it streams.
        ``adapter``: one of the model's LoRA ``adapters`` (``add_model(..., adapters={...})``).
        ``speculative``: ``{"method": "follows"}`` drafts from the text of a node it reads."""
        if isinstance(params.get("params"), Mapping):
            params = {**params.pop("params"), **params}
        if isinstance(output_schema, type) and issubclass(output_schema, BaseModel):
            output_schema = output_schema.model_json_schema()
        fields = {
            "model": model,
            "prompt": None if prompt is None else _template(prompt),
            "messages": _messages(messages),
            "params": params or None,
            "output_schema": output_schema,
            "adapter": adapter,
            "speculative": _speculative(speculative),
        }
        common = {"when": when, "after": after, "optional": optional, "timeout": timeout}
        common |= {"on_error": on_error, "default": default, "description": description}
        common["follows"] = follows
        return self._node(name, "generate", fields, common)

    def python(
        self,
        name: str,
        *,
        function: str | Callable[..., Any],
        args: Mapping[str, Any] | None = None,
        **common: Any,
    ) -> Ref:
        """A user function ('module:function' or the function itself) called with `args`."""
        fields = {"function": _function_name(function), "args": _template_values(args or {})}
        return self._node(name, "python", fields, common)

    def _node(self, name: str, kind: str, fields: dict, common: dict) -> Ref:
        common = dict(common)
        if isinstance(common.get("when"), Ref):
            common["when"] = path_of(common["when"])
        for key in ("after", "optional"):
            names = common.get(key) or ()
            names = [names] if isinstance(names, str | Ref) else names
            common[key] = [_root(n) for n in names] or None
        if common.get("on_error") == "fail":
            common.pop("on_error")
        follows = common.get("follows")  # follows=reply, or {"node": reply, "tokens": 8}
        if isinstance(follows, Mapping):
            common["follows"] = {**follows, "node": _root(follows.get("node"))}
        elif follows is not None:
            common["follows"] = _root(follows)
        if isinstance(common.get("cut_when"), Ref):
            common["cut_when"] = path_of(common["cut_when"])
        self._put("nodes", name, _clean({"kind": kind, **fields, **common}))
        return Ref(name)

    # ------------------------------------------------------------ results

    def spec(self) -> GraphSpec:
        """The validated spec; GraphValidationError lists every issue with its DSL line."""
        source = SourceMap(self._source.file, dict(self._source.locations), self._source.base_dir)
        return parse_graph(copy.deepcopy(self._data), source, self._issues)

    # ------------------------------------------------------------ running

    def load(self, config: Any = None) -> Any:
        """Load the models now (the first run does it otherwise); returns the LocalGraph."""
        if getattr(self, "_local", None) is None:
            from trae_groups.local import LocalGraph

            self._local = LocalGraph(self.spec(), config)
        return self._local

    def run(self, inputs: dict, **kwargs: Any) -> Any:
        """Run one request in this process; models load on the first call and stay."""
        return self.load().run(inputs, **kwargs)

    async def arun(self, inputs: dict, **kwargs: Any) -> Any:
        return await self.load().arun(inputs, **kwargs)

    def close(self) -> None:
        """Free the models loaded by run()."""
        if getattr(self, "_local", None) is not None:
            self._local.close()
            self._local = None

    def to_yaml(self) -> str:
        return self.spec().to_yaml()

    # ------------------------------------------------------------ bookkeeping

    def _put(self, section: str, name: str, value: Any) -> None:
        if name in self._data[section]:
            first = self._source.locations[(section, name)]
            file, line = _caller()
            message = f"duplicate {section[:-1]} '{name}' (first at line {first.line})"
            node = name if section == "nodes" else None
            self._issues.append(ValidationIssue(file, line, node, message))
            return
        self._data[section][name] = value
        self._mark((section, name))

    def _mark(self, path: tuple) -> None:
        file, line = _caller()
        self._source.locations[path] = Location(line, None, None, False, file)


def _caller() -> tuple[str, int]:
    """The file and line of the first frame outside this module (the user's call)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def _folder(file: str) -> Path | None:
    path = Path(file)
    return path.parent if path.is_file() else None


def _clean(fields: dict) -> dict:
    """Drop unset (None) options, so DSL data looks like the YAML a person would write."""
    return {k: v for k, v in fields.items() if v is not None}


def _root(name: Ref | str) -> str:
    return path_of(name).split(".")[0] if isinstance(name, Ref) else name


def _template(value: Ref | str) -> Any:
    return str(value) if isinstance(value, Ref) else value


def _template_values(value: Any) -> Any:
    if isinstance(value, Ref):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _template_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_template_values(v) for v in value]
    return value


def _messages(messages: Any) -> Any:
    if messages is None or isinstance(messages, str | Ref):
        return None if messages is None else _template(messages)
    return [
        {k: _template(v) for k, v in m.items()} if isinstance(m, Mapping) else m for m in messages
    ]


def _function_name(function: str | Callable[..., Any]) -> str:
    if isinstance(function, str):
        return function
    module = getattr(function, "__module__", None) or "?"
    return f"{module}:{getattr(function, '__qualname__', '?')}"


def _speculative(declared: Mapping[str, Any] | None) -> dict | None:
    """A generate node's ``speculative`` mapping, its ``node`` given by name or by reference."""
    if declared is None:
        return None
    out = dict(declared)
    if out.get("node") is not None:
        out["node"] = _root(out["node"])
    return out
