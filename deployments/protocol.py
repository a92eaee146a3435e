"""Request bodies of the OpenAI-compatible API (only what Baton honours is validated; unknown
fields are ignored as OpenAI-compatible servers do) and response/chunk builders."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.tool_schema import FunctionTool, ToolChoice

SESSION_ID_MAX = 128
STOP_MAX = 4  # stop sequences per request (OpenAI's limit)
STOP_CHARS_MAX = 256  # characters per stop sequence


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension: every chunk that carries output also carries the usage so far (its
    # completion_tokens count the tokens streamed up to and including that chunk), so a client can
    # tell how many tokens each chunk held when the server coalesced several into one
    continuous_usage_stats: bool = False


class MemoriesOption(_Body):
    """Which memories a request recalls: the top `k` for its last user message, or exactly `ids`."""

    k: int | None = Field(None, ge=1, description="how many facts to recall (default: the store's default_k)")
    ids: list[str] | None = Field(None, min_length=1, max_length=256, description="recall exactly these facts")
    mode: Literal["kv", "prompt"] | None = Field(None, description="kv: inject encoded KV; prompt: compute the facts' text")
    window: int | None = Field(None, ge=0, le=64, description="context window w used to encode each fact's KV")

    @model_validator(mode="after")
    def _one_way(self) -> MemoriesOption:
        if self.k is not None and self.ids is not None:
            raise ValueError("give either k or ids, not both")
        return self


class AddMemoriesRequest(_Body):
    """POST /v1/memories: facts as texts, or a conversation whose turns become facts."""

    user: str | None = Field(None, max_length=128)
    facts: list[str] | None = Field(None, min_length=1, max_length=256)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=256)
    source: str | None = Field(None, min_length=1, max_length=128, description="where the facts come from (default: api, or the session id)")

    @model_validator(mode="after")
    def _one_input(self) -> AddMemoriesRequest:
        if (self.facts is None) == (self.messages is None):
            raise ValueError("give exactly one of facts or messages")
        return self


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=1, description="only n=1 is served")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer (the engine's seed type)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session_id: str | None = Field(None, min_length=1, max_length=SESSION_ID_MAX, description="conversation id for clients that cannot send x-session-id")
    ignore_eos: bool = False
    memories: MemoriesOption | None = Field(None, description="recall the user's memory facts into the prompt (needs the memory store)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > STOP_MAX:
            raise ValueError(f"at most {STOP_MAX} stop sequences")
        if any(not s or len(s) > STOP_CHARS_MAX for s in stops):
            raise ValueError(f"stop sequences must be 1-{STOP_CHARS_MAX} characters")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = Field(None, description="functions the model may call (deployments/tool_schema.py)")
    tool_choice: ToolChoice | None = Field(None, description="auto (default with tools) | none | required | a named function")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call per reply")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(..., description="one prompt: text, token ids, or a one-element list of text")
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is served")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_response(rid: str, model: str, text: str | None, finish_reason: str | None, use: dict[str, Any],
                  tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """tool_calls: the reply's calls ({id, type, function: {name, arguments}}); none: a text reply."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": use,
    }


def chat_chunk(rid: str, model: str, delta: dict[str, Any], finish_reason: str | None = None, use: dict[str, Any] | None = None) -> dict[str, Any]:
    empty = use is not None and not delta and finish_reason is None
    choices = [] if empty else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        chunk["usage"] = use
    return chunk


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, use: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": use,
    }


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None = None, use: dict[str, Any] | None = None) -> dict[str, Any]:
    choices = [] if use is not None and not text and finish_reason is None else [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        chunk["usage"] = use
    return chunk
