"""How fast a replica's real-time sessions fill its KV pool, in tokens (pure; the manager feeds it).

Each session keeps its last few completed ticks as (completed_at, retained tokens) points —
retained: what the pool holds for it between ticks (`retained_tokens`). Over its points
(t_0, R_0) … (t_k, R_k), k >= 1 ticks:

    appended = R_k − R_0
    offered  = appended ÷ (k × tick period)      (the period the client declared; else measured)
    served   = appended ÷ (t_k − t_0)            (how fast the engine really got through them)

A session silent for longer than STALE_PERIODS of its period adds its retained tokens but no
growth. A session that retains KV and is still warming up (fewer than 2 completed ticks, a
declared period, not stale) has no rate of its own yet: it is counted at the mean rates of the
sessions that have one, as Metronome's N·r counts every live session at the mean rate r. `TokenGrowth` sums them over the
replica's sessions; router/cliff.py turns that into a forecast.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from baton.engine.realtime.session import SessionState

POINTS = 5  # completed ticks kept per session (4 intervals)
STALE_PERIODS = 3.0


def retained_tokens(state: SessionState, block_tokens: int = 0) -> int:
    """Tokens whose KV the pool keeps for the session between ticks; 0 for a bounded one.

    block_tokens = 0 (unknown): an unbounded session's whole history (the prompt of its last tick).
    block_tokens = B: what the prefix cache really holds of it — whole blocks only. Its last tick
    computed KV for the prompt and every reply token but the last (`pending` is that reply), and
    vLLM keeps a finished request's full blocks, not its partial tail block:
    ⌊(len(history) + len(pending) − 1) ÷ B⌋ · B. Counting whole histories instead overstates the
    pool by about half a block per live session (a forecast that comes early)."""
    if state.spec.mode != "unbounded":
        return 0
    if block_tokens <= 0 or not state.history:
        return len(state.history)
    computed = len(state.history) + max(0, len(state.pending) - 1)
    return computed // block_tokens * block_tokens


def in_flight_tokens(request_tokens: int, block_tokens: int = 0) -> int:
    """Tokens whose KV the pool holds for a session while one of its ticks runs, in either mode:
    the running request's blocks hold its whole prompt and the reply so far (`request_tokens`),
    its partial tail block included — ⌈request_tokens ÷ B⌉ · B (request_tokens itself when B is
    unknown). For an unbounded session that covers its cached history, which the request reuses.
    Counted from the moment the replica hands the tick to the engine: a request still waiting in the
    engine's queue holds only its cached blocks, so this overstates it by under one block."""
    if request_tokens <= 0:
        return 0
    if block_tokens <= 0:
        return request_tokens
    return -(-request_tokens // block_tokens) * block_tokens


@dataclass(frozen=True)
class SessionGrowth:
    retained_tokens: int
    offered_tokens_per_s: float
    served_tokens_per_s: float
    warming: bool = False  # no rate of its own yet: total_growth counts it at the others' mean


@dataclass(frozen=True)
class TokenGrowth:
    """A replica's real-time sessions, summed (ReplicaReport's token figures)."""

    sessions: int
    growing_sessions: int  # sessions whose growth is counted
    retained_tokens: int
    offered_tokens_per_s: float
    served_tokens_per_s: float


def session_growth(points: Sequence[tuple[float, int]], tick_s: float | None, now: float, opened_at: float,
                   retains: bool = True, retained_now: int | None = None) -> SessionGrowth:
    """`points`: (completed_at, retained) of the session's last ticks, oldest first; `retains`:
    whether the session keeps KV in the pool at all (False for bounded sessions: never warming);
    `retained_now`: what the pool holds for it now (retained_tokens with the block size), reported
    instead of the last point's figure — the rates still come from the points."""
    g = _session_growth(points, tick_s, now, opened_at, retains)
    return g if retained_now is None else replace(g, retained_tokens=retained_now)


def _session_growth(points: Sequence[tuple[float, int]], tick_s: float | None, now: float, opened_at: float,
                    retains: bool) -> SessionGrowth:
    if len(points) < 2:
        last = points[-1][0] if points else opened_at
        warming = retains and tick_s is not None and now - last <= STALE_PERIODS * tick_s
        return SessionGrowth(points[-1][1] if points else 0, 0.0, 0.0, warming)
    (t0, r0), (tk, rk) = points[0], points[-1]
    k = len(points) - 1
    span = tk - t0
    if span <= 0 or rk <= r0:
        return SessionGrowth(rk, 0.0, 0.0)
    period = tick_s if tick_s else span / k
    if now - tk > STALE_PERIODS * max(period, span / k):
        return SessionGrowth(rk, 0.0, 0.0)
    appended = rk - r0
    return SessionGrowth(rk, appended / (k * period), appended / span)


def total_growth(sessions: Iterable[SessionGrowth]) -> TokenGrowth:
    n = growing = warming = retained = 0
    offered = served = 0.0
    for s in sessions:
        n += 1
        growing += s.offered_tokens_per_s > 0
        warming += s.warming
        retained += s.retained_tokens
        offered += s.offered_tokens_per_s
        served += s.served_tokens_per_s
    scale = 1 + warming / growing if growing else 1.0  # the warming sessions at the growing ones' mean
    return TokenGrowth(n, growing + (warming if growing else 0), retained, offered * scale, served * scale)
