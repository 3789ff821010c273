"""The template sandbox, bounded: compiling never evaluates, rendering cannot run away.

Jinja's sandbox stops a template from reaching out of it, but not from spending the
process: Jinja folds constant expressions while it compiles (so ``{{ 9 ** (9 ** 9) }}``
hangs validation and ``{{ 'x' * 10**9 }}`` allocates gigabytes), and at render time
nothing limits what operators, filters, methods and loops may build. Here:

- **No constant folding.** Arithmetic operators are intercepted (Jinja never folds
  an intercepted operator) and every filter takes the render context (Jinja never
  folds those), so compiling a template only translates it.
- **Sizes.** No operator, filter, method or ``~`` may build a string, list or tuple
  of more than ``MAX_LENGTH`` items or an integer of more than ``MAX_INT_BITS`` bits;
  widths (``center``, ``'%9999d'``, ``'{:>9999}'``) are checked before anything is
  built.
- **Work.** One render may take ``MAX_STEPS`` steps (a loop iteration, a call, a
  filter, an operator: a fraction of a second of CPU) and write or build
  ``MAX_CHARS`` characters (every ``{{ }}`` output, every string an operation
  builds, a loop body's literal text once per iteration).
- **Nesting.** A template nested deeper than ``MAX_DEPTH`` is refused when parsed.

Exceeding a bound raises ``LimitExceeded``; templates.py turns it into a
``TemplateRenderError`` that names the template.
"""

from __future__ import annotations

import contextvars
import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial, update_wrapper
from typing import Any

from jinja2 import StrictUndefined, nodes, pass_context
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, safe_range
from jinja2.utils import Namespace, _PassArg

MAX_LENGTH = 1 << 22  # characters of one string, items of one list or tuple (4 Mi)
MAX_INT_BITS = 1 << 14  # about 4,900 decimal digits
MAX_STEPS = 1 << 18  # per render: loop iterations, calls, filters, operators
MAX_CHARS = 1 << 24  # per render: characters output or built (16 Mi)
MAX_DEPTH = 64  # nesting of expressions and blocks in one template

_ARITHMETIC = frozenset({"+", "-", "*", "/", "//", "%", "**"})
_LOOP_FILTER = "trae:loop"  # not an identifier: a template cannot name these two
_CONCAT_FILTER = "trae:concat"


class LimitExceeded(Exception):
    """A template went past one of the bounds above."""


# ---------------------------------------------------------------- the work budget


class _Budget:
    __slots__ = ("chars", "steps")

    def __init__(self):
        self.steps = MAX_STEPS
        self.chars = MAX_CHARS


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "trae_template_budget", default=None
)


def budgeted(render: Callable[[], Any]) -> Any:
    """Run one render under a fresh budget of steps and characters."""
    token = _budget.set(_Budget())
    try:
        return render()
    finally:
        _budget.reset(token)


def _charge(steps: int = 1, chars: int = 0) -> None:
    budget = _budget.get()
    if budget is None:  # outside a render (compile-time constants): nothing to count
        return
    budget.steps -= steps
    budget.chars -= chars
    if budget.steps < 0:
        raise LimitExceeded(f"more than {MAX_STEPS} steps (loop iterations, calls, operators)")
    if budget.chars < 0:
        raise LimitExceeded(f"more than {MAX_CHARS} characters written or built")


def _built(value: Any) -> Any:
    """Check and charge what an operation just built."""
    if isinstance(value, str | list | tuple):
        _check_length(len(value))
        _charge(0, len(value))
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise LimitExceeded(f"an integer of more than {MAX_INT_BITS} bits")
    return value


def _check_length(length: int) -> None:
    if length > MAX_LENGTH:
        raise LimitExceeded(f"a string or list of more than {MAX_LENGTH} items")


def _check_int(value: Any, what: str) -> None:
    if isinstance(value, int) and abs(value) > MAX_LENGTH:
        raise LimitExceeded(f"{what} {value} is larger than {MAX_LENGTH}")


