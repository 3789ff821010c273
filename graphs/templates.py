"""Node templates and `when:` conditions: Jinja2 in a sandbox that cannot reach out.

A graph file must never run code or read files, so the environment is Jinja's
immutable sandbox with no loader (no include/import/extends), no extensions, no
constant folding (so validating a template never evaluates it), StrictUndefined (a
typo fails loudly instead of rendering as ""), and attribute access that prefers
dict keys (so a result field named `items` is the field, not ``dict.items``). Nor
may a template spend the process: sizes, work per render and nesting are bounded
(graphs/sandbox.py).

The rendering context is ``{"inputs": {...}, "<node>": result dict or None, ...}``.

Raw-value rule: a template that is exactly one ``{{ expression }}`` (whitespace
around it allowed) yields the expression's value unchanged — a list stays a list, a
number a number. Any other template renders to a string.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2 import Undefined, meta, nodes
from jinja2.environment import Template, TemplateExpression
from jinja2.exceptions import TemplateSyntaxError
from jinja2.parser import Parser
from pydantic import BaseModel

from trae_groups.graphs.errors import TemplateRenderError
from trae_groups.graphs.nodes import KINDS, TEMPLATE_FIELDS, NodeBase
from trae_groups.graphs.sandbox import (
    MAX_DEPTH,
    VALUE_CLOSE,
    VALUE_OPEN,
    LimitExceeded,
    SpecialText,
    bound,
    budgeted,
    depth,
)
from trae_groups.graphs.sandbox import make_environment as make_environment

_SINGLE = re.compile(r"^\s*\{\{-?(.*?)-?\}\}\s*$", re.S)
_FORBIDDEN_NODES = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)


ENV = make_environment()
PROMPT_ENV = make_environment(mark_values=True)  # the fields a node kind names TEXT_FIELDS
_TOO_DEEP = f"template nested too deeply (more than {MAX_DEPTH} levels)"


# ---------------------------------------------------------------- static analysis


@dataclass(frozen=True)
class TemplateRef:
    """A name a template reads: `intent.label` is ("intent", "label", line); ``path``
    is every name after the root (`extract.json.order_id`: ("json", "order_id"))."""

    root: str
    field: str | None
    line: int
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class TemplateProblem:
    """Something wrong in a template; `line` is the template's own line number."""

    message: str
    line: int | None


@dataclass(frozen=True)
class TemplateInfo:
    """What a template reads and what is wrong with it."""

    references: tuple[TemplateRef, ...]
    problems: tuple[TemplateProblem, ...]


def parse(source: str, *, expression: bool = False) -> nodes.Template:
    """The AST of a template, or of a condition expression wrapped as one."""
    if not expression:
        return ENV.parse(source)
    parser = Parser(ENV, source, state="variable")
    expr = parser.parse_expression()
    if not parser.stream.eos:
        token = parser.stream.current
        raise TemplateSyntaxError(f"unexpected {token.value!r} after the condition", token.lineno)
    root = nodes.Template([nodes.Output([expr], lineno=1)], lineno=1)
    root.set_environment(ENV)
    return root


def analyze(source: str, *, expression: bool = False) -> TemplateInfo:
    """Parse without running: syntax errors, forbidden constructs, free references."""
    try:
        ast = parse(source, expression=expression)
    except TemplateSyntaxError as exc:
        return TemplateInfo((), (TemplateProblem(f"template syntax: {exc.message}", exc.lineno),))
    except RecursionError:
        return TemplateInfo((), (TemplateProblem(_TOO_DEEP, None),))
    if depth(ast) > MAX_DEPTH:
        return TemplateInfo((), (TemplateProblem(_TOO_DEEP, None),))
    unknown = tuple(_unknown_names(ast))
    if unknown:  # Jinja's own analysis stops at the first with an exception
        return TemplateInfo((), unknown)
    free = meta.find_undeclared_variables(ast) - set(ENV.globals)
    return TemplateInfo(tuple(_references(ast, free)), tuple(_forbidden(ast)))


def _unknown_names(ast: nodes.Template) -> Iterator[TemplateProblem]:
    """Filters and tests the environment does not have (a compile error otherwise)."""
    for node in ast.find_all((nodes.Filter, nodes.Test)):
        known, kind = (
            (ENV.filters, "filter") if isinstance(node, nodes.Filter) else (ENV.tests, "test")
        )
        if node.name not in known:
            hint = difflib.get_close_matches(node.name, [n for n in known if ":" not in n], 1)
            did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
            yield TemplateProblem(f"unknown {kind} '{node.name}'{did_you_mean}", node.lineno)


def _forbidden(ast: nodes.Template) -> Iterator[TemplateProblem]:
    for node in ast.find_all(_FORBIDDEN_NODES):
        yield TemplateProblem("templates cannot include, import or extend files", node.lineno)
    for node in ast.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            attr = node.attr
        elif isinstance(node, nodes.Getitem):
            attr = _const(node.arg)
        else:  # `x | attr('__class__')`
            attr = _const(node.args[0]) if node.name == "attr" and node.args else None
        if isinstance(attr, str) and attr.startswith("_"):
            yield TemplateProblem(f"attribute {attr!r} is not allowed", node.lineno)
    for node in ast.find_all(nodes.Name):
        if node.name == "self":
            yield TemplateProblem("'self' is not allowed in templates", node.lineno)


