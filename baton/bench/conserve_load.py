"""Open-loop load for the ConServe bench (baton/bench/conserve.py): conversations arrive as a
seeded Poisson process at a set rate (conversations per second), whatever the server's speed;
after its arrival each conversation runs its turns in order as the trace says (think time from
the trace, or a fixed delay), appending the server's replies, as baton/traces/replay.py does.
A failed turn ends its conversation (its remaining effective turns are failures, see
conserve_stats.effective_ttfets).

Pure pieces (tested): the arrival schedule, the interleaved order of repetitions, the split of a
trace into distinct conversations per load level, the duration estimate. The driver itself
needs a server."""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from baton.bench.conserve_stats import ConversationOutcome, chunk_gaps, token_gaps
from baton.traces.format import Conversation
from baton.traces.records import TurnRecord
from baton.traces.replay import HttpStreamer, Streamer, Target, fetch_model, request_body, send_body, turn_record


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival offsets (s) of `n` conversations: the first at 0, then exponential gaps of mean
    1/rate (a Poisson process), from random.Random(seed): the same seed, the same schedule."""
    if n < 0 or rate_per_s <= 0:
        raise ValueError("n >= 0 and rate > 0")
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def interleaved(policies: Sequence[str], reps: int) -> list[tuple[int, str]]:
    """(repetition, policy) in the order they run: A B C D A B C D ... so that drift on a shared
    machine (thermal, other load) spreads over every policy instead of falling on one."""
    if reps < 1 or not policies or len(set(policies)) != len(policies):
        raise ValueError("reps >= 1 and distinct policies")
    return [(rep, p) for rep in range(reps) for p in policies]


def split_levels(conversations: Sequence[Conversation], levels: int, per_level: int) -> list[list[Conversation]]:
    """Distinct conversations for each load level, `per_level` each, in trace order. Each level's
    conversations get a user of their own (`load<k>`): the prefix cache is salted per tenant
    (isolation.prefix_cache: tenant), so nothing computed at one level is a cache hit at the next,
    while the conversations of a level share their tool preambles as agents do."""
    need = levels * per_level
    if len(conversations) < need:
        raise ValueError(f"{levels} levels x {per_level} conversations need {need}, the trace has {len(conversations)}")
    return [[c.model_copy(update={"user": f"load{k}"}) for c in conversations[k * per_level:(k + 1) * per_level]] for k in range(levels)]


def estimate_level_s(conversations: Sequence[Conversation], rate_per_s: float, think_s: float | None, s_per_turn: float) -> float:
    """Rough wall time of one level: the arrival span, then the longest conversation (its think
    times plus `s_per_turn` per turn)."""
    span = (len(conversations) - 1) / rate_per_s if conversations else 0.0
    longest = max((sum(t.think_time_s if think_s is None else think_s for t in c.turns) + s_per_turn * len(c.turns)
                   for c in conversations), default=0.0)
    return span + longest


@dataclass(frozen=True)
class ConversationRun(ConversationOutcome):
    """What one conversation did: its trace's effective flags, its sent turns, and for each sent
    turn its inter-token latencies (per token when every reply came with tokens per chunk, and
    then its chunk gaps too; else per chunk)."""

    conversation_id: str = ""


async def run_conversation(stream: Streamer, target: Target, conv: Conversation, think_s: float | None) -> ConversationRun:
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system else []
    records: list[TurnRecord] = []
    by_token: list[tuple[float, ...] | None] = []  # per sent turn; None where its tokens per chunk were unknown
    by_chunk: list[tuple[float, ...]] = []
    for index, turn in enumerate(conv.turns):
        if index:
            await asyncio.sleep(turn.think_time_s if think_s is None else think_s)
        messages.append({"role": turn.role, "content": turn.content})
        sent = await send_body(stream, target, conv.conversation_id, request_body(conv, turn, messages, target.model))
        records.append(turn_record(target, conv, index, turn.role, turn.effective, sent))
        by_chunk.append(tuple(chunk_gaps(sent[0].chunk_times)))
        per_token = token_gaps(sent[0].chunk_times, sent[0].tokens_per_chunk)
        by_token.append(None if per_token is None else tuple(per_token))
        if not records[-1].ok:
            break
        messages.append({"role": "assistant", "content": sent[0].text})
    effective = tuple(t.effective for t in conv.turns)
    tokens_known = [g for g in by_token if g is not None]
    if len(tokens_known) < len(by_token):  # one reply without tokens per chunk: the whole conversation per chunk
        return ConversationRun(effective, tuple(records), tuple(by_chunk), None, conversation_id=conv.conversation_id)
    return ConversationRun(effective, tuple(records), tuple(tokens_known), tuple(by_chunk), conversation_id=conv.conversation_id)


async def run_open_loop(conversations: Sequence[Conversation], arrivals: Sequence[float], url: str, *,
                        think_s: float | None = None, timeout_s: float = 180.0,
                        transport: httpx.AsyncBaseTransport | None = None) -> tuple[list[ConversationRun], float]:
    """Start each conversation at its arrival offset; returns the runs (trace order) and the wall time.
    `transport` replaces the network (tests pass an httpx.MockTransport)."""
    if len(arrivals) != len(conversations):
        raise ValueError("one arrival per conversation")
    limits = httpx.Limits(max_connections=len(conversations) + 4, max_keepalive_connections=len(conversations))
    async with httpx.AsyncClient(transport=transport, timeout=timeout_s, limits=limits) as client:
        model = await fetch_model(client, url, {})
        target = Target(url, model, {}, timeout_s, time.perf_counter())
        stream = HttpStreamer(client)

        async def arrive(conv: Conversation, at: float) -> ConversationRun:
            await asyncio.sleep(max(0.0, target.t0 + at - time.perf_counter()))
            return await run_conversation(stream, target, conv, think_s)

        runs = await asyncio.gather(*(arrive(c, a) for c, a in zip(conversations, arrivals, strict=True)))
    return list(runs), time.perf_counter() - target.t0