# ---------------------------------------------------------------- operators


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before computing it, a result past the size bounds."""
    seq = (str, list, tuple)
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "*":
        if isinstance(left, seq) and isinstance(right, int):
            _check_length(len(left) * max(right, 0))
        elif isinstance(right, seq) and isinstance(left, int):
            _check_length(len(right) * max(left, 0))
        elif ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise LimitExceeded(f"an integer of more than {MAX_INT_BITS} bits")
    elif operator == "**" and ints and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
            raise LimitExceeded(f"an integer of more than {MAX_INT_BITS} bits")
    elif operator == "+" and isinstance(left, seq) and isinstance(right, seq):
        _check_length(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(left, right)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent_format(fmt: str, args: Any) -> None:
    """`'%99999999d' % 1` and `'%*d' % (10**9, 1)`: widths are refused up front."""
    for match in _PERCENT_SPEC.finditer(fmt):
        for number in match.groups():
            if number == "*":
                values = args if isinstance(args, tuple) else (args,)
                for value in values:
                    _check_int(value, "a format width")
            elif number is not None:
                _check_int(int(number), "a format width")


_FORMAT_SPEC = re.compile(r"^(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?")


class _BoundedFormatter(SandboxedFormatter):
    """`'{:>999999999}'.format(x)`: str.format's widths, checked once resolved."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        match = _FORMAT_SPEC.match(format_spec)
        for number in match.groups() if match else ():
            if number:
                _check_int(int(number), "a format width")
        return _built(super().format_field(value, format_spec))


# ---------------------------------------------------------------- methods and filters


def _check_replace(text: str, args: tuple, kwargs: dict) -> None:
    """str.replace and the replace filter: the result's length, known before."""
    old = args[0] if args else kwargs.get("old")
    new = args[1] if len(args) > 1 else kwargs.get("new")
    if not (isinstance(old, str) and isinstance(new, str)):
        return
    count = args[2] if len(args) > 2 else kwargs.get("count")
    hits = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    _check_length(len(text) + hits * (len(new) - len(old)))


def _check_str_method(name: str, text: str, args: tuple, kwargs: dict) -> None:
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_int(args[0], f"str.{name} width")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_length(len(text) + text.count("\t") * max(size, 0))
    elif name == "replace":
        _check_replace(text, args, kwargs)


def _check_filter(name: str, value: Any, args: tuple, kwargs: dict) -> None:
    if name in ("center", "indent", "batch", "slice"):
        width = args[0] if args else kwargs.get("width", kwargs.get("linecount"))
        _check_int(width, f"the {name} filter's size")
        if name == "indent" and isinstance(value, str) and isinstance(width, int):
            _check_length(len(value) + (value.count("\n") + 1) * max(width, 0))
    elif name == "format" and isinstance(value, str):
        _check_percent_format(value, kwargs or args)
    elif name == "replace" and isinstance(value, str):
        _check_replace(value, args, kwargs)