def _references(ast: nodes.Template, free: set[str]) -> Iterator[TemplateRef]:
    fielded: set[str] = set()
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        root, path = _chain(node)
        if root in free and path:
            fielded.add(root)
            yield TemplateRef(root, path[0], node.lineno, path)
    for node in ast.find_all(nodes.Name):
        if node.name in free and node.name not in fielded:
            fielded.add(node.name)
            yield TemplateRef(node.name, None, node.lineno)


def _chain(node: nodes.Node) -> tuple[str | None, tuple[str, ...]]:
    """The root name of `a.b["c"].d` and its string names (up to the first that is not)."""
    steps: list[Any] = []
    while isinstance(node, nodes.Getattr | nodes.Getitem):
        steps.append(node.attr if isinstance(node, nodes.Getattr) else _const(node.arg))
        node = node.node
    if not isinstance(node, nodes.Name):
        return None, ()
    path: list[str] = []
    for step in reversed(steps):
        if not isinstance(step, str):
            break
        path.append(step)
    return node.name, tuple(path)


def _const(node: nodes.Node) -> Any:
    return node.value if isinstance(node, nodes.Const) else None


def node_templates(node: NodeBase | Mapping[str, Any]) -> Iterator[tuple[tuple, str, bool]]:
    """Every template of a node as (path inside the node, source, is_condition): its
    ``when`` and ``cut_when`` and every string inside its kind's template fields.

    Takes a raw mapping too, so templates of a node that failed its shape checks
    are still checked (all fields that are templates in any kind).
    """
    fields = node.model_dump() if isinstance(node, BaseModel) else node
    for condition in ("when", "cut_when"):
        if isinstance(fields.get(condition), str):
            yield (condition,), fields[condition], True
    kind = KINDS.get(fields.get("kind")) if isinstance(fields.get("kind"), str) else None
    for key in kind.spec.TEMPLATES if kind else TEMPLATE_FIELDS:
        yield from _value_templates((key,), fields.get(key))


