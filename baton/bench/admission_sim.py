"""A simulated system for the AIMD admission controller (router/admission.py): tick latency as a
function of live sessions, offered load over time. Used by the tests and benchmarks to show the
controller's convergence; the product runs the controller against real tick latencies."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from router.admission import AIMDController, Decision
from router.shedding import LiveSession, choose_shed


@dataclass(frozen=True)
class SimStep:
    t: float
    offered: int
    live: int
    cap: int  # after this step's update
    latency_s: float | None  # every tick's latency this step (None: no live sessions)
    decision: Decision
    shed: int = 0  # sessions shed this step (overload: shed, session_s mode)


@dataclass(frozen=True)
class SimulationTrace:
    steps: tuple[SimStep, ...]

    def caps(self, since: float = -math.inf) -> list[int]:
        return [s.cap for s in self.steps if s.t >= since]

    def latencies(self, since: float = -math.inf) -> list[float]:
        """One entry per tick (weighted by live sessions), for a whole-run p99."""
        return [s.latency_s for s in self.steps if s.t >= since and s.latency_s is not None for _ in range(s.live)]

    def shed_total(self) -> int:
        return sum(s.shed for s in self.steps)

    def over_target_share(self, target_s: float, since: float = -math.inf) -> float:
        """Share of the steps with live sessions whose ticks ran over target_s. Without session_s the
        cap and live count change only at control decisions, so with `since` on a period boundary
        this is also the share of control periods over target."""
        lats = [s.latency_s for s in self.steps if s.t >= since and s.latency_s is not None]
        return sum(lat > target_s for lat in lats) / len(lats) if lats else 0.0

    def decisions(self, action: str) -> list[Decision]:
        return [s.decision for s in self.steps if s.decision.action == action]


@dataclass(frozen=True)
class _Session:
    session_id: str
    admitted_at: float
    ends_at: float


def simulate(
    controller: AIMDController,
    latency_curve: Callable[[int], float],
    offered_sessions: int | Callable[[float], int],
    steps: int,
    dt: float,
    *,
    start: float = 0.0,
    session_s: float | None = None,
    backlog_steps: int = 0,
) -> SimulationTrace:
    """Drive `controller` against a simulated system whose tick latency is latency_curve(live).

    Each step (one tick period dt) at t = start + i*dt:
      1. update(t, live) with the live count of the previous step;
      2. sessions: with session_s None the cap applies at once (live = min(offered, cap), excess
         sessions are shed); otherwise admitted sessions stay session_s seconds and arrivals
         fill up to `offered` through can_admit. Under overload "drain" a lowered cap then bites
         only as sessions end; under "shed" the decision's shed count of sessions is closed at
         once, chosen by router/shedding.choose_shed (newest first), before the arrivals;
      3. every live session ticks once, all with latency latency_curve(live) observed at t
         (+inf from the curve is a miss). So the window p99 is curve(live).
    backlog_steps > 0: the latency is instead latency_curve of the largest live count of this step
    and the backlog_steps before it: ticks queued under a heavier load are still answered late for
    that many steps after the load fell (the backlog a cut leaves behind).
    """
    if backlog_steps < 0:
        raise ValueError(f"backlog_steps must be >= 0, got {backlog_steps}")
    offered_at = offered_sessions if callable(offered_sessions) else (lambda _t, n=offered_sessions: n)
    sessions: list[_Session] = []  # live sessions (session_s mode)
    live, admitted = 0, 0
    out: list[SimStep] = []
    for i in range(steps):
        t = start + i * dt
        decision = controller.update(t, live_sessions=live)
        offered = offered_at(t)
        shed = 0
        if session_s is None:
            live = min(offered, controller.cap)
            if offered > live:
                controller.can_admit(live)  # the refused arrival: marks the cap binding
            else:
                controller.note_live(live)
        else:
            if decision.shed:
                plan = choose_shed([LiveSession(s.session_id, s.admitted_at) for s in sessions], decision.cap_after)
                gone = set(plan.shed)
                sessions, shed = [s for s in sessions if s.session_id not in gone], plan.count
            sessions = [s for s in sessions if s.ends_at > t]
            while len(sessions) < offered and controller.can_admit(len(sessions)).admitted:
                sessions.append(_Session(f"s{admitted:06d}", t, t + session_s))
                admitted += 1
            live = len(sessions)
            controller.note_live(live)
        recent = [s.live for s in out[-backlog_steps:]] if backlog_steps else []
        latency = latency_curve(max([live, *recent])) if live else None
        for _ in range(live):
            if latency is not None and math.isinf(latency):
                controller.observe_miss(t)
            elif latency is not None:
                controller.observe(latency, t)
        out.append(SimStep(t, offered, live, controller.cap, latency, decision, shed))
    return SimulationTrace(tuple(out))


# ---- the AIMD bench's load shape ------------------------------------------------------------------


@dataclass(frozen=True)
class LoadStep:
    start_s: float
    sessions: int  # sessions offered from start_s on


@dataclass(frozen=True)
class LoadSchedule:
    """Offered sessions over time, a step function. Invariant (checked): steps start at 0, in
    strictly increasing order, with sessions >= 0."""

    steps: tuple[LoadStep, ...]

    def __post_init__(self) -> None:
        starts = [s.start_s for s in self.steps]
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False)) or any(s.sessions < 0 for s in self.steps):
            raise ValueError(f"a load schedule starts at 0 and rises strictly in time, got {self.steps}")

    def offered(self, t: float) -> int:
        return next(s.sessions for s in reversed(self.steps) if s.start_s <= t) if t >= 0 else self.steps[0].sessions

    def peak(self) -> int:
        return max(s.sessions for s in self.steps)


def step_schedule(low: int, high: int, length_s: float, up_at: float = 0.3, down_at: float = 0.7) -> LoadSchedule:
    """`low` sessions, a step up to `high` at up_at·length_s and back down to `low` at down_at·length_s:
    the low parts let the cap climb (additive increase), the high part drives latency over target
    (the ×factor decrease) and the step down shows the recovery."""
    if not 0 < up_at < down_at < 1 or not 0 <= low < high or length_s <= 0:
        raise ValueError("need 0 < up_at < down_at < 1, 0 <= low < high and length_s > 0")
    return LoadSchedule((LoadStep(0.0, low), LoadStep(up_at * length_s, high), LoadStep(down_at * length_s, low)))


def ticks_to_fill(window_tokens: int, sink_tokens: int, preamble_tokens: int, tokens_per_tick: float) -> int:
    """Ticks a bounded session needs before its window is full (and its per-tick work is at its
    constant maximum): the preamble past the sink, then tokens_per_tick a tick, must reach W."""
    if tokens_per_tick <= 0:
        raise ValueError("tokens_per_tick must be > 0")
    rest = window_tokens - max(0, preamble_tokens - sink_tokens)
    return max(1, math.ceil(rest / tokens_per_tick)) if rest > 0 else 1
