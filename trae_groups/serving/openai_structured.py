"""Structured outputs on the OpenAI routes: ``response_format``, the ``guided_*``
extensions (as vLLM names them) and tool calls, each turned into one engine
``Constraint`` (engine/constraints.py).

- ``response_format: {"type": "json_object"}``: any JSON object;
  ``{"type": "json_schema", "json_schema": {"name", "schema"}}``: that schema.
- ``guided_json`` (a schema), ``guided_regex``, ``guided_choice`` (strings),
  ``guided_grammar`` (Lark or GBNF): extensions for stock clients' ``extra_body``.
- ``tools`` with ``tool_choice: "required"`` or a named function: the reply is one
  call, ``{"name": ..., "arguments": {...}}`` matching the function's ``parameters``,
  returned as ``message.tool_calls`` (``finish_reason: "tool_calls"``, or ``"length"``
  with the arguments written so far when ``max_tokens`` cut it). With ``"auto"`` the
  tools go to the model's chat template (a 422 naming ``tools`` when the template does
  not show tools) and the reply is constrained to text or calls in the model's own
  syntax (trae_groups/serving/tool_parsers.py), read back as ``tool_calls``.
  ``"none"``: the tools are not shown.
- Tool schemas are strict: an object schema that does not say ``additionalProperties``
  takes no keys beyond its ``properties``.

At most one of them per request (422 naming the field otherwise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trae_groups.engine.constraints import COMPACT_JSON, Constraint
from trae_groups.engine.errors import RequestError
from trae_groups.serving.http_errors import HTTPError
from trae_groups.serving.tool_parsers import SCANNERS, ToolStream, call_id, tool_calls


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str = "output"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class Structured(_Body):
    """The structured-output fields both OpenAI routes take."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | None = Field(None, description="extension: a JSON Schema")
    guided_regex: str | None = Field(None, description="extension: a regular expression")
    guided_choice: list[str] | None = Field(None, description="extension: one of these strings")
    guided_grammar: str | None = Field(None, description="extension: a Lark or GBNF grammar")

    def constraint(self) -> tuple[Constraint | None, str | None]:
        """The one constraint the request asks for, and the field that asked."""
        asked = [
            (field, value)
            for field, value in (
                ("response_format", _from_format(self.response_format)),
                ("guided_json", self.guided_json is not None and ("json_schema", self.guided_json)),
                ("guided_regex", self.guided_regex is not None and ("regex", self.guided_regex)),
                ("guided_choice", self.guided_choice is not None and ("choice", self.guided_choice)),
                ("guided_grammar", self.guided_grammar is not None and ("grammar", self.guided_grammar)),
            )
            if value
        ]  # fmt: skip
        if not asked:
            return None, None
        if len(asked) > 1:
            names = ", ".join(f for f, _ in asked)
            raise HTTPError(
                422, f"{asked[1][0]}: give one constraint, not {names}", field=asked[1][0]
            )
        field, (kind, spec) = asked[0]
        return build(field, kind, spec), field


def _from_format(fmt: ResponseFormat | None) -> tuple[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json_schema", {"type": "object"}
    if fmt.json_schema is None:
        raise HTTPError(
            422, "response_format: json_schema needs its schema", field="response_format"
        )
    return "json_schema", fmt.json_schema.schema_


def build(field: str, kind: str, spec: Any) -> Constraint:
    """A Constraint, or a 422 that names the request's field."""
    try:
        return Constraint(kind, spec if isinstance(spec, str) else json.dumps(spec))
    except RequestError as exc:
        raise HTTPError(422, f"{field}: {exc.message}", field=field) from None


class ToolFields(_Body):
    """The tool-calling fields of a chat request."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def forced(self) -> list[Tool]:
        """The tools a reply must call one of ("required" or a named one), else []."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
                raise HTTPError(422, "tool_choice: no tools were given", field="tool_choice")
            return []
        if self.tool_choice == "required":
            return list(self.tools)
        chosen = [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        if not chosen:
            names = [t.function.name for t in self.tools]
            raise HTTPError(422, f"tool_choice: no tool named {self.tool_choice.function.name!r}; "
                                 f"tools: {names}", field="tool_choice")  # fmt: skip
        return chosen

    def shown(self) -> list[dict] | None:
        """The tools the chat template shows the model, for it to decide ("auto"); a
        forced call is constrained instead, and "none" hides them."""
        if not self.tools or self.tool_choice not in (None, "auto"):
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def strict(schema: Any) -> Any:
    """The schema with every object that does not say ``additionalProperties`` closed
    to keys beyond its ``properties`` (OpenAI's strict function schemas)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}  # fmt: skip
    if (schema.get("type") == "object" or "properties" in schema) and (
        "additionalProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out


def _call_schema(tools: list[Tool], key: str = "arguments") -> dict:
    """One call of any of these tools: ``{"name": <its name>, key: <its arguments>}``."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    key: strict(t.function.parameters),
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }


def tool_call_constraint(tools: list[Tool]) -> Constraint:
    return build("tools", "json_schema", _call_schema(tools))


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})


