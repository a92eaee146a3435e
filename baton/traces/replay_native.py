"""The replayer's native function-calling loop: a conversation with `tools` runs its tool calls
live, against a per-conversation ToolSession (BFCL's simulated tools, baton/traces/bfcl_tools.py).

Per user turn:
    append the user message; request with `tools` (+ the turn's add_tools) and tool_choice auto;
    while the reply calls tools:
        append {"role": "assistant", "content", "tool_calls"}; execute each call;
        append {"role": "tool", "tool_call_id", "content": result text} per call;
        if max_tool_rounds answers to results were already requested: stop (next user turn);
        request again (the model's answer to the results)
    append the final text reply as an assistant message.
Every call gets its tool message, even one that could not be run (its error text), so the
history stays valid. Each request is one TurnRecord (turn_index counts requests; trace_turn and
tool_round say which turn and round it was); a reply without calls is `effective` (meant for the
user). Counted per reply: calls, parseable calls (arguments a JSON object, naming a tool offered
so far), calls that ran without an error (no exception, no BFCL {"error": ...} answer).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from baton.traces.bfcl_tools import CallResult, ToolSession
from baton.traces.format import Conversation
from baton.traces.records import ConversationRecord, TurnRecord
from baton.traces.replay import Streamer, Target, request_body, send_body, ttfet, turn_record
from baton.traces.sse import ReplyCall

DEFAULT_TOOL_ROUNDS = 3


@dataclass(frozen=True)
class ExecutedCall:
    """One call of a reply, as sent back: its id (minted if the server sent none) and result."""

    call: ReplyCall
    call_id: str
    result: CallResult


def tool_name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"])


def execute_calls(session: ToolSession, conv: Conversation, offered: set[str],
                  calls: list[ReplyCall], prefix: str) -> list[ExecutedCall]:
    """Run a reply's calls in order; a call naming no offered tool is unparseable, not run."""
    assert conv.tool_env is not None
    out = []
    for i, call in enumerate(calls):
        if call.name in offered:
            result = session.execute_json(conv.tool_env.bfcl_name(call.name), call.arguments)
        else:
            result = CallResult(f"{call.name}({call.arguments})",
                                f"Error during execution: Function {call.name} is not available.",
                                "unparseable")
        out.append(ExecutedCall(call, call.id or f"call_{prefix}_{i}", result))
    return out


def history_messages(text: str, executed: list[ExecutedCall]) -> list[dict[str, Any]]:
    """The assistant message with its tool_calls, then one tool message per call."""
    assistant = {"role": "assistant", "content": text or None, "tool_calls": [
        {"id": e.call_id, "type": "function",
         "function": {"name": e.call.name, "arguments": e.call.arguments}} for e in executed]}
    return [assistant, *({"role": "tool", "tool_call_id": e.call_id, "content": e.result.result}
                         for e in executed)]


def counts(executed: list[ExecutedCall]) -> dict[str, int]:
    return {"tool_calls": len(executed),
            "tool_calls_parseable": sum(e.result.status != "unparseable" for e in executed),
            "tool_calls_ok": sum(e.result.status == "ok" for e in executed)}


def open_session(conv: Conversation) -> ToolSession:
    env = conv.tool_env
    assert env is not None
    return ToolSession(env.classes, env.initial_config, env.long_context)


async def run_native_conversation(stream: Streamer, target: Target, conv: Conversation, bar: tqdm,
                                  max_tool_rounds: int = DEFAULT_TOOL_ROUNDS,
                                  ) -> tuple[ConversationRecord, list[TurnRecord]]:
    records: list[TurnRecord] = []
    try:
        session = open_session(conv)
    except Exception as e:  # noqa: BLE001 - e.g. bfcl_eval missing: the conversation fails
        bar.update(len(conv.turns))
        return _conversation_record(conv, records, f"tool session: {type(e).__name__}: {e}"), records
    tools = list(conv.tools or [])
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system else []
    failed = False
    for index, turn in enumerate(conv.turns):
        await asyncio.sleep(turn.think_time_s)
        tools += turn.add_tools or []
        offered = {tool_name(t) for t in tools}
        messages.append({"role": "user", "content": turn.content})
        for tool_round in range(max_tool_rounds + 1):
            body = request_body(conv, turn, messages, target.model) | {"tools": tools, "tool_choice": "auto"}
            sent = await send_body(stream, target, conv.conversation_id, body)
            acc = sent[0]
            executed = [] if acc.error else execute_calls(
                session, conv, offered, acc.tool_calls, f"{index}_{tool_round}")
            records.append(turn_record(
                target, conv, len(records), "user" if tool_round == 0 else "tool",
                effective=not executed, sent=sent, trace_turn=index, tool_round=tool_round,
                **counts(executed)))
            if acc.error is not None:
                failed = True
                break
            if not executed:
                messages.append({"role": "assistant", "content": acc.text})
                break
            messages += history_messages(acc.text, executed)
        bar.update(1)
        if failed:
            bar.update(len(conv.turns) - index - 1)  # the rest will not be sent
            break
    return _conversation_record(conv, records), records


def _conversation_record(conv: Conversation, records: list[TurnRecord],
                         error: str | None = None) -> ConversationRecord:
    error = error or next((r.error for r in records if r.error is not None), None)
    return ConversationRecord(
        conversation_id=conv.conversation_id, user=conv.user, source=conv.source,
        turns_total=len(conv.turns), turns_sent=len(records),
        first_send_s=records[0].send_time_s if records else None, ttfet_s=ttfet(records),
        error=error, tool_calls=sum(r.tool_calls for r in records),
        tool_calls_parseable=sum(r.tool_calls_parseable for r in records),
        tool_calls_ok=sum(r.tool_calls_ok for r in records))
