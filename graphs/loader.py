"""Reading graph files: YAML with a line for every key, then validation that reports
every issue at once.

Lines come from composing the YAML into nodes (each with a start mark) before
building Python objects; pydantic's error locations are spec paths, which the
source map turns back into lines. When pydantic rejects some items, they are set
aside and the rest is checked as a whole graph, so one bad node does not hide
another's unknown reference.
"""

from __future__ import annotations

import difflib
import json
import reprlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from trae_groups.graphs.compile import Excused, check_graph, issues_from
from trae_groups.graphs.deploy import Autoscaling, DeploySpec, GroupSpec, IngressSpec
from trae_groups.graphs.errors import GraphValidationError, Location, SourceMap, ValidationIssue
from trae_groups.graphs.monitoring import HistogramSpec, MonitoringSpec
from trae_groups.graphs.resources import ResourcesSpec
from trae_groups.graphs.spec import (
    KINDS,
    NODE_KINDS,
    GenerateParams,
    GraphSpec,
    InputSpec,
    MessageTemplate,
    ModelSpec,
    SharingPolicy,
    with_inferred_kinds,
)

MAX_YAML_NODES = 100_000  # after alias expansion: no "billion laughs"
MAX_YAML_DEPTH = 64
_SECTIONS = ("models", "inputs", "nodes", "outputs")
_OWNER = {"models": "model", "inputs": "input", "outputs": "output"}
#: Steps pydantic adds to an error's location that are not keys in the file: union
#: members, tags and dict-key markers.
_LABELS = {"[key]", "message-list", "message-template", *NODE_KINDS}
_LABELS |= {"str", "int", "float", "bool", "list", "dict", "list[str]"}
_SPEC_CLASSES: tuple[type[BaseModel], ...] = (
    GraphSpec, ModelSpec, InputSpec, GenerateParams, MessageTemplate, SharingPolicy,
    DeploySpec, GroupSpec, IngressSpec, Autoscaling, ResourcesSpec, MonitoringSpec, HistogramSpec, *(kind.spec for kind in KINDS.values()),
)  # fmt: skip
_FIELDS = sorted({name for cls in _SPEC_CLASSES for name in cls.model_fields} | {"kind"})


# ---------------------------------------------------------------- public entry points


def load_graph(path: str | Path) -> GraphSpec:
    """Load and validate a graph file; relative model sources count from its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GraphValidationError([ValidationIssue(str(path), None, None, str(exc))]) from exc
    return load_graph_text(text, str(path), base_dir=path.parent)


def load_graph_text(
    text: str, filename: str = "<string>", base_dir: Path | None = None
) -> GraphSpec:
    """Load and validate graph YAML held in a string (`filename` is for messages)."""
    data, source, issues = read_yaml(text, filename)
    source.base_dir = base_dir
    return parse_graph(data, source, issues)


def parse_graph(data: Any, source: SourceMap, issues: Iterable[ValidationIssue] = ()) -> GraphSpec:
    """Validate plain data (from YAML or the DSL) into a spec, or raise every issue."""
    issues = list(issues)
    data = _schema_files(data, source, issues)
    spec, excused = _shape(data, source, issues)
    if spec is not None:
        raw_nodes = data.get("nodes") if isinstance(data.get("nodes"), dict) else {}
        set_aside = {n: raw_nodes[n] for n in excused.nodes if n in raw_nodes}
        problems, _ = check_graph(spec, excused, set_aside)
        issues += issues_from(problems, source)
    if issues:
        raise GraphValidationError(_ordered(issues))
    return spec.with_source(source)


def _schema_files(data: Any, source: SourceMap, issues: list[ValidationIssue]) -> Any:
    """A generate node's ``output_schema: path/to/schema.json`` read in place (relative
    to the graph file's folder), so the spec holds the schema itself."""
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, dict):
        return data
    read = {}
    for name, node in nodes.items():
        schema = node.get("output_schema") if isinstance(node, dict) else None
        if not isinstance(schema, str):
            continue
        path = Path(schema)
        if not path.is_absolute() and source.base_dir is not None:
            path = source.base_dir / path
        where = ("nodes", name, "output_schema")
        try:
            read[name] = {**node, "output_schema": json.loads(path.read_text(encoding="utf-8"))}
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            issues.append(
                source.issue(where, f"output_schema: cannot read {schema!r}: {reason}", name)
            )
            read[name] = {**node, "output_schema": {}}  # reported once, not again as a type
    return {**data, "nodes": {**nodes, **read}} if read else data


