"""OpenAI function tools in a chat request: their body types and the checks that make a bad tool
a 400 (never a 500), before anything is rendered.

A tool is `{"type": "function", "function": {name, description?, parameters?, strict?}}`:
  name        OpenAI's rule, 1-64 characters of [A-Za-z0-9_-], unique within the request
  parameters  a JSON Schema object (`type` "object" or absent), itself valid JSON Schema
              (checked against its meta-schema: `"type": "strin"` or `"required": "x"` is refused)
`tool_choice` is "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}};
a named function must be one of `tools`, and any choice but "none" needs tools."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.errors import bad_request

MAX_TOOLS = 128  # OpenAI's limit per request
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Body):
    name: str = Field(..., pattern=TOOL_NAME_PATTERN, description="1-64 characters of [A-Za-z0-9_-]")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of type object")
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if v.get("type", "object") != "object":
            raise ValueError(f"function parameters must be a JSON Schema of type object (got type {v.get('type')!r})")
        problem = json_schema_problem(v)
        if problem is not None:
            raise ValueError(f"function parameters are not a valid JSON Schema: {problem}")
        return v


class FunctionTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


def json_schema_problem(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not valid JSON Schema (its own draft's meta-schema, 2020-12 by default), or None."""
    from jsonschema import Draft202012Validator, SchemaError, validators

    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"{e.message}" + (f" (at {where})" if where else "")
    return None


def check_tool_request(tools: Sequence[FunctionTool] | None, tool_choice: ToolChoice | None) -> None:
    """The checks across fields: 400 naming the field, before any rendering."""
    tools = tools or ()
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools per request (got {len(tools)})", param="tools", code="invalid_value")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.function.name in seen:
            raise bad_request(f"tools[{i}]: the function name {t.function.name!r} is used twice", param=f"tools.{i}.function.name",
                              code="invalid_value")
        seen.add(t.function.name)
    if tool_choice is None or tool_choice == "none" or tool_choice == "auto":
        return
    if not tools:
        raise bad_request("tool_choice needs tools", param="tool_choice", code="invalid_value")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in seen:
        raise bad_request(f"tool_choice names the function {tool_choice.function.name!r}, which is not in tools",
                          param="tool_choice", code="invalid_value")


def template_tools(tools: Sequence[FunctionTool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template's `tools` argument takes them (OpenAI's JSON shape)."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def tools_chars(tools: Sequence[FunctionTool] | None) -> int:
    """Characters the tools add to a rendered prompt (their JSON), for the bound on prompt size."""
    return sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in tools or ())
