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
from dataclasses import dataclass

from baton.engine.realtime.session import SessionState

POINTS = 5  # completed ticks kept per session (4 intervals)
STALE_PERIODS = 3.0


def retained_tokens(state: SessionState) -> int:
    """Tokens whose KV the pool keeps for the session between ticks: an unbounded session's
    history (its reply is not computed into the pool until the next tick); 0 for a bounded one."""
    return len(state.history) if state.spec.mode == "unbounded" else 0


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
                   retains: bool = True) -> SessionGrowth:
    """`points`: (completed_at, retained) of the session's last ticks, oldest first; `retains`:
    whether the session keeps KV in the pool at all (False for bounded sessions: never warming)."""
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