def _ordered(issues: list[ValidationIssue]) -> list[ValidationIssue]:
    unique = list(dict.fromkeys(issues))
    return sorted(unique, key=lambda i: (i.line is not None, i.line or 0))


# ---------------------------------------------------------------- YAML with lines


class _Unsafe(Exception):
    pass


def read_yaml(text: str, filename: str) -> tuple[Any, SourceMap, list[ValidationIssue]]:
    """Parse YAML into plain data plus a source map; duplicate keys come back as issues."""
    source = SourceMap(filename)
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        root = loader.get_single_node()
        if root is None:
            return None, source, []
        _measure(root, 0, {})
        issues: list[ValidationIssue] = []
        source.locations[()] = Location(root.start_mark.line + 1, root.start_mark.column + 1)
        _locate(loader, root, (), source, issues, set())
        return loader.construct_document(root), source, issues
    except yaml.YAMLError as exc:
        raise GraphValidationError([_yaml_issue(exc, filename)]) from None
    except _Unsafe as exc:
        raise GraphValidationError([ValidationIssue(filename, None, None, str(exc))]) from None
    except RecursionError:
        message = f"the document is nested deeper than {MAX_YAML_DEPTH} levels"
        raise GraphValidationError([ValidationIssue(filename, None, None, message)]) from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise GraphValidationError(
            [ValidationIssue(filename, None, None, f"YAML: {exc}")]
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def _yaml_issue(exc: yaml.YAMLError, filename: str) -> ValidationIssue:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    message = f"YAML syntax: {problem}" + (f" ({context})" if context else "")
    if mark is None:
        return ValidationIssue(filename, None, None, message)
    return ValidationIssue(filename, mark.line + 1, None, message, mark.column + 1)


def _measure(node: Node, depth: int, seen: dict[int, tuple[int, int] | None]) -> tuple[int, int]:
    """(expanded size, height) of a node; refuses alias bombs, cycles and deep nesting."""
    key = id(node)
    if key in seen:
        if seen[key] is None:
            raise _Unsafe("the document contains a recursive alias")
        size, height = seen[key]
    else:
        if depth > MAX_YAML_DEPTH:
            raise RecursionError
        seen[key] = None
        size, height = 1, 0
        for child in _children(node):
            child_size, child_height = _measure(child, depth + 1, seen)
            size, height = size + child_size, max(height, child_height + 1)
        seen[key] = (size, height)
    if size > MAX_YAML_NODES:
        raise _Unsafe(f"the document expands to more than {MAX_YAML_NODES} values")
    if depth + height > MAX_YAML_DEPTH:
        raise RecursionError
    return size, height


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def _locate(
    loader: yaml.SafeLoader,
    node: Node,
    path: tuple,
    source: SourceMap,
    issues: list[ValidationIssue],
    seen: set[int],
) -> None:
    """Record the line of every mapping key and list item under `node`."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            source.locations[(*path, i)] = _location(item, item)
            _locate(loader, item, (*path, i), source, issues, seen)
    elif isinstance(node, MappingNode):
        first: dict[Any, int] = {}
        for key_node, value in node.value:
            if not isinstance(key_node, ScalarNode):
                continue
            key = _key(loader, key_node)
            line = key_node.start_mark.line + 1
            if key in first:
                who = key if path == ("nodes",) else (path[1] if path[:1] == ("nodes",) else None)
                message = f"duplicate key '{key}' (first at line {first[key]})"
                issues.append(ValidationIssue(source.file, line, _name(who), message))
                continue
            first[key] = line
            source.locations[(*path, key)] = _location(key_node, value)
            _locate(loader, value, (*path, key), source, issues, seen)


def _location(key: Node, value: Node) -> Location:
    literal = isinstance(value, ScalarNode) and value.style == "|"
    return Location(
        key.start_mark.line + 1, key.start_mark.column + 1, value.start_mark.line + 1, literal
    )


def _key(loader: yaml.SafeLoader, node: ScalarNode) -> Any:
    try:
        key = loader.construct_object(node)
        hash(key)
        return key
    except Exception:
        return node.value


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- shape (pydantic) checks


def _shape(
    data: Any, source: SourceMap, issues: list[ValidationIssue]
) -> tuple[GraphSpec | None, Excused]:
    """Validate with pydantic; set failing items aside and retry with the rest."""
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}"
        message = (
            f"a graph must be a mapping with name, models, inputs, nodes, outputs (got {what})"
        )
        issues.append(source.issue((), message))
        return None, Excused()
    work, excused = (
        with_inferred_kinds(dict(data)),
        {s: set() for s in ("models", "inputs", "nodes", "sections")},
    )
    for _ in range(5):
        try:
            spec = GraphSpec.model_validate(work)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            issues += [i for e in errors if (i := _issue(e, data, source)) is not None]
            work = _set_aside(work, errors, excused)
            if work is None:
                return None, Excused()
            continue
        return spec, Excused(**{k: frozenset(v) for k, v in excused.items()})
    return None, Excused()


def _set_aside(work: dict, errors: list[dict], excused: dict[str, set]) -> dict | None:
    work = dict(work)
    for error in errors:
        loc = error["loc"]
        if not loc:
            return None
        head = loc[0]
        if head in _SECTIONS and len(loc) > 1 and isinstance(work.get(head), dict):
            work[head] = {k: v for k, v in work[head].items() if k != loc[1]}
            if isinstance(loc[1], str) and head in excused:
                excused[head].add(loc[1])
        elif head in _SECTIONS:
            work[head] = {}
            excused["sections"].add(head)
        elif head == "name":
            work["name"] = "graph"
        else:
            work.pop(head, None)
    return work


def _issue(error: dict, data: dict, source: SourceMap) -> ValidationIssue | None:
    loc = _file_path(data, error["loc"])
    node = _name(loc[1]) if loc[:1] == ("nodes",) and len(loc) > 1 else None
    message = _message(error, loc, data)
    if message is None:
        return None
    if loc and loc[0] in _OWNER and len(loc) > 1:
        message = f"{_OWNER[loc[0]]} '{loc[1]}': {message}"
    return source.issue(loc, message, node)


def _file_path(data: Any, loc: tuple) -> tuple:
    """An error location as a path in the file: steps into the data, minus labels."""
    path, here = [], data
    for step in loc:
        if _has_step(here, step):
            here = here[step]
        elif step in _LABELS:
            continue
        else:
            here = None
        path.append(step)
    return tuple(path)


def _has_step(value: Any, step: Any) -> bool:
    if isinstance(value, dict):
        return step in value
    return isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value)


def _message(error: dict, loc: tuple, data: dict) -> str | None:
    kind, text = error["type"], error["msg"].removeprefix("Value error, ")
    inner = loc[2:] if len(loc) > 1 and loc[0] in _SECTIONS else loc
    field = ".".join(str(step) for step in inner[:-1] if step is not None)
    where = f"{field}: " if field else ""
    last = inner[-1] if inner else None
    if kind == "extra_forbidden":
        return f"{where}unknown field '{last}'{_suggest(str(last), _FIELDS)}"
    if kind == "missing":
        return f"{where}missing field '{last}'"
    if kind == "node_kind":
        return _kind_message(data, loc[1])
    full = ".".join(str(step) for step in inner)
    got = error.get("input")
    shown = f" (got {reprlib.repr(got)})" if isinstance(got, str | int | float) else ""
    shown = "" if reprlib.repr(got) in text else shown
    return f"{full}: {text}{shown}" if full else text


def _kind_message(data: dict, name: Any) -> str | None:
    """Why a node's kind is unknown; None when its model's own error says it already."""
    node = data["nodes"][name] if isinstance(data.get("nodes"), dict) else {}
    models = data.get("models") if isinstance(data.get("models"), dict) else {}
    if not isinstance(node, dict):
        return "a node must be a mapping (model:, input: ... or function:, args: ...)"
    if "kind" in node:
        return f"unknown kind {reprlib.repr(node['kind'])} (one of: {', '.join(NODE_KINDS)})"
    model = node.get("model")
    if model is None:
        return "a node needs 'model:' (or 'function:' for a python node)"
    if isinstance(model, str) and model in models:
        return None  # the model is declared but broken: its own issue says why
    known = [m for m in models if isinstance(m, str)]
    return f"unknown model {reprlib.repr(model)}{_suggest(str(model), known)}"


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    return f" (did you mean '{close[0]}'?)" if close else ""
