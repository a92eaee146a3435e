"""Real-time sessions on one engine replica: state per session, one tick at a time per session.

Each tick is one engine request composed by baton/engine/realtime/session.py: in bounded mode the
sink and window KV are injected (re-rotated) through the segment connector and the KV of the
tick's tokens is captured for the next one; in unbounded mode the whole history is sent and the
engine's prefix cache keeps the past. A capture that fails drops the session's KV: its next tick
recomputes sink + window + new tokens from their ids (slower, still correct).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from baton.engine.realtime.growth import POINTS, TokenGrowth, in_flight_tokens, retained_tokens, session_growth, total_growth
from baton.engine.realtime.messages import RealtimeOpen, RealtimeTick, TickResult
from baton.engine.realtime.session import SessionSpec, SessionState, TickPlan, after_lost_kv, after_tick, open_session, plan_tick
from baton.engine.types import EngineRequestError, EngineUnavailable, GenerationRequest, SamplingSpec

if TYPE_CHECKING:
    from kv_transfer.segments import CaptureResult, KVSegment

logger = logging.getLogger("baton.realtime")


@dataclass
class _Live:
    state: SessionState
    lock: asyncio.Lock
    last_used: float
    tick_s: float | None = None
    opened_at: float = 0.0
    completed: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=POINTS))  # (at, retained tokens)
    in_flight: int = 0  # tokens of the tick the engine is running (prompt + reply so far); 0 between ticks


class UnknownSession(KeyError):
    """No live session with this id on this replica (closed, expired, or never opened here)."""


class RealtimeSessions:
    def __init__(self, runner: Any, idle_timeout_s: float = 300.0):
        self._runner = runner
        self._idle_timeout_s = idle_timeout_s
        self._live: dict[str, _Live] = {}

    def __len__(self) -> int:
        return len(self._live)

    def open(self, msg: RealtimeOpen) -> SessionSpec:
        self._expire()
        now = time.monotonic()
        if msg.session_id in self._live:
            raise EngineRequestError(f"session {msg.session_id!r} is already open")
        spec = SessionSpec(session_id=msg.session_id, mode=msg.mode, sink_tokens=msg.sink_tokens,
                           window_tokens=msg.window_tokens, max_tokens=msg.max_tokens, salt=f"rt-{uuid.uuid4().hex}")
        self._live[msg.session_id] = _Live(open_session(spec, msg.preamble_ids), asyncio.Lock(), now, msg.tick_s, now)
        return spec

    def close(self, session_id: str) -> bool:
        return self._live.pop(session_id, None) is not None

    def held_kv_bytes(self) -> int:
        """Host memory held by bounded sessions' sink and window segments."""
        return sum(kv.nbytes for s in self._live.values() for kv in (s.state.sink_kv, s.state.window_kv) if kv is not None)

    def token_growth(self, now: float | None = None, block_tokens: int | None = None, in_flight: bool = True) -> TokenGrowth:
        """Retained tokens and growth rates of the live sessions (growth.py), at `now` (monotonic).
        Retained tokens count KV blocks of the engine's pool (`block_tokens`, default the engine's
        own; 0: whole tokens, as the pool would hold them with one-token blocks): a session's whole
        blocks of its completed ticks, or — while the engine runs one of its ticks and `in_flight` —
        every block that request holds (growth.in_flight_tokens). An engine that runs behind has
        most sessions' ticks in flight at once. The rates come from completed ticks either way."""
        now = time.monotonic() if now is None else now
        block = getattr(self._runner.stats, "kv_block_tokens", 0) if block_tokens is None else block_tokens
        return total_growth(session_growth(tuple(s.completed), s.tick_s, now, s.opened_at, s.state.spec.mode == "unbounded",
                                           self._held(s, block, in_flight)) for s in self._live.values())

    @staticmethod
    def _held(live: _Live, block: int, in_flight: bool) -> int:
        if in_flight and live.in_flight:  # its prompt holds the history, so never below what it retains
            return in_flight_tokens(live.in_flight, block)
        return retained_tokens(live.state, block)

    async def tick(self, msg: RealtimeTick) -> TickResult:
        live = self._live.get(msg.session_id)
        if live is None:
            raise UnknownSession(msg.session_id)
        async with live.lock:  # a session's ticks run in order; a slow tick delays the next
            t0 = time.perf_counter()
            plan = plan_tick(live.state, msg.input_ids)
            req = GenerationRequest(request_id=f"rt-{uuid.uuid4().hex}", prompt_token_ids=plan.prompt,
                                    sampling=SamplingSpec(max_tokens=live.state.spec.max_tokens, temperature=0.0),
                                    cache_salt=plan.salt)
            text, tokens, peak, cached = [], [], 0, 0
            error, fatal, result = None, False, None
            live.in_flight = len(plan.prompt)
            try:  # the runner offers the injection, collects the capture and drops both on every exit
                async for d in self._runner.generate(req, injection=plan.inject or None, capture=plan.capture):
                    text.append(d.text)
                    tokens.extend(d.token_ids)
                    live.in_flight = len(plan.prompt) + len(tokens)
                    cached = max(cached, d.cached_tokens)
                    st = self._runner.stats
                    peak = max(peak, int(st.kv_usage * st.kv_capacity_tokens))
                    if d.finished:
                        result = d.capture
                captured = _checked_capture(result, plan)
            except (EngineRequestError, EngineUnavailable) as e:
                error, captured, fatal = str(e), None, isinstance(e, EngineUnavailable)
            finally:
                live.in_flight = 0
            if error is None:
                if captured is None:  # keep serving: the next tick recomputes the session's KV
                    live.state = after_lost_kv(live.state, plan, tuple(tokens))
                else:
                    live.state = after_tick(live.state, plan, captured, tuple(tokens))
                live.completed.append((time.monotonic(), retained_tokens(live.state)))
            live.last_used = time.monotonic()
            return TickResult(seq=msg.seq, text="".join(text), token_ids=tuple(tokens), server_s=time.perf_counter() - t0,
                              prompt_tokens=len(plan.prompt), kv_peak_tokens=peak,
                              # what the engine really computed: prefix-cache hits count only whole blocks
                              computed_tokens=len(plan.prompt) - cached if error is None else plan.computed_tokens,
                              error=error, fatal=fatal)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self._idle_timeout_s
        for sid in [s for s, live in self._live.items() if live.last_used < cutoff and not live.lock.locked()]:
            del self._live[sid]


def _checked_capture(result: CaptureResult | None, plan: TickPlan) -> tuple[KVSegment, ...] | None:
    """The tick's captured segments (one per planned range, holding exactly those prompt tokens),
    () when it captured nothing, None when the capture failed or does not match the prompt."""
    if not plan.capture:
        return ()
    if result is None or result.error:
        logger.warning("tick KV capture failed (%s); the session's next tick recomputes", result.error if result else "none")
        return None
    segs = result.segments
    if len(segs) != len(plan.capture) or any(tuple(s.token_ids) != plan.prompt[a:b] for s, (a, b) in zip(segs, plan.capture, strict=True)):
        logger.warning("tick KV capture does not match the prompt; the session's next tick recomputes")
        return None
    return segs
