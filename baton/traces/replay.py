"""Replay a trace against an OpenAI-compatible server, as real clients would, over HTTP (SSE)
or Baton's gRPC API (`protocol="grpc"`, baton/traces/replay_grpc.py: the same bodies, the same
per-turn records).

At most `concurrency` conversations are in flight; within one, turns are sequential: pause
think_time_s, append the turn's message, stream a completion, append the reply as an assistant
message, next turn. So an agentic trace runs as a real loop with the model's own replies in the
history. A failed turn (HTTP error, in-stream error, timeout, connection error) is recorded and
ends its conversation; it never ends the replay.

A native function-calling conversation (one with `tools`) runs its tool loop live instead:
baton/traces/replay_native.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from tqdm import tqdm

from baton.traces.format import Conversation, Turn
from baton.traces.records import ConversationRecord, ReplayResult, TurnRecord
from baton.traces.sse import SseEvent, StreamAccumulator, error_message, parse_sse_line


class ReplayError(RuntimeError):
    """The replay could not start (e.g. no model could be listed from the server)."""


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    headers: dict[str, str]
    timeout_s: float
    t0: float  # perf_counter at the start of the replay


def request_body(conv: Conversation, turn: Turn, messages: list[dict[str, Any]],
                 model: str) -> dict[str, Any]:
    """The chat-completions body for one turn; `messages` already ends with the turn."""
    body: dict[str, Any] = {
        "model": model or None,  # gRPC without --model: the server's own
        "messages": messages,
        "stream": True,
        # usage on every output chunk too (vLLM's extension, which Baton serves): ITL per token
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0,
        "max_tokens": turn.max_tokens,
        "user": conv.user,
        "session_id": conv.conversation_id,
    }
    if turn.memories is not None:
        body["memories"] = turn.memories
    return body


async def fetch_model(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    """The first model id listed by GET {url}/v1/models."""
    try:
        resp = await client.get(f"{url}/v1/models", headers=headers)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ReplayError(f"could not list models at {url}/v1/models: {e!r}") from e


def _http_error(status: int, raw: bytes) -> str:
    try:
        message = error_message(json.loads(raw))
    except ValueError:
        message = None
    return f"HTTP {status}: {message or raw.decode('utf-8', 'replace')[:300] or 'no body'}"


class Streamer(Protocol):
    """One transport: send a turn's body, feed its status and stream to `acc`."""

    async def __call__(self, target: Target, body: dict[str, Any], session_id: str,
                       acc: StreamAccumulator) -> None: ...


@dataclass(frozen=True)
class HttpStreamer:
    client: httpx.AsyncClient

    async def __call__(self, target: Target, body: dict[str, Any], session_id: str,
                       acc: StreamAccumulator) -> None:
        await _stream_turn(self.client, target, body, session_id, acc)


async def _stream_turn(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                       session_id: str, acc: StreamAccumulator) -> None:
    """Send one request and feed its status and stream to `acc`."""
    headers = {**target.headers, "x-session-id": session_id}
    async with client.stream("POST", f"{target.url}/v1/chat/completions",
                             json=body, headers=headers) as resp:
        acc.status = resp.status_code
        if resp.status_code != 200:
            acc.error = _http_error(resp.status_code, await resp.aread())
            return
        if resp.headers.get("content-type", "").startswith("application/json"):  # not streamed
            try:
                acc.feed(SseEvent(data=json.loads(await resp.aread())), time.perf_counter())
            except ValueError:
                acc.error = "malformed JSON response"
            acc.done = True
            return
        async for line in resp.aiter_lines():
            event = parse_sse_line(line)
            if event is not None:
                acc.feed(event, time.perf_counter())
            if acc.error is not None or acc.done:
                break


async def send_body(stream: Streamer, target: Target, session_id: str,
                    body: dict[str, Any]) -> tuple[StreamAccumulator, float, float]:
    """One completion request; returns its accumulated reply and its send and end times."""
    acc = StreamAccumulator()
    sent = time.perf_counter()
    try:
        await asyncio.wait_for(stream(target, body, session_id, acc), timeout=target.timeout_s)
    except TimeoutError:
        acc.error = f"timeout after {target.timeout_s:g}s"
    except Exception as e:  # noqa: BLE001 - a failed turn is recorded, never raised
        acc.error = f"{type(e).__name__}: {e}"
    return acc, sent, time.perf_counter()


def turn_record(target: Target, conv: Conversation, index: int, role: str, effective: bool,
                sent: tuple[StreamAccumulator, float, float], **native: int) -> TurnRecord:
    """The record of one request (`sent` is send_body's result); `native`: tool-call fields."""
    acc, start, end = sent
    return TurnRecord(
        conversation_id=conv.conversation_id, turn_index=index, role=role,
        effective=effective, send_time_s=start - target.t0,
        ttft_s=None if acc.first_token_at is None else acc.first_token_at - start,
        e2e_s=end - start, prompt_tokens=acc.usage_int("prompt_tokens"),
        completion_tokens=acc.usage_int("completion_tokens"), cached_tokens=acc.cached_tokens,
        status=acc.status, error=acc.error, reply_chars=len(acc.text), **native)


