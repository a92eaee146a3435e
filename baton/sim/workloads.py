"""Workload shapes for the fleet projection: token counts, think times, arrivals. Pure and seeded.

A conversation is a shared prefix (a tool-doc system prompt, or a system prompt plus a user's
memory) and turns; each turn appends `new_tokens` (a user message, tool results, a real-time
chunk) to the history (prefix + every earlier turn's prompt part and reply) and asks for up to
`max_tokens` of reply. Token ids are synthetic but stable: equal prefixes get equal ids, so the
engines' prefix caches hit exactly where a real engine's would.

- agentic (BFCL v4 multi_turn-shaped): one of 8 tool-doc system prompts, shared by every
  conversation using it; per question a user turn answered by a tool call (not effective), then
  the tool results answered for the user (effective), tool time between them.
- memory (LoCoMo-shaped): a short system prompt + the user's memory facts, shared by the user's
  conversations; user turns, all effective, human think times.
- realtime (Metronome tick sessions): S anchor (sink) tokens; one chunk per tick; the prompt is
  sinks + the last W tokens + the chunk, the window re-injected rather than recomputed.

The numbers are assumptions, stated in `Shape` (README "Fleet projection" gives their sources).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

WorkloadName = Literal["agentic", "memory", "realtime"]
WORKLOADS: tuple[WorkloadName, ...] = ("agentic", "memory", "realtime")


@dataclass(frozen=True)
class Turn:
    new_tokens: int  # appended to the history before this request
    max_tokens: int  # reply length (the simulator always generates all of it)
    think_s: float  # delay after the previous turn's last token before this one is sent
    effective: bool  # the reply is meant for the user (docs/TRACES.md)
    deadline_s: float | None = None  # real-time: the reply must end within this after sending


@dataclass(frozen=True)
class Conversation:
    session_id: str
    user: str
    arrival_s: float
    prefix_key: str  # conversations with the same key share their prefix tokens
    prefix_tokens: int
    turns: tuple[Turn, ...]
    window_tokens: int | None = None  # real-time: prompt = prefix (sinks) + last window_tokens + chunk


@dataclass(frozen=True)
class Shape:
    """Assumed distributions (uniform integers unless said otherwise)."""

    tool_docs: int = 8  # distinct tool-doc system prompts (BFCL's multi_turn categories share a few API sets)
    tool_doc_tokens: tuple[int, int] = (2500, 5000)
    questions: tuple[int, int] = (2, 4)  # user questions per agentic conversation
    user_tokens: tuple[int, int] = (30, 120)
    tool_call_tokens: tuple[int, int] = (20, 60)  # the reply that is a tool call
    tool_result_tokens: tuple[int, int] = (100, 500)
    answer_tokens: tuple[int, int] = (50, 200)
    tool_time_s: tuple[float, float] = (0.2, 1.0)  # uniform: executing the tool calls
    agent_think_mean_s: float = 3.0  # exponential: the agent's next question
    memory_users: int = 64  # per 8 GPUs: users whose conversations share a memory prefix
    memory_system_tokens: int = 300
    memory_tokens: tuple[int, int] = (1500, 4000)  # retrieved facts placed in the prompt
    memory_turns: tuple[int, int] = (4, 10)
    memory_reply_tokens: tuple[int, int] = (40, 160)
    human_think_mean_s: float = 6.0  # exponential
    sink_tokens: int = 16  # Metronome's S (one 16-token block)
    window_tokens: int = 1024  # Metronome's W
    tick_s: float = 0.5
    ticks: tuple[int, int] = (20, 60)
    chunk_tokens: int = 32
    tick_reply_tokens: int = 8


def poisson_times(rate_per_s: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, horizon_s) of a Poisson process of `rate_per_s` (exponential gaps)."""
    if rate_per_s <= 0 or horizon_s < 0:
        raise ValueError("rate > 0 and horizon >= 0")
    out: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < horizon_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def _u(rng: random.Random, lo_hi: tuple[int, int]) -> int:
    return rng.randint(*lo_hi)


def agentic(i: int, at: float, rng: random.Random, s: Shape) -> Conversation:
    doc = rng.randrange(s.tool_docs)
    turns: list[Turn] = []
    for q in range(_u(rng, s.questions)):
        think = 0.0 if q == 0 else rng.expovariate(1.0 / s.agent_think_mean_s)
        turns.append(Turn(_u(rng, s.user_tokens), _u(rng, s.tool_call_tokens), think, effective=False))
        turns.append(Turn(_u(rng, s.tool_result_tokens), _u(rng, s.answer_tokens), rng.uniform(*s.tool_time_s), effective=True))
    doc_tokens = random.Random(f"doc{doc}").randint(*s.tool_doc_tokens)  # a doc's length is the doc's, not the conversation's
    return Conversation(f"a{i}", f"u{i}", at, f"doc{doc}", doc_tokens, tuple(turns))


def memory(i: int, at: float, rng: random.Random, s: Shape, users: int) -> Conversation:
    user = rng.randrange(users)
    facts = random.Random(f"mem{user}").randint(*s.memory_tokens)
    turns = tuple(Turn(_u(rng, s.user_tokens), _u(rng, s.memory_reply_tokens),
                       0.0 if k == 0 else rng.expovariate(1.0 / s.human_think_mean_s), effective=True)
                  for k in range(_u(rng, s.memory_turns)))
    return Conversation(f"m{i}", f"user{user}", at, f"mem{user}", s.memory_system_tokens + facts, turns)


def realtime(i: int, at: float, rng: random.Random, s: Shape) -> Conversation:
    turns = tuple(Turn(s.chunk_tokens, s.tick_reply_tokens, 0.0 if k == 0 else s.tick_s, effective=True, deadline_s=s.tick_s)
                  for k in range(_u(rng, s.ticks)))
    return Conversation(f"r{i}", f"rt{i}", at, f"sink{i}", s.sink_tokens, turns, window_tokens=s.window_tokens)


def build(name: WorkloadName, rate_per_s: float, horizon_s: float, gpus: int, seed: int, s: Shape = Shape()) -> list[Conversation]:
    """Conversations arriving as a Poisson process of `rate_per_s` over `horizon_s` (seeded)."""
    rng = random.Random(f"{name}-{seed}")
    times = poisson_times(rate_per_s, horizon_s, rng)
    if name == "agentic":
        return [agentic(i, t, rng, s) for i, t in enumerate(times)]
    if name == "memory":
        users = max(1, s.memory_users * gpus // 8)
        return [memory(i, t, rng, s, users) for i, t in enumerate(times)]
    if name == "realtime":
        return [realtime(i, t, rng, s) for i, t in enumerate(times)]
    raise ValueError(f"unknown workload {name!r}")
