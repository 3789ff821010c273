"""Structured outputs on the OpenAI routes: ``response_format``, the ``guided_*``
extensions (as vLLM names them) and tool calls, each turned into one engine
``Constraint`` (engine/constraints.py).

- ``response_format: {"type": "json_object"}``: any JSON object;
  ``{"type": "json_schema", "json_schema": {"name", "schema"}}``: that schema.
- ``guided_json`` (a schema), ``guided_regex``, ``guided_choice`` (strings),
  ``guided_grammar`` (Lark or GBNF): extensions for stock clients' ``extra_body``.
- ``tools`` with ``tool_choice: "required"`` or a named function: the reply is one
  call, ``{"name": ..., "arguments": {...}}`` matching the function's ``parameters``,
  returned as ``message.tool_calls`` with ``finish_reason: "tool_calls"``. With
  ``"auto"`` the tools go to the model's chat template (a 422 naming ``tools`` when
  the template does not show tools) and a reply that is exactly such a call is
  returned as one; otherwise it is text. ``"none"``: the tools are not shown.

At most one of them per request (422 naming the field otherwise).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trae_groups.engine.constraints import Constraint
from trae_groups.engine.errors import RequestError
from trae_groups.serving.http_errors import HTTPError


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


def tool_call_constraint(tools: list[Tool]) -> Constraint:
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    return build("tools", "json_schema", schema)


def tool_calls(text: str, tools: list[Tool] | None) -> list[dict] | None:
    """The reply as OpenAI ``tool_calls`` when it is exactly one call of a given tool."""
    if not tools:
        return None
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    names = {t.function.name for t in tools}
    if not (isinstance(call, dict) and call.get("name") in names and "arguments" in call):
        return None
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
        }
    ]
