"""Typed messages between the ingress and an engine replica for real-time sessions.

`target_replica` names the replica that owns the session (the ingress pins a session to one
decode replica at open); Baton's request router honours it (router/serve_router.py)."""
from __future__ import annotations

from dataclasses import dataclass

from baton.engine.realtime.session import Mode


@dataclass(frozen=True)
class RealtimeOpen:
    session_id: str
    mode: Mode
    preamble_ids: tuple[int, ...]
    sink_tokens: int
    window_tokens: int
    max_tokens: int
    target_replica: str | None = None
    tick_s: float | None = None  # the client's tick period (the cliff predictor's growth rate); None: measured


@dataclass(frozen=True)
class RealtimeTick:
    session_id: str
    seq: int
    input_ids: tuple[int, ...]
    target_replica: str | None = None


@dataclass(frozen=True)
class RealtimeClose:
    session_id: str
    target_replica: str | None = None


@dataclass(frozen=True)
class TickResult:
    """What one tick produced, measured at the replica."""

    seq: int
    text: str
    token_ids: tuple[int, ...]
    server_s: float  # from the replica receiving the tick to its last token
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the engine had to compute
    kv_peak_tokens: int  # engine KV in use at the tick's peak (tokens, from the engine's block pool)
    replica: str | None = None
    error: str | None = None  # set when the tick could not be served (the client sees no reply)
    fatal: bool = False  # the session cannot go on (engine dead, session unknown): the ingress closes it
