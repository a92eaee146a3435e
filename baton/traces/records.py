"""What a replay measured: one record per sent turn, one per conversation, and the whole run.

Times are seconds; `send_time_s` is measured from the start of the replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TurnRecord:
    conversation_id: str
    turn_index: int
    role: str
    effective: bool
    send_time_s: float  # when the request was sent, from the start of the replay
    ttft_s: float | None  # to the first chunk with non-empty content; None if none came
    e2e_s: float  # to the end of the stream (or the error)
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    status: int | None  # HTTP status; None if no response (connection error, timeout)
    error: str | None = None
    reply_chars: int = 0
    # native function calling: turn_index counts the conversation's requests; trace_turn is the
    # trace turn they answer, tool_round 0 its user message, k >= 1 the k-th round of results
    trace_turn: int | None = None
    tool_round: int = 0
    tool_calls: int = 0  # calls in this reply
    tool_calls_parseable: int = 0  # of them: JSON-object arguments naming an offered tool
    tool_calls_ok: int = 0  # of them: executed without an error

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ConversationRecord:
    conversation_id: str
    user: str
    source: str
    turns_total: int  # turns in the trace
    turns_sent: int
    first_send_s: float | None  # send time of its first request, from the start of the replay
    ttfet_s: float | None  # first request sent -> first token of the first effective turn
    error: str | None = None
    tool_calls: int = 0  # native: the sums over its turn records
    tool_calls_parseable: int = 0
    tool_calls_ok: int = 0


@dataclass(frozen=True)
class ReplayResult:
    url: str
    model: str
    concurrency: int
    started_at: str  # ISO-8601 wall clock
    duration_s: float
    conversations: list[ConversationRecord] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