async def send_turn(stream: Streamer, target: Target, conv: Conversation,
                    index: int, messages: list[dict[str, Any]]) -> tuple[TurnRecord, str]:
    """One completion request for turn `index`; returns its record and the reply text."""
    turn = conv.turns[index]
    sent = await send_body(stream, target, conv.conversation_id,
                           request_body(conv, turn, messages, target.model))
    return turn_record(target, conv, index, turn.role, turn.effective, sent), sent[0].text


def ttfet(records: list[TurnRecord]) -> float | None:
    """First request sent -> first token of the first effective turn (None if it never came)."""
    if not records:
        return None
    first = next((r for r in records if r.effective), None)
    if first is None or first.ttft_s is None:
        return None
    return first.send_time_s + first.ttft_s - records[0].send_time_s


async def run_conversation(stream: Streamer, target: Target, conv: Conversation,
                           bar: tqdm) -> tuple[ConversationRecord, list[TurnRecord]]:
    messages: list[dict[str, Any]] = []
    if conv.system:
        messages.append({"role": "system", "content": conv.system})
    records: list[TurnRecord] = []
    for index, turn in enumerate(conv.turns):
        await asyncio.sleep(turn.think_time_s)
        messages.append({"role": turn.role, "content": turn.content})
        record, reply = await send_turn(stream, target, conv, index, messages)
        records.append(record)
        bar.update(1)
        if not record.ok:
            bar.update(len(conv.turns) - index - 1)  # the rest will not be sent
            break
        messages.append({"role": "assistant", "content": reply})
    error = next((r.error for r in records if r.error is not None), None)
    return ConversationRecord(
        conversation_id=conv.conversation_id, user=conv.user, source=conv.source,
        turns_total=len(conv.turns), turns_sent=len(records),
        first_send_s=records[0].send_time_s if records else None,
        ttfet_s=ttfet(records), error=error), records


async def replay(conversations: list[Conversation], url: str, concurrency: int,
                 model: str | None = None, api_key: str | None = None, timeout_s: float = 300.0,
                 progress: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None,
                 protocol: str = "http", max_tool_rounds: int = 3) -> ReplayResult:
    """Replay `conversations` against `url` with `concurrency` clients.

    protocol "http": `url` is the base URL without /v1; `transport` replaces the network (tests
    pass an httpx.MockTransport). "grpc": `url` is host:port of the gRPC proxy (grpc:// allowed);
    without `model` the server's own model is used (the request names none).
    max_tool_rounds: native conversations, requests answering tool results per user turn.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if max_tool_rounds < 0:
        raise ValueError("max_tool_rounds must be >= 0")
    if protocol not in ("http", "grpc"):
        raise ValueError(f"protocol must be http or grpc, not {protocol!r}")
    url = url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if protocol == "grpc":
        from baton.traces.replay_grpc import grpc_streamer

        async with grpc_streamer(url) as stream:
            return await _replay(conversations, url, concurrency, model or "", headers, timeout_s, progress, stream,
                                 max_tool_rounds)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(transport=transport, timeout=timeout_s, limits=limits) as client:
        model = model or await fetch_model(client, url, headers)
        return await _replay(conversations, url, concurrency, model, headers, timeout_s, progress, HttpStreamer(client),
                             max_tool_rounds)


async def _replay(conversations: list[Conversation], url: str, concurrency: int, model: str,
                  headers: dict[str, str], timeout_s: float, progress: bool, stream: Streamer,
                  max_tool_rounds: int) -> ReplayResult:
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    target = Target(url, model, headers, timeout_s, time.perf_counter())
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(conversations)):
        queue.put_nowait(i)
    results: list[tuple[ConversationRecord, list[TurnRecord]] | None]
    results = [None] * len(conversations)
    total = sum(len(c.turns) for c in conversations)

    with tqdm(total=total, unit="turn", desc="replay", disable=not progress) as bar:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                conv = conversations[i]
                if conv.native:
                    from baton.traces.replay_native import run_native_conversation

                    results[i] = await run_native_conversation(stream, target, conv, bar, max_tool_rounds)
                else:
                    results[i] = await run_conversation(stream, target, conv, bar)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(conversations)))))
    duration = time.perf_counter() - target.t0

    done = [r for r in results if r is not None]
    return ReplayResult(url=url, model=model, concurrency=concurrency, started_at=started_at,
                        duration_s=duration, conversations=[c for c, _ in done],
                        turns=[t for _, ts in done for t in ts])
