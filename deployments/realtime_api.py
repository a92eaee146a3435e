"""WebSocket /v1/realtime: real-time tick sessions (Metronome) at the ingress.

Protocol (JSON text frames):
  client → {"type": "session.start", "instructions"?: str, "mode"?: "bounded"|"unbounded",
            "max_tokens"?: int, "tick_ms"?: int, "deadline_ms"?: int}
  server → {"type": "session.started", "session_id", "mode", "sink_tokens", "window_tokens", "tick_ms", "deadline_ms", "warning"?}
  client → {"type": "input", "seq": int, "text": str, "sent_at"?: float}   (one per tick)
  server → {"type": "output", "seq", "text", "server_ms", "queued_ms"?, "prompt_tokens", "computed_tokens", "kv_tokens"}
  client → {"type": "session.end"}                             → server closes with 1000
`sent_at` is the client's send time (Unix seconds, its wall clock). With it the tick's latency —
for the metrics, the lateness count and the AIMD controller — runs from the client's send, so it
includes the time the frame queued before the server read it (`queued_ms`); without it, from the
read. A value that is not a finite number, or lies more than `realtime.max_clock_skew_s` ahead of
the server's clock or more than `realtime.idle_timeout_s` behind it, is an `invalid_value` error
frame and close 1008 (the clocks disagree: its latencies would be fiction).
Errors are {"type": "error", "code", "message", "retry_after_s"?} frames; a frame that is not
JSON text (or holds a lone UTF-16 surrogate) closes with 1007, a malformed one with 1008, one over
`realtime.max_frame_bytes` with 1009, a refused session (AIMD cap reached) with
1013 "try again later" after an error frame carrying retry_after_s, a dead engine with 1011.
With `realtime.admission.overload: shed`, a decrease of the AIMD cap below the live sessions sheds
the newest of them (router/shedding.py): each gets, at its next tick boundary (after the reply in
flight, never mid-reply), an error frame {"code": "shed_overload", "cap", "live_sessions",
"retry_after_s"} and close 1013; its admission slot is free from the shed on
(deployments/realtime_sessions.py). With `drain` (the default) live sessions tick on until they end.
A session whose decoder's KV pool is forecast full within `realtime.cliff.horizon_s`
(router/cliff.py) is refused the same way (`cliff_ahead`, 1013) with `realtime.cliff.action:
refuse`; with `warn` (the default) it is admitted and session.started carries a `warning`.
A client that sends nothing for `realtime.idle_timeout_s` (before session.start or between
inputs; a slow engine does not count) gets an "idle_timeout" error frame and a close with 4408
(application range, after HTTP 408 Request Timeout); its engine-side session is closed and its
admission slot freed, as on every other ending.

A user holds at most `realtime.max_sessions_per_user` live sessions at this ingress; one more is
refused with a "too_many_sessions" error frame and 1008. The user is the API key's (keys bound
to users), else the one the client names (session.start `user` or the x-baton-user header);
sessions that name no user are bounded only by the AIMD cap.

A session is pinned to one decode replica for its life (chosen by the conversation directory,
like a conversation's first turn). Inputs are served in order: a tick that runs late delays the
next, and the lateness is what the client sees — the server does not drop or reorder ticks (a
shed session's inputs after its last reply are not read: it is closed instead).
The AIMD controller (router/admission.py) observes every tick's latency at this ingress and
caps this ingress's live sessions.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.websockets import WebSocketDisconnect

from baton.engine.realtime.messages import RealtimeClose, RealtimeOpen, RealtimeTick
from baton.engine.types import EngineRequestError
from deployments.backend import translate_error
from deployments.errors import APIError
from deployments.memory_api import USER_HEADER, resolve_user
from deployments.metrics import RealtimeMetrics
from deployments.realtime_frames import (
    CLOSE_IDLE,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TRY_LATER,
    FrameError,
    int_field,
    parse_frame,
    queued_s,
)
from deployments.realtime_sessions import LiveEntry, SessionRegistry, ShedNotice
from router.admission import AIMDController, Decision
from router.cliff import cliff_admission
from router.shedding import choose_shed

logger = logging.getLogger("baton.realtime")

@dataclass(frozen=True)
class SessionTiming:
    """A session's tick period and per-tick deadline (ms), as agreed in session.started."""

    tick_ms: int
    deadline_ms: int


