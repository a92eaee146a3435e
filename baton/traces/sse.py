"""Server-sent events of an OpenAI streaming chat completion: parse lines, accumulate a reply.

A stream is lines of `data: {json chunk}` separated by blank lines and ended by `data: [DONE]`.
A chunk carries `choices[0].delta.content`, and (with stream_options.include_usage) a last chunk
carries `usage`; with stream_options.continuous_usage_stats every output chunk carries the usage so
far too, from which the tokens each chunk held are read (`tokens_per_chunk`). A server may report
a failure mid-stream as a data event with an "error" key.
Tool calls arrive as `delta.tool_calls` pieces keyed by `index`: the first piece of a call has
its `id` and `function.name`, later ones add `function.arguments` text. A whole (non-streamed)
response fed as one event is read the same way from `choices[0].message`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SseEvent:
    """One `data:` line: the [DONE] sentinel, a JSON object, or an unparseable payload."""

    done: bool = False
    data: dict[str, Any] | None = None
    malformed: str | None = None  # the raw payload when it is not a JSON object


def parse_sse_line(line: str) -> SseEvent | None:
    """The event on a `data:` line; None for blank lines, comments and other fields."""
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return SseEvent(done=True)
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return SseEvent(malformed=payload)
    if not isinstance(data, dict):
        return SseEvent(malformed=payload)
    return SseEvent(data=data)


def error_message(body: Any) -> str | None:
    """The message of an OpenAI-style error ({"error": {"message", "type", "code"}} or a str)."""
    if not isinstance(body, dict) or "error" not in body or body["error"] is None:
        return None
    err = body["error"]
    if isinstance(err, dict):
        message = str(err.get("message") or "unknown error")
        kind = err.get("type") or err.get("code")
        return f"{kind}: {message}" if kind else message
    return str(err)


@dataclass(frozen=True)
class ReplyCall:
    """One tool call of a reply, reassembled: arguments are JSON text (maybe malformed)."""

    id: str
    name: str
    arguments: str


@dataclass
class StreamAccumulator:
    """The state of one streamed reply: status, text so far, first-token and chunk times, usage, error."""

    status: int | None = None  # HTTP status, once the response headers arrived
    text_parts: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False
    calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [id, name, arguments]
    chunk_times: list[float] = field(default_factory=list)  # when each chunk with content or a call piece arrived
    # tokens each of those chunks held, from its usage so far (stream_options.continuous_usage_stats);
    # None where a chunk came without usage
    chunk_tokens: list[int | None] = field(default_factory=list)
    _streamed_tokens: int = field(default=0, init=False, repr=False)  # completion_tokens of the last chunk with usage

    def feed(self, event: SseEvent, now: float) -> None:
        if event.done:
            self.done = True
            return
        if event.malformed is not None:
            self.error = f"malformed stream event: {event.malformed[:200]}"
            return
        data = event.data or {}
        message = error_message(data)
        if message is not None:
            self.error = message
            return
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or choice.get("message") or {}
            content = delta.get("content")
            pieces = delta.get("tool_calls") or []
            if (content or pieces) and self.first_token_at is None:
                self.first_token_at = now
            if content or pieces:
                self.chunk_times.append(now)
                self.chunk_tokens.append(self._tokens_of_chunk(data.get("usage")))
            if content:
                self.text_parts.append(content)
            for position, piece in enumerate(pieces):
                self._feed_call(piece, position)

    def _tokens_of_chunk(self, use: Any) -> int | None:
        done = use.get("completion_tokens") if isinstance(use, dict) else None
        if not isinstance(done, int) or done < self._streamed_tokens:
            return None
        held, self._streamed_tokens = done - self._streamed_tokens, done
        return held

    @property
    def tokens_per_chunk(self) -> list[int] | None:
        """Tokens each output chunk held, when every one of them came with usage; else None."""
        if any(n is None for n in self.chunk_tokens):
            return None
        return [n for n in self.chunk_tokens if n is not None]

    def _feed_call(self, piece: dict[str, Any], position: int) -> None:
        call = self.calls.setdefault(int(piece.get("index", position)), ["", "", ""])
        fn = piece.get("function") or {}
        call[0] = piece.get("id") or call[0]
        call[1] = fn.get("name") or call[1]  # a name arrives whole, once
        call[2] += fn.get("arguments") or ""

    @property
    def tool_calls(self) -> list[ReplyCall]:
        """The reply's calls in index order."""
        return [ReplyCall(*self.calls[i]) for i in sorted(self.calls)]

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def usage_int(self, key: str) -> int | None:
        value = (self.usage or {}).get(key)
        return int(value) if value is not None else None

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return int(value) if value is not None else None
