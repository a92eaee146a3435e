"""A real-time session's token state and the pure rule that composes each tick's request.

Bounded mode (Metronome): the session keeps S anchor ("sink") tokens — its true first tokens —
and the last W tokens; every tick is one engine request

    positions: [0, S)            [S, S+w)               [S+w, S+w+p)
               sink (KV injected) window (KV injected,   pending: last reply + new input
               as first computed) re-rotated here)       (computed this tick)

so the work and the KV of a tick are constant once the window is full. After the tick the KV of
[S, end) is captured (position-free) and the window becomes the last W tokens of window+pending.
The tokens the model generates are pending for the next tick (their KV is computed then).

Unbounded mode (what engines do today): every tick sends the whole history; the engine's prefix
cache (salted per session) keeps the earlier ticks' KV, so memory grows with the session.

Invariant (check_integrity): len(sink) ≤ S; len(window) ≤ W; sink_kv/window_kv, when present,
hold exactly the KV of sink/window; in bounded mode history is not kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

Mode = Literal["bounded", "unbounded"]


@dataclass(frozen=True)
class SessionSpec:
    session_id: str
    mode: Mode
    sink_tokens: int  # S
    window_tokens: int  # W
    max_tokens: int  # reply tokens per tick
    salt: str  # prefix-cache salt of the session (unbounded) / prefix of per-tick salts (bounded)


@dataclass(frozen=True)
class SessionState:
    spec: SessionSpec
    sink: tuple[int, ...] = ()
    window: tuple[int, ...] = ()
    pending: tuple[int, ...] = ()  # tokens whose KV is not computed yet (previous reply)
    history: tuple[int, ...] = ()  # unbounded only: every token so far
    sink_kv: Any = None  # KVSegment of `sink`
    window_kv: Any = None  # KVSegment of `window`
    ticks: int = 0

    def check_integrity(self) -> None:
        s = self.spec
        if len(self.sink) > s.sink_tokens or len(self.window) > s.window_tokens:
            raise AssertionError("sink or window exceeds its bound")
        for kv, ids in ((self.sink_kv, self.sink), (self.window_kv, self.window)):
            if kv is not None and tuple(kv.token_ids) != ids:
                raise AssertionError("segment KV does not hold the tokens it stands for")
        if s.mode == "bounded" and self.history:
            raise AssertionError("bounded sessions keep no history")


@dataclass(frozen=True)
class TickPlan:
    """One tick's engine request: prompt, segments to inject from position 0, ranges to capture."""

    prompt: tuple[int, ...]
    inject: tuple[Any, ...] = ()  # KVSegments, laid from position 0
    capture: tuple[tuple[int, int], ...] = ()
    salt: str = ""
    computed_tokens: int = 0  # prompt tokens the engine computes (the rest are injected or cached)
    new_tokens: tuple[int, ...] = field(default=(), repr=False)  # pending + input of this tick


def open_session(spec: SessionSpec, preamble: tuple[int, ...]) -> SessionState:
    """A session starts with its preamble (instructions): its first S tokens are the sink."""
    if spec.mode == "unbounded":
        return SessionState(spec=spec, pending=preamble)
    return SessionState(spec=spec, sink=preamble[: spec.sink_tokens], pending=preamble[spec.sink_tokens :])


def plan_tick(state: SessionState, new_input: tuple[int, ...]) -> TickPlan:
    s = state.spec
    new = state.pending + new_input
    if s.mode == "unbounded":
        prompt = state.history + new
        return TickPlan(prompt=prompt, salt=s.salt, computed_tokens=len(new), new_tokens=new)
    #        [0, S) sink      [S, S+w) window     [S+w, end) new
    prompt = state.sink + state.window + new
    if not new:
        raise ValueError("a bounded tick needs at least one new token")
    have_kv = state.ticks > 0 and (not state.sink or state.sink_kv is not None) and (not state.window or state.window_kv is not None)
    salt = f"{s.salt}-t{state.ticks}"
    start = len(state.sink)
    if not have_kv:  # first tick: compute everything, capture the sink and what follows it
        ranges = ((0, start),) if start else ()
        return TickPlan(prompt=prompt, capture=ranges + ((start, len(prompt)),), salt=salt,
                        computed_tokens=len(prompt), new_tokens=new)
    inject = ((state.sink_kv,) if state.sink else ()) + ((state.window_kv,) if state.window else ())
    return TickPlan(prompt=prompt, inject=inject, capture=((start, len(prompt)),), salt=salt,
                    computed_tokens=len(new), new_tokens=new)


def after_tick(state: SessionState, plan: TickPlan, captured: tuple[Any, ...], reply: tuple[int, ...]) -> SessionState:
    """The session after a tick: `captured` are the KV segments of plan.capture, in order."""
    s = state.spec
    if s.mode == "unbounded":
        return replace(state, history=plan.prompt, pending=reply, ticks=state.ticks + 1)
    tail = captured[-1]  # KV of [S, end): window + new tokens, position-free
    ids = state.window + plan.new_tokens
    keep = min(s.window_tokens, len(ids))
    sink_kv = captured[0] if len(plan.capture) == 2 else state.sink_kv
    window = ids[len(ids) - keep :]
    window_kv = tail.slice(tail.num_tokens - keep, tail.num_tokens) if keep else None
    return replace(state, window=window, window_kv=window_kv, sink_kv=sink_kv, pending=reply, ticks=state.ticks + 1)


def after_lost_kv(state: SessionState, plan: TickPlan, reply: tuple[int, ...]) -> SessionState:
    """The session after a tick whose capture failed: the tokens move on as usual but the
    session holds no KV, so the next tick computes sink + window + new tokens (plan_tick's
    first-tick path: no KV to inject) and captures again. `ticks` keeps counting, so the next
    tick's prefix-cache salt is still one no earlier tick of the session used."""
    if state.spec.mode == "unbounded":
        return after_tick(state, plan, (), reply)
    ids = state.window + plan.new_tokens
    keep = min(state.spec.window_tokens, len(ids))
    return replace(state, window=ids[len(ids) - keep :], window_kv=None, sink_kv=None, pending=reply, ticks=state.ticks + 1)