class Socket(Protocol):
    """What a session talks to: a starlette WebSocket, or the gRPC stream's FrameSocket
    (deployments/grpc_realtime.py), which carries the same frames."""

    headers: Any

    async def accept(self) -> None: ...
    async def receive(self) -> Any: ...
    async def send_json(self, data: Any) -> None: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class RealtimeFrontend:
    def __init__(self, cfg: Any, decode: Any, directory: Any, renderer: Any, metrics: RealtimeMetrics | None = None):
        self._cfg = cfg
        self._decode = decode
        self._directory = directory
        self._renderer = renderer
        self._metrics = metrics
        self._ctl = AIMDController(cfg.admission, now=time.monotonic())
        self._sessions = SessionRegistry()  # who holds an admission slot
        self._per_user: dict[str, int] = {}  # live sessions of each named user

    @property
    def controller(self) -> AIMDController:
        return self._ctl

    @property
    def live(self) -> int:
        """Sessions holding an admission slot at this ingress."""
        return self._sessions.live

    def snapshot(self) -> dict[str, Any]:
        """For /baton/stats: live sessions, the cap, the overload mode and the sessions shed so far."""
        return {"live_sessions": self.live, "cap": self._ctl.cap, "overload": self._cfg.admission.overload,
                "sessions_shed_total": self._sessions.shed_total}

    async def serve(self, ws: Socket, bound_user: str | None = None) -> None:
        """bound_user: the user the client's API key is bound to (None: no key, or an operator key)."""
        await ws.accept()
        try:
            start = await self._receive(ws)
            if start is None or start["type"] != "session.start":  # (None only with a stop event: not here)
                raise FrameError("invalid_frame", "the first frame must be session.start")
            user = _session_user(bound_user, start.get("user"), ws.headers.get(USER_HEADER))
            open_msg, timing = self._open_message(start)
        except FrameError as e:
            await _fail(ws, e.code, str(e), e.close)
            return
        except WebSocketDisconnect:
            return
        held = self._per_user.get(user, 0) if user is not None else 0
        if held >= self._cfg.max_sessions_per_user:
            await _fail(ws, "too_many_sessions", f"this user already holds {held} live real-time sessions here, the most one user may "
                        "(realtime.max_sessions_per_user)", CLOSE_POLICY)
            return
        admission = self._ctl.can_admit(self.live)
        if not admission.admitted:
            if self._metrics:
                self._metrics.refused()
            await _fail(ws, "session_limit", admission.describe(), CLOSE_TRY_LATER, retry_after_s=admission.retry_after_s)
            return
        entry = self._sessions.admit(open_msg.session_id, time.monotonic())
        if user is not None:
            self._per_user[user] = held + 1
        self._report()
        replica = None
        try:
            target, eta = await self._place(open_msg)
            verdict = cliff_admission(eta, self._cfg.cliff)
            if verdict.action != "admit" and self._metrics:
                self._metrics.cliff(verdict.action)
            if verdict.action == "refuse":
                await _fail(ws, "cliff_ahead", verdict.describe(), CLOSE_TRY_LATER, retry_after_s=self._cfg.cliff.retry_after_s)
                return
            replica = await self._decode.realtime_open.remote(dataclasses.replace(open_msg, target_replica=target))
            started = {"type": "session.started", "session_id": open_msg.session_id, "mode": open_msg.mode,
                       "sink_tokens": open_msg.sink_tokens, "window_tokens": open_msg.window_tokens,
                       "tick_ms": timing.tick_ms, "deadline_ms": timing.deadline_ms}
            if verdict.action == "warn":
                logger.warning("real-time session %s admitted near the KV cliff: %s", open_msg.session_id, verdict.describe())
                started["warning"] = {"code": "cliff_ahead", "message": verdict.describe()}
            await ws.send_json(started)
            await self._ticks(ws, entry, replica, timing.deadline_ms / 1000)
        except WebSocketDisconnect:
            pass
        except FrameError as e:
            await _fail(ws, e.code, str(e), e.close)
        except Exception as e:  # noqa: BLE001 - engine or Ray failure: tell the client, log, close
            err = translate_error(e)
            logger.warning("real-time session %s ended: %s", open_msg.session_id, type(err).__name__)
            await _fail(ws, "engine_unavailable", f"the engine serving this session failed: {err}", CLOSE_INTERNAL)
        finally:
            self._sessions.release(open_msg.session_id)  # frees the slot unless a shed already did
            if user is not None:
                self._per_user[user] -= 1
                if not self._per_user[user]:
                    del self._per_user[user]
            self._report()
            if replica is not None:
                self._decode.realtime_close.remote(RealtimeClose(open_msg.session_id, replica))

    async def _receive(self, ws: Socket, stop: asyncio.Event | None = None) -> dict[str, Any] | None:
        """The client's next frame; None if `stop` is set first (the session was shed: the frame
        the client may be sending is not read); FrameError (4408) after idle_timeout_s of silence."""
        if stop is not None and stop.is_set():
            return None
        waits = [recv := asyncio.ensure_future(ws.receive())] + ([asyncio.ensure_future(stop.wait())] if stop is not None else [])
        try:
            await asyncio.wait(waits, timeout=self._cfg.idle_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in waits:
                f.cancel()
        if stop is not None and stop.is_set():
            if recv.done() and not recv.cancelled():
                recv.exception()  # a frame (or hang-up) that raced the shed: dropped, marked retrieved
            return None
        if not recv.done() or recv.cancelled():
            raise FrameError("idle_timeout", f"no frame from the client for {self._cfg.idle_timeout_s:g} s; session closed", CLOSE_IDLE)
        return parse_frame(recv.result(), self._cfg.max_frame_bytes)

    def _open_message(self, start: dict[str, Any]) -> tuple[RealtimeOpen, SessionTiming]:
        cfg = self._cfg
        mode = start.get("mode", cfg.mode)
        if mode not in ("bounded", "unbounded"):
            raise FrameError("invalid_value", "`mode` must be bounded or unbounded")
        instructions = start.get("instructions", "You are a real-time assistant. Reply briefly.")
        if not isinstance(instructions, str) or len(instructions) > cfg.max_input_chars:
            raise FrameError("invalid_value", f"`instructions` must be a string of at most {cfg.max_input_chars} characters")
        max_tokens = int_field(start, "max_tokens", cfg.max_tokens_per_tick, 1, cfg.max_tokens_per_tick)
        tick_ms = int_field(start, "tick_ms", cfg.tick_ms, 10, 60_000)
        deadline_ms = int_field(start, "deadline_ms", tick_ms, 10, 600_000)
        preamble = tuple(self._renderer.text_tokens(
            self._renderer.chat_text([{"role": "system", "content": instructions}], add_generation_prompt=False)))
        msg = RealtimeOpen(session_id=f"rt-{uuid.uuid4().hex}", mode=mode, preamble_ids=preamble,
                           sink_tokens=cfg.sink_tokens, window_tokens=cfg.window_tokens, max_tokens=max_tokens,
                           tick_s=tick_ms / 1000)
        return msg, SessionTiming(tick_ms=tick_ms, deadline_ms=deadline_ms)

    async def _place(self, msg: RealtimeOpen) -> tuple[str | None, float | None]:
        """The decoder the directory chose and its KV cliff forecast (None, None: place by load)."""
        if self._directory is None:
            return None, None
        try:
            cliff = self._cfg.cliff
            horizon = cliff.horizon_s if cliff.action != "off" else None  # a decoder away from its cliff, if any
            plan = await asyncio.wait_for(self._directory.for_session(msg.session_id).route.remote(msg.session_id, None, len(msg.preamble_ids), owned=False,
                                                                       cliff_horizon_s=horizon), 5.0)
            return plan.decode_replica, plan.cliff_eta_s
        except Exception as e:  # noqa: BLE001 - advisory: place by load
            logger.warning("directory could not place a real-time session (%s)", type(e).__name__)
            return None, None

    async def _ticks(self, ws: Socket, entry: LiveEntry, replica: str, deadline_s: float) -> None:
        session_id = entry.session_id
        while True:
            data = await self._receive(ws, entry.stop)
            if data is None:  # shed: at this tick boundary, the reply before it sent
                assert entry.notice is not None
                await _close_with(ws, entry.notice.frame(), CLOSE_TRY_LATER)
                return
            read_at = time.time()
            if data["type"] == "session.end":
                await ws.close(CLOSE_NORMAL)
                return
            if data["type"] != "input":
                raise FrameError("invalid_frame", f"unexpected frame type {data['type']!r} (input or session.end)")
            seq = int_field(data, "seq", -1, 0, 1 << 31)
            text = data.get("text")
            if not isinstance(text, str) or len(text) > self._cfg.max_input_chars:
                raise FrameError("invalid_value", f"`text` must be a string of at most {self._cfg.max_input_chars} characters")
            queued = queued_s(data, read_at, self._cfg.max_clock_skew_s, self._cfg.idle_timeout_s)
            t0 = time.monotonic()
            # each input is one user turn of the chat template; the reply is the assistant's turn
            turn = self._renderer.text_tokens(self._renderer.turn_text("-", text))
            tick = RealtimeTick(session_id, seq, tuple(turn), target_replica=replica)
            try:
                result = await self._decode.realtime_tick.remote(tick)
            except Exception as e:  # noqa: BLE001
                err = translate_error(e)
                if isinstance(err, EngineRequestError):
                    await ws.send_json({"type": "error", "seq": seq, "code": "tick_rejected", "message": str(err)})
                    continue
                raise err from None
            now = time.monotonic()
            latency = now - t0 + (queued or 0.0)  # from the client's send when it said when
            if result.error:  # the client gets no reply: a miss (+inf) for the controller, not a fast tick
                self._ctl.observe_miss(now)
            else:
                self._ctl.observe(latency, now)
            decision = self._ctl.update(now, self.live)
            if decision.shed:
                self._shed(decision)
            if self._metrics:
                self._metrics.tick(latency, latency > deadline_s)
            self._report()
            if result.error and result.fatal:
                raise FrameError("session_lost", result.error, CLOSE_INTERNAL)
            if result.error:
                await ws.send_json({"type": "error", "seq": seq, "code": "tick_failed", "message": result.error})
                continue
            out = {"type": "output", "seq": seq, "text": result.text, "server_ms": round((now - t0) * 1000, 1),
                   "prompt_tokens": result.prompt_tokens, "computed_tokens": result.computed_tokens, "kv_tokens": result.kv_peak_tokens}
            if queued is not None:
                out["queued_ms"] = round(queued * 1000, 1)
            await ws.send_json(out)

    def _shed(self, decision: Decision) -> None:
        """overload shed: the decrease left live sessions over the cap; close the newest of them."""
        plan = choose_shed(self._sessions.holding(), decision.cap_after)
        shed = self._sessions.shed(plan, ShedNotice(decision.cap_after, plan.live, self._cfg.admission.retry_after_s))
        logger.warning("AIMD cap %d -> %d at window p99 %.3f s: shedding %d of %d live real-time sessions (newest first)",
                       decision.cap_before, decision.cap_after, decision.p99_s or math.nan, len(shed), plan.live)
        if self._metrics:
            self._metrics.shed(len(shed))

    def _report(self) -> None:
        if self._metrics:
            self._metrics.sessions(self.live, self._ctl.cap)


def _session_user(bound: str | None, named: Any, header: str | None) -> str | None:
    """Who holds a session: the API key's user, else the user the client names (FrameError on
    a malformed name or a name that is not the key's)."""
    if named is not None and (not isinstance(named, str) or not 1 <= len(named) <= 256):
        raise FrameError("invalid_value", "`user` must be a string of 1-256 characters")
    try:
        return resolve_user(bound, named, header, required=False)
    except APIError as e:
        raise FrameError(e.code or "invalid_value", e.message) from None


async def _fail(ws: Socket, code: str, message: str, close: int, retry_after_s: float | None = None) -> None:
    body: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if retry_after_s is not None:
        body["retry_after_s"] = retry_after_s
    await _close_with(ws, body, close)


async def _close_with(ws: Socket, error_frame: dict[str, Any], close: int) -> None:
    """Send the error frame, then close (nothing suspends between them on the gRPC FrameSocket)."""
    try:
        await ws.send_json(error_frame)
        await ws.close(close, reason=str(error_frame.get("message", ""))[:120])
    except Exception:  # noqa: BLE001 - the client is gone
        pass

