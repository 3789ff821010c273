"""Small types every part of a graph spec shares: names, durations, references, and
the base of every spec class. One home, so a rule (what a name may be) is written once.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from trae_groups.engine.sampling import BOUNDS, DESCRIPTIONS, SamplingParams

#: Names a node cannot take: they mean something else inside templates.
RESERVED_NAMES = frozenset(
    {"inputs", "and", "or", "not", "in", "is", "if", "else", "true", "false", "none"}
    | {"True", "False", "None", "loop", "self", "super", "caller", "varargs", "kwargs"}
    | {"range", "dict", "lipsum", "cycler", "joiner", "namespace"}
)

# used with fullmatch: a "$" anchor would let a trailing newline through
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SLUG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_REFERENCE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
#: The longest name a graph, model, version or adapter may have.
MAX_NAME_CHARS = 64
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")


# ---------------------------------------------------------------- small types


def _identifier(kind: str, reserved: frozenset[str] = frozenset()) -> AfterValidator:
    def check(name: str) -> str:
        if not _IDENT.fullmatch(name):
            raise ValueError(f"{kind} name {name!r} must be a letter or _ then letters, digits, _")
        if name in reserved:
            raise ValueError(f"{kind} name {name!r} is reserved in templates")
        return name

    return AfterValidator(check)


def slug(name: str) -> str:
    """The one rule for a graph, model, version or adapter name."""
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"name is {len(name)} characters; at most {MAX_NAME_CHARS}")
    if not _SLUG.fullmatch(name):
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
    if not _REFERENCE.fullmatch(value):
        raise ValueError("must look like 'node.field' or 'inputs.name'")
    return value


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


NodeName = Annotated[str, _identifier("node", RESERVED_NAMES)]
InputName = Annotated[str, _identifier("input")]
ArgName = Annotated[str, _identifier("argument")]
Slug = Annotated[str, AfterValidator(slug)]
Seconds = Annotated[float, BeforeValidator(_duration), Field(gt=0)]
FunctionRef = Annotated[str, AfterValidator(_function_ref)]
Reference = Annotated[str, AfterValidator(_reference)]
NameList = Annotated[list[str], BeforeValidator(_as_list)]


class Spec(BaseModel):
    """Every spec class: unknown keys, loose types and NaN are errors; values never change."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


_SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def sampling_field(name: str, default: Any = ..., **extra: Any) -> Any:
    """A pydantic Field for a sampling option, with the engine's range, default and
    description (engine/sampling.py is their one home); ``default`` overrides only
    where a caller's "not given" differs (OpenAI's null)."""
    bound = BOUNDS.get(name)
    chosen = _SAMPLING_DEFAULTS[name] if default is ... else default
    if name == "stop":
        chosen = [] if default is ... else default
    limits = bound.pydantic() if bound is not None else {}
    return Field(chosen, description=DESCRIPTIONS.get(name), **limits, **extra)