def _value_templates(path: tuple, value: Any) -> Iterator[tuple[tuple, str, bool]]:
    if isinstance(value, str):
        yield path, value, False
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _value_templates((*path, key), item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _value_templates((*path, i), item)


# ---------------------------------------------------------------- rendering


class PromptText(str):
    """A rendered prompt that knows which characters the request's values supplied
    (``inlined``: (start, end) spans): the engine tokenizes a special token's text inside
    them as plain characters, so a value cannot forge a turn marker, while the template's
    own text keeps its control tokens. ``{{ x | special_tokens }}`` opts a value out."""

    inlined: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_marked(cls, marked: str) -> PromptText:
        pieces, spans, at = [], [], 0
        for i, part in enumerate(marked.split(VALUE_OPEN)):
            value, closed, literal = part.partition(VALUE_CLOSE) if i else ("", "", part)
            if i and not closed:  # no close mark: the template wrote one itself; as text
                value, literal = "", VALUE_OPEN + part
            if value:
                spans.append((at, at + len(value)))
                at += len(value)
                pieces.append(value)
            pieces.append(literal)
            at += len(literal)
        text = cls("".join(pieces))
        text.inlined = tuple(spans)
        return text

    @classmethod
    def of_value(cls, value: Any) -> PromptText:
        """A prompt that is one value, all of it inlined unless it is SpecialText."""
        text = cls(value if isinstance(value, str) else str(value))
        text.inlined = () if isinstance(value, SpecialText) or not text else ((0, len(text)),)
        return text


class GraphTemplate:
    """One compiled template; render() follows the raw-value rule (module doc). With
    ``PROMPT_ENV`` it renders to a PromptText."""

    def __init__(self, source: str, env: Any = ENV):
        self.source = source
        self._prompt = env is PROMPT_ENV
        ast = bound(_checked(source, expression=False), env)
        self._template = _compile(source, ast, env)
        expression = _single_expression(source, ast)
        self._expression = (
            None if expression is None else _compile_expression(source, expression, env)
        )

    def render(self, context: Mapping[str, Any]) -> Any:
        try:
            if self._expression is None:
                text = budgeted(lambda: self._template.render(context))
                return PromptText.from_marked(text) if self._prompt else text
            value = _defined(budgeted(lambda: self._expression(context)))
            return PromptText.of_value(value) if self._prompt else value
        except TemplateRenderError:
            raise
        except Exception as exc:
            raise TemplateRenderError(f"template {_clip(self.source)}: {_describe(exc)}") from exc


class Condition:
    """A compiled `when:` expression; true means the node runs."""

    def __init__(self, source: str):
        self.source = source
        ast = bound(_checked(source, expression=True), ENV)
        self._expression = _compile_expression(source, ast.body[0].nodes[0])

    def evaluate(self, context: Mapping[str, Any]) -> bool:
        try:
            return bool(_defined(budgeted(lambda: self._expression(context))))
        except TemplateRenderError:
            raise
        except Exception as exc:
            raise TemplateRenderError(f"condition {_clip(self.source)}: {_describe(exc)}") from exc


def _checked(source: str, *, expression: bool) -> nodes.Template:
    """Parse, refusing what validation refuses (defence in depth for direct callers)."""
    try:
        ast = parse(source, expression=expression)
    except TemplateSyntaxError as exc:
        raise TemplateRenderError(f"template {_clip(source)}: {exc.message}") from exc
    except RecursionError:
        raise TemplateRenderError(f"template {_clip(source)}: {_TOO_DEEP}") from None
    if depth(ast) > MAX_DEPTH:
        raise TemplateRenderError(f"template {_clip(source)}: {_TOO_DEEP}")
    for problem in (*_forbidden(ast), *_unknown_names(ast)):
        raise TemplateRenderError(f"template {_clip(source)}: {problem.message}")
    return ast


def _single_expression(source: str, ast: nodes.Template) -> nodes.Expr | None:
    match = _SINGLE.match(source)
    if not match or len(ast.body) != 1 or not isinstance(ast.body[0], nodes.Output):
        return None
    parts = [
        n
        for n in ast.body[0].nodes
        if not (isinstance(n, nodes.TemplateData) and not n.data.strip())
    ]
    if len(parts) != 1 or isinstance(parts[0], nodes.TemplateData):
        return None
    return parts[0]


def _compile(source: str, ast: nodes.Template, env: Any = ENV) -> Template:
    try:
        return env.from_string(ast)
    except TemplateSyntaxError as exc:  # what only the compiler sees
        raise TemplateRenderError(f"template {_clip(source)}: {exc.message}") from exc


def _compile_expression(source: str, expression: nodes.Expr, env: Any = ENV) -> TemplateExpression:
    """Jinja's compile_expression, from an AST already checked and bounded."""
    target = nodes.Name("result", "store", lineno=1)
    root = nodes.Template([nodes.Assign(target, expression, lineno=1)], lineno=1)
    root.set_environment(env)
    return TemplateExpression(_compile(source, root, env), undefined_to_none=False)


def _defined(value: Any) -> Any:
    if isinstance(value, Undefined):
        value._fail_with_undefined_error()
    return value


def _describe(exc: Exception) -> str:
    if isinstance(exc, LimitExceeded):
        return f"over the template limits: {exc}"
    return str(exc) if str(exc) else type(exc).__name__


def _clip(source: str, limit: int = 120) -> str:
    return repr(source) if len(source) <= limit else repr(source[:limit]) + "..."


class NodeTemplates:
    """A node's templates compiled once, for the executor to render per request.

    render() gives {field: value} for each of the kind's template fields that is set
    (every string inside it rendered), checked by the node's ``check_rendered``.
    """

    def __init__(self, node: NodeBase):
        self.node = node
        self.when = Condition(node.when) if node.when is not None else None
        self.cut_when = Condition(node.cut_when) if node.cut_when is not None else None
        self._payload = {
            key: _compile_value(
                _plain(getattr(node, key)), PROMPT_ENV if key in node.TEXT_FIELDS else ENV
            )
            for key in node.TEMPLATES
            if getattr(node, key) is not None
        }

    def should_run(self, context: Mapping[str, Any]) -> bool:
        return self.when is None or self.when.evaluate(context)

    def render(self, context: Mapping[str, Any]) -> dict[str, Any]:
        return self.node.check_rendered(_render_value(self._payload, context))


def _plain(value: Any) -> Any:
    """Spec values as plain data (a message list's models become dicts)."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _compile_value(value: Any, env: Any = ENV) -> Any:
    if isinstance(value, str):
        return GraphTemplate(value, env)
    if isinstance(value, dict):
        return {key: _compile_value(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_compile_value(item, env) for item in value]
    return value


def _render_value(value: Any, context: Mapping[str, Any]) -> Any:
    if isinstance(value, GraphTemplate):
        return value.render(context)
    if isinstance(value, dict):
        return {key: _render_value(item, context) for key, item in value.items()}
    if isinstance(value, list):
        return [_render_value(item, context) for item in value]
    return value


def resolve_reference(reference: str, context: Mapping[str, Any]) -> Any:
    """The value of an output reference such as `reply.text` or `docs.0.title`.

    A skipped node (None in the context) makes the whole reference None.
    """
    root, *steps = reference.split(".")
    if root not in context:
        raise TemplateRenderError(f"{reference!r}: {root!r} has no value yet")
    value = context[root]
    for step in steps:
        if value is None:
            return None
        value = _step(value, step, reference)
    return value


def _step(value: Any, step: str, reference: str) -> Any:
    if isinstance(value, Mapping) and step in value:
        return value[step]
    if isinstance(value, list | tuple) and step.isdigit() and int(step) < len(value):
        return value[int(step)]
    raise TemplateRenderError(f"{reference!r}: no field {step!r}")
