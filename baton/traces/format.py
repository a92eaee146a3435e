"""The Baton trace format: JSONL, one `Conversation` per line.

A conversation is what one client does: it sends its turns in order, pausing `think_time_s`
before each one, and appends the server's reply to the history as an assistant message before
the next turn. See docs/TRACES.md for the field reference and an example line.

A native function-calling conversation carries OpenAI `tools` (each checked as the server checks
a request's tools, deployments/tool_schema.py) and a `tool_env` that executes the model's calls;
its turns are user turns only: the replayer runs the tool calls live (baton/traces/replay_native.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.tool_schema import FunctionTool


class Turn(BaseModel):
    """One request the client sends: a message appended to the history, then a completion."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "tool"] = Field(description="role of the appended message")
    content: str = Field(description="message text; for tool turns the tool results (JSON text)")
    think_time_s: float = Field(default=0.0, ge=0.0, description="client pause before sending")
    max_tokens: int = Field(default=64, ge=1, description="completion budget for the reply")
    effective: bool = Field(
        default=True,
        description="the reply is meant for the end user (true) or is a tool call (false); "
        "TTFET is measured to the first token of the first effective turn",
    )
    memories: dict[str, Any] | None = Field(
        default=None, description='passed through as request field "memories", e.g. {"k": 20}'
    )
    ticks: list[Any] | None = Field(
        default=None, description="reserved for real-time sessions; the replayer ignores it"
    )
    add_tools: list[dict[str, Any]] | None = Field(
        default=None, description="native: OpenAI tools offered from this turn on (BFCL miss_func)"
    )

    @field_validator("add_tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_tools(v)


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Each tool valid as a request's tool (name, JSON Schema parameters); names unique."""
    if tools is None:
        return None
    names = [FunctionTool.model_validate(t).function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tool names used twice: {twice}")
    return tools


class ToolEnv(BaseModel):
    """What executes a native conversation's tool calls: BFCL's simulated tool classes
    (baton/traces/bfcl_tools.py ToolSession), loaded from the entry's initial state."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["bfcl"] = "bfcl"
    classes: list[str] = Field(min_length=1, description="BFCL involved_classes")
    initial_config: dict[str, Any] = Field(default_factory=dict, description="per-class state")
    long_context: bool = False
    names: dict[str, str] = Field(
        default_factory=dict, description="OpenAI tool name -> BFCL function name, where they differ"
    )

    def bfcl_name(self, tool_name: str) -> str:
        return self.names.get(tool_name, tool_name)


class Conversation(BaseModel):
    """One client's conversation: a system prompt and the turns it sends, in order."""

    model_config = ConfigDict(extra="forbid")

    conversation_id: str = Field(min_length=1)
    user: str = Field(default="anonymous", description="tenant/user id, sent as request `user`")
    system: str | None = Field(default=None, description="system prompt, e.g. tool docs")
    source: str = Field(default="", description='where it came from, e.g. "bfcl:multi_turn_base_3"')
    turns: list[Turn] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="native function calling: OpenAI tools sent with every turn"
    )
    tool_env: ToolEnv | None = Field(default=None, description="native: executes the calls")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_tools(v)

    @model_validator(mode="after")
    def _native_shape(self) -> Conversation:
        if (self.tools is None) != (self.tool_env is None):
            raise ValueError("tools and tool_env go together (a native function-calling trace)")
        if self.tools is not None and any(t.role != "user" for t in self.turns):
            raise ValueError("a native conversation has user turns only (tool calls run live)")
        if self.tools is None and any(t.add_tools for t in self.turns):
            raise ValueError("add_tools needs a native conversation (tools and tool_env)")
        check_tools([*(self.tools or []), *(t for turn in self.turns for t in turn.add_tools or [])])
        return self

    @property
    def native(self) -> bool:
        return self.tools is not None


class TraceError(ValueError):
    """A trace file line that is not a valid conversation; the message names line and field."""

    def __init__(self, path: Path, line_no: int, detail: str):
        self.path, self.line_no, self.detail = path, line_no, detail
        super().__init__(f"{path}:{line_no}: {detail}")


def _describe(err: ValidationError) -> str:
    """'turns.1.think_time_s: Input should be greater than or equal to 0' for each error."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<line>"
        parts.append(f"field '{loc}': {e['msg']}")
    return "; ".join(parts)


def parse_line(text: str, path: Path, line_no: int) -> Conversation:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, line_no, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(raw, dict):
        raise TraceError(path, line_no, f"expected a JSON object, got {type(raw).__name__}")
    try:
        return Conversation.model_validate(raw)
    except ValidationError as e:
        raise TraceError(path, line_no, _describe(e)) from None


def load_trace(path: str | Path) -> list[Conversation]:
    """Read a JSONL trace; blank lines are skipped. Raises TraceError naming line and field."""
    path = Path(path)
    convs: list[Conversation] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            conv = parse_line(text, path, line_no)
            if conv.conversation_id in seen:
                raise TraceError(
                    path, line_no, f"field 'conversation_id': duplicate "
                    f"{conv.conversation_id!r} (first on line {seen[conv.conversation_id]})"
                )
            seen[conv.conversation_id] = line_no
            convs.append(conv)
    return convs


def dump_trace(convs: Iterable[Conversation], path: str | Path) -> Path:
    """Write conversations as JSONL (unset optional fields omitted); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for conv in convs:
            f.write(conv.model_dump_json(exclude_none=True) + "\n")
    return path