def _guard_filter(name: str, func: Callable) -> Callable:
    """The filter, taking the context (so Jinja never folds it), checked and charged."""
    pass_arg = _PassArg.from_obj(func)

    def guarded(context: Context, value: Any = None, *args: Any, **kwargs: Any) -> Any:
        _charge(1)
        _check_filter(name, value, args, kwargs)
        if pass_arg is _PassArg.context:
            result = func(context, value, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = func(context.eval_ctx, value, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = func(context.environment, value, *args, **kwargs)
        else:
            result = func(value, *args, **kwargs)
        return _built(result)

    return pass_context(update_wrapper(guarded, func, updated=()))


@pass_context
def _loop(context: Context, iterable: Iterable, text: int) -> Iterator:
    for item in iterable:
        _charge(1, text)
        yield item


@pass_context
def _concat(context: Context, parts: list) -> str:
    texts = [str(part) for part in parts]
    _check_length(sum(map(len, texts)))
    return _built("".join(texts))


def _emit(value: Any) -> str:
    """``finalize``: every ``{{ }}`` output is charged by its length."""
    text = value if isinstance(value, str) else str(value)
    _charge(0, len(text))
    return text


#: Around each value a prompt template outputs (``make_environment(mark_values=True)``), so
#: that the rendered text says which characters came from values: their special tokens'
#: text is tokenized as text (graphs/templates.PromptText). Private-use characters; a value
#: that holds one has it replaced by U+FFFD.
VALUE_OPEN, VALUE_CLOSE = "\ue002", "\ue003"


class SpecialText(str):
    """A value the graph lets keep its special tokens (the ``special_tokens`` filter)."""


def _emit_marked(value: Any) -> str:
    text = _emit(value)
    if isinstance(value, SpecialText):
        return text.replace(VALUE_OPEN, "\ufffd").replace(VALUE_CLOSE, "\ufffd")
    text = text.replace(VALUE_OPEN, "\ufffd").replace(VALUE_CLOSE, "\ufffd")
    return VALUE_OPEN + text + VALUE_CLOSE


def _special_tokens(value: Any) -> SpecialText:
    """``{{ inputs.x | special_tokens }}``: this value's control tokens stay control tokens."""
    return SpecialText(value if isinstance(value, str) else str(value))


# ---------------------------------------------------------------- the environment


class Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, bounded (module doc); mapping keys win over
    methods for `a.b`, so a result field named `items` is the field."""

    intercepted_binops = _ARITHMETIC

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, Mapping):
            try:
                return obj[attribute]
            except (KeyError, TypeError):
                pass
        return super().getattr(obj, attribute)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _charge(1)
        _check_binop(operator, left, right)
        return _built(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _charge(1)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(getattr(__obj, "__name__", ""), owner, args, kwargs)
        return _built(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        formatter = _BoundedFormatter(self)
        text = value.__self__
        if value.__name__ == "format_map":

            def format_map(mapping: Mapping) -> str:
                return formatter.vformat(text, (), mapping)

            return format_map
        return partial(_vformat, formatter, text)


def _vformat(formatter: string.Formatter, text: str, *args: Any, **kwargs: Any) -> str:
    return formatter.vformat(text, args, kwargs)


def make_environment(mark_values: bool = False) -> Sandbox:
    """A fresh bounded sandbox; its globals are only range (bounded), dict and namespace.
    ``mark_values``: every ``{{ }}`` output is put between VALUE_OPEN and VALUE_CLOSE."""
    finalize = _emit_marked if mark_values else _emit
    env = Sandbox(undefined=StrictUndefined, autoescape=False, optimized=False, finalize=finalize)
    env.globals = {"range": safe_range, "dict": dict, "namespace": Namespace}
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters[_LOOP_FILTER] = _loop
    env.filters[_CONCAT_FILTER] = _concat
    env.filters["special_tokens"] = _special_tokens
    return env


# ---------------------------------------------------------------- the AST, before compiling


def depth(ast: nodes.Node) -> int:
    """How deeply the AST nests (iteratively: a deep AST must not exhaust the stack)."""
    deepest, stack = 0, [(ast, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # past the bound the answer is already known
            stack.extend((child, level + 1) for child in node.iter_child_nodes())
    return deepest


def bound(ast: nodes.Template, env: Sandbox) -> nodes.Template:
    """Route loops and ``~`` through the budget. Call on a freshly parsed AST (it is
    changed in place) that passed the checks, right before compiling it."""
    for loop in ast.find_all(nodes.For):
        text = sum(len(n.data) for n in _body_nodes(loop) if isinstance(n, nodes.TemplateData))
        cost = nodes.Const(text, lineno=loop.lineno)
        loop.iter = nodes.Filter(
            loop.iter, _LOOP_FILTER, [cost], [], None, None, lineno=loop.lineno
        )
    for parent in list(ast.find_all(nodes.Node)):
        for name, child in parent.iter_fields():
            if isinstance(child, nodes.Concat):
                setattr(parent, name, _bounded_concat(child))
            elif isinstance(child, list):
                child[:] = [_bounded_concat(c) if isinstance(c, nodes.Concat) else c for c in child]
    ast.set_environment(env)
    return ast


def _body_nodes(loop: nodes.For) -> Iterator[nodes.Node]:
    for node in loop.body:
        yield node
        yield from node.find_all(nodes.TemplateData)


def _bounded_concat(node: nodes.Concat) -> nodes.Filter:
    parts = nodes.List(node.nodes, lineno=node.lineno)
    return nodes.Filter(parts, _CONCAT_FILTER, [], [], None, None, lineno=node.lineno)