def auto_constraint(fmt: str, tools: list[Tool], marker: int | None = None) -> Constraint:
    """``tool_choice: auto``: the reply is free text (that does not open a call) or calls
    in the model's syntax whose arguments match the tools' schemas. ``marker``: the id of
    the special token that opens Mistral's calls, when the tokenizer has one."""
    call = _json(_call_schema(tools, "parameters" if fmt == "llama3" else "arguments"))
    if fmt == "hermes":
        calls, opener = f'"<tool_call>\\n" {call} "\\n</tool_call>"', r"<tool_call>"
        body = f'start: TEXT | calls\ncalls: one ("\\n" one)*\none: {calls}'
    elif fmt == "mistral":
        array = _json({"type": "array", "items": _call_schema(tools), "minItems": 1})
        lead = f"<[{marker}]> " if marker is not None else ""
        body, opener = f"start: TEXT | calls\ncalls: {lead}{array}", r"[\[]"
    else:  # llama3 and json: the reply is the calls
        sep = '"; "' if fmt == "llama3" else None
        more = f" ({sep} {call})*" if sep else ""
        body, opener = f"start: TEXT | calls\ncalls: {call}{more}", r"[{]"
    text = f"TEXT: /(?s:.*)/ & ~/(?s:\\s*{opener}.*)/"
    return build("tools", "grammar", f"{body}\n{text}")


@dataclass(frozen=True)
class ToolReading:
    """How one chat request's reply is read for calls: the syntax, the tools' names,
    and whether a call was forced (a forced call cut short is still a call)."""

    fmt: str
    names: frozenset[str]
    forced: bool = False

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The whole reply as a chat ``message`` and its finish reason."""
        content, calls = tool_calls(self.fmt, text, set(self.names))
        if not calls and self.forced:
            content, calls = None, self._cut(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        return message, "tool_calls" if finish == "stop" else finish

    def _cut(self, text: str) -> list[dict]:
        """A forced call that stopped early: its name (the one forced tool's, when the
        name itself was cut) and the arguments written so far."""
        found = SCANNERS[self.fmt](text).calls
        name = found[0].name if found else None
        if name not in self.names:
            name = next(iter(self.names)) if len(self.names) == 1 else None
        if name is None:
            return []
        arguments = found[0].arguments if found else ""
        return [{"id": call_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}]  # fmt: skip

    def streaming(self) -> ToolDeltas:
        return ToolDeltas(self)


class ToolDeltas:
    """One streamed reply's chat deltas: text and calls as the reply allows them."""

    def __init__(self, reading: ToolReading):
        self.reading = reading
        self.stream = ToolStream(reading.fmt, set(reading.names))

    def feed(self, piece: str) -> list[dict]:
        return self.stream.feed(piece)

    def end(self, finish: str) -> tuple[list[dict], str]:
        """The last deltas and the finish reason."""
        cut = (
            []
            if self.stream.called or not self.reading.forced
            else self.reading._cut(self.stream.text)
        )
        if cut:  # a forced call stopped before its name was out: all of it is the call
            return [{"tool_calls": [{"index": 0, **cut[0]}]}], finish
        deltas = self.stream.feed("", final=True)
        return deltas, ("tool_calls" if self.stream.called and finish == "stop" else finish)


def reading(fmt: str, tools: list[Tool], forced: bool) -> ToolReading:
    return ToolReading(fmt, frozenset(t.function.name for t in tools), forced)


def chat_tools(
    body: ToolFields, target: Any, config: Any, constraint: Constraint | None, source: str | None
) -> tuple[Constraint | None, str | None, ToolReading | None]:
    """A chat request's constraint, the field that asked for it, and how its reply is
    read for calls. A forced call is constrained to one JSON call; ``auto`` to text or
    calls in the model's syntax (unless another constraint applies: it wins)."""
    forced = body.forced()
    if forced:
        if constraint is not None:
            raise HTTPError(422, f"{source}: give tools or {source}, not both", field=source)
        return tool_call_constraint(forced), "tools", reading("json", forced, forced=True)
    if not body.shown() or target.model is None:
        return constraint, source, None
    fmt, tokenizer = _format(target, config)
    if constraint is not None:
        return constraint, source, reading(fmt, body.tools, forced=False)
    marker = _marker(tokenizer) if fmt == "mistral" else None
    return auto_constraint(fmt, body.tools, marker), "tools", reading(fmt, body.tools, False)


def _format(target: Any, config: Any) -> tuple[str, Any]:
    """The model's tool-call syntax: its graph's ``tool_call_parser``, else the server's
    (``--tool-call-parser``), else what its chat template shows; and its tokenizer."""
    from trae_groups.engine.chat import tool_call_format
    from trae_groups.serving import model_files

    tokenizer = model_files.tokenizer(target, field="tools")
    named = target.served.spec.models[target.model].tool_call_parser or config.tool_call_parser
    return named or tool_call_format(tokenizer), tokenizer


def _marker(tokenizer: Any) -> int | None:
    """The id of Mistral's ``[TOOL_CALLS]`` token, when the vocabulary has it."""
    found = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    return found if isinstance(found, int) and found != tokenizer.unk_token_id else None
