"""AIMD admission control for real-time tick sessions (Metronome), pure: the clock is injected.

The ingress asks `can_admit(live_sessions)` when a session opens; "no room" is a value
(`Admission(admitted=False, reason="at_cap", retry_after_s=...)`) that the endpoint turns into a
429 / WebSocket close. Every tick reply (or a tick that never arrived) is fed to `observe` /
`observe_miss`; `update(now)` runs the control law at most once per `control_period_s`; the
first rule that applies decides:

    p99 = nearest-rank 99th percentile of the tick latencies in the window (a miss is +inf)
    cooling > 0                           -> hold  ("cooling": cooling -= 1, window reset)
    samples < min_samples                 -> hold  ("too_few_samples")
    p99 > target and live > cap           -> hold  ("draining": the last decrease has not bitten)
    p99 > target                          -> cap = max(min_cap, floor(cap * factor))  "decrease"
                                             cooling = cooldown_periods, ceiling = the cap before
                                             (overload shed: and shed = max(0, live - cap))
    p99 <= target and cap not binding     -> hold  ("not_binding")
    cap == ceiling - 1, held < probe_hold -> hold  ("below_ceiling": held += 1)
    cap == ceiling - 1                    -> cap = ceiling                 "increase" ("probe")
    otherwise                             -> cap = min(max_cap, cap + step)  "increase" ("on_target")
                                             (and <= ceiling - 1; at cap == ceiling, the probe
                                             held on target: the ceiling is dropped first)

held: below-ceiling holds in a row, back to 0 on any other decision. Binding: at some point in
the period the live-session count (seen through `can_admit`, `note_live` or
`update(live_sessions=)`) reached cap - 1 or more. Without this an idle system would raise its
cap without bound and then admit a burst it cannot serve.

Cooldown (`cooldown_periods`, default 1; 0: off): one cut per round trip. A cut shows in the
latencies only later: ticks queued under the old cap (under shed, also the closed sessions' last
ticks) are answered after it, late, into the next window, and judging that window cuts again for
the same overshoot (measured on the engine: 31 -> 21 -> 14 -> 9, 2 s apart). TCP's congestion
control meets the same echo and waits about a round trip after a reduction before it reduces
again; here the controller holds `cooldown_periods` periods after a decrease, neither cutting nor
raising, and empties the window at each, so the next decision sees only ticks observed after the
cooldown. It must span the backlog: late ticks for k periods after a cut need cooldown >= k.

Ceiling (`probe_hold_periods`, default 10; 0: off, no ceiling kept): the cap C that overshot is
remembered. The cap climbs back to C - 1 only, holds there ("below_ceiling") for
probe_hold_periods consecutive on-target binding periods, then probes C for one period: on target,
the capacity grew and the ceiling is forgotten (additive increase resumes); over target, the usual
decrease, C the ceiling again. A decrease from under the ceiling (the capacity fell) makes that
cap the ceiling. Why 10: on a fixed curve only the probe period runs over target, once per cycle
of 1 + cooldown + climb + hold periods, so the over-target share of periods is 1 / cycle <=
1 / (probe_hold_periods + 1) = 1/11; without the hold, 1 / (climb + 1) (tests' linear curve: 1/24
vs 1/14; knee: 1/30 vs 1/20). A longer hold lowers it further but leaves grown capacity unused for
longer (10 periods at the 2 s default: 20 s). A whole-run p99 on target needs under 1 % of ticks
over it, a cycle of ~100 periods, too slow to follow the load; hence the target margin below.

Overload (`overload`), what a decrease does to the sessions already live above the new cap:
  drain (default)  nothing: the cap only gates new sessions and live ones end on their own. While
                   more sessions are live than the cap allows, a further decrease would shed
                   nothing and only slow the recovery, so an overshoot holds ("draining", and
                   restarts the window) until departures bring live sessions under the cap. The
                   overshoot then lasts up to a session lifetime.
  shed             the decision also says how many live sessions to close: Decision.shed =
                   max(0, live - cap_after), on a decrease only. The caller picks them with
                   router/shedding.choose_shed (newest first) and closes them (the ingress: error
                   frame `shed_overload` + close 1013 at their next tick boundary); the controller
                   counts them gone at once (live == cap after the shed), so the draining hold does
                   not follow a shed and the next window sees the load of the new cap.

Window: latencies observed at t with t >= now - window_s and t >= the last reset. The window is
reset (emptied) whenever the cap changes or a draining or cooling hold is taken, so each
decision looks only at latencies observed under the current cap and load.

Invariants (`check_integrity`): min_cap <= cap <= max_cap; window samples sorted by time and
none before the last reset; latencies >= 0 (+inf for misses); under drain nothing is ever shed;
0 <= cooling <= cooldown_periods; ceiling None (always when probe_hold_periods == 0) or
min_cap < ceiling <= max_cap and cap <= ceiling (== only while probing); 0 <= held <=
probe_hold_periods, held > 0 only at cap == ceiling - 1. A Decision checks its own: shed >= 0,
shed > 0 only on a decrease, cap_after <= its ceiling.

Convergence on a latency curve rising through the target at N* (curve(n) <= target iff n <= N*)
with offered load above N*: the cap climbs by `additive_step` per period to top = floor(N*) + 1;
that period overshoots, the cap falls to floor(factor * top) with ceiling top, cools down, climbs
to top - 1, holds there probe_hold_periods periods and probes top for one period, which
overshoots: a sawtooth in [floor(factor * top), top] with a flat run under each tooth
(tests/unit/test_admission.py, on the simulator in baton/bench/admission_sim.py). Only the probe
period runs over target (simulated: 4.0 % of periods on the linear curve, 3.2 % on the knee; 7.2
and 5.0 % with cooldown_periods = probe_hold_periods = 0), so a whole-run p99 still sits just over
the target; to hold an SLO, set target_p99_ms about 10 % under it (whole-run p99 = 0.91 x SLO).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AdmissionConfig(BaseModel):
    """User-facing AIMD settings (YAML); extra="forbid" so a misspelled field fails by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_p99_ms: float = Field(600.0, gt=0, description="Per-tick p99 latency the controller holds the sessions to.")
    initial_cap: int = Field(8, ge=1, description="Admitted-session cap at start.")
    min_cap: int = Field(1, ge=1, description="The cap never falls below this.")
    max_cap: int = Field(1024, ge=1, description="The cap never rises above this.")
    additive_step: int = Field(1, ge=1, description="Sessions added to the cap per period when the cap is binding and p99 is on target.")
    multiplicative_factor: float = Field(0.7, gt=0, lt=1, description="cap <- floor(cap * factor) when p99 overshoots.")
    control_period_s: float = Field(2.0, gt=0, description="update() acts at most once per this many seconds.")
    window_s: float = Field(10.0, gt=0, description="Latencies older than this are dropped from the p99 window.")
    min_samples: int = Field(20, ge=1, description="Tick latencies needed in the window before the controller acts.")
    retry_after_s: float = Field(2.0, ge=0, description="Retry hint given to refused (and shed) clients.")
    overload: Literal["drain", "shed"] = Field(
        "drain", description="What a decrease does to the live sessions above the new cap. drain: nothing, they tick on "
        "until they end (the controller holds, 'draining', while live > cap); shed: the newest of them are closed at "
        "their next tick boundary (error frame shed_overload, close 1013 with retry_after_s), so the cut bites at once.")
    cooldown_periods: int = Field(
        1, ge=0, description="Control periods after a decrease in which the cap neither falls nor rises (hold 'cooling'), "
        "the window emptied at each: ticks queued under the old cap and answered late then cannot draw a second cut for "
        "the same overshoot. It should cover that backlog, in periods. 0: no cooldown (a cut every period while over target).")
    probe_hold_periods: int = Field(
        10, ge=0, description="After a decrease from cap C, the cap climbs back to C - 1 only and holds there "
        "('below_ceiling') for this many consecutive on-target binding periods before probing C for one period (on "
        "target: C is forgotten; over: cut again). The over-target share of periods is then at most 1 / (this + 1). "
        "0: no ceiling kept (the cap climbs straight back to C and overshoots every cycle).")

    @model_validator(mode="after")
    def _bounds(self) -> AdmissionConfig:
        if not self.min_cap <= self.initial_cap <= self.max_cap:
            raise ValueError(f"need min_cap <= initial_cap <= max_cap, got {self.min_cap}, {self.initial_cap}, {self.max_cap}")
        if self.window_s < self.control_period_s:
            raise ValueError(f"window_s ({self.window_s}) must be >= control_period_s ({self.control_period_s})")
        return self

    @property
    def target_p99_s(self) -> float:
        return self.target_p99_ms / 1000.0


@dataclass(frozen=True)
class Admission:
    """The answer to one session open. retry_after_s is set only when refused."""

    admitted: bool
    cap: int
    live_sessions: int
    reason: Literal["admitted", "at_cap"]
    retry_after_s: float | None

    def describe(self) -> str:
        if self.admitted:
            return f"admitted ({self.live_sessions + 1}/{self.cap})"
        return f"at capacity: {self.live_sessions} live sessions, cap {self.cap}; retry after {self.retry_after_s:g} s"


Action = Literal["increase", "decrease", "hold"]
Reason = Literal["overshoot", "on_target", "probe", "too_few_samples", "not_binding", "draining", "cooling", "below_ceiling",
                 "at_limit", "period_not_elapsed"]


@dataclass(frozen=True)
class Decision:
    """One call of update(). p99_s is None when the window was not evaluated or empty."""

    at: float
    action: Action
    reason: Reason
    cap_before: int
    cap_after: int
    p99_s: float | None
    samples: int
    binding: bool
    shed: int = 0  # live sessions to close (overload: shed, on a decrease): live - cap_after
    ceiling: int | None = None  # the remembered cap that overshot, after this decision (None: none kept)

    def __post_init__(self) -> None:
        if self.shed < 0 or (self.shed and self.action != "decrease"):
            raise AssertionError(f"a {self.action} decision cannot shed {self.shed} sessions")
        if self.ceiling is not None and self.cap_after > self.ceiling:
            raise AssertionError(f"cap {self.cap_after} above the ceiling {self.ceiling}")


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (the smallest value >= 99 % of the values); values non-empty."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def lowered_cap(cap: int, cfg: AdmissionConfig) -> int:
    """The multiplicative decrease: max(min_cap, floor(cap * factor))."""
    return max(cfg.min_cap, math.floor(cap * cfg.multiplicative_factor))


def raised_cap(cap: int, cfg: AdmissionConfig, ceiling: int | None) -> int:
    """The additive increase, stopped one under the ceiling; from ceiling - 1 itself: the probe, to
    the ceiling. ceiling None: no memory, min(max_cap, cap + step)."""
    up = min(cfg.max_cap, cap + cfg.additive_step)
    if ceiling is None:
        return up
    return ceiling if cap == ceiling - 1 else min(up, ceiling - 1)


class AIMDController:
    """Owns the admitted-session cap and the latency window; see the module docstring."""

    def __init__(self, config: AdmissionConfig, now: float = 0.0) -> None:
        self.config = config
        self.cap = config.initial_cap
        self._samples: list[tuple[float, float]] = []  # (observed_at, latency_s), sorted by time
        self._window_start = now  # samples observed before this are ignored (last reset)
        self._period_start = now
        self._binding = False
        self._live: int | None = None  # last live-session count reported
        self.shed_total = 0  # sessions the decisions said to shed (overload: shed)
        self.ceiling: int | None = None  # the cap that last overshot (probe_hold_periods > 0)
        self._cooling = 0  # control periods of cooldown left after the last decrease
        self._held = 0  # below-ceiling holds in a row

    @property
    def probing(self) -> bool:
        """The cap is at the ceiling: the period under way is the probe."""
        return self.ceiling is not None and self.cap == self.ceiling

    # ---- inputs ---------------------------------------------------------------------------------

    def observe(self, latency_s: float, now: float) -> None:
        """Record one tick's latency observed at `now` (+inf: the tick never arrived)."""
        if math.isnan(latency_s) or latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        if now < self._window_start:
            return  # observed under a previous cap
        bisect.insort(self._samples, (now, latency_s))

    def observe_miss(self, now: float) -> None:
        """A tick whose reply never arrived: counted as latency +inf (always over target)."""
        self.observe(math.inf, now)

    def note_live(self, live_sessions: int) -> None:
        """Report the live-session count (marks the cap binding when live >= cap - 1)."""
        if live_sessions < 0:
            raise ValueError(f"live_sessions must be >= 0, got {live_sessions}")
        self._live = live_sessions
        if live_sessions >= self.cap - 1:
            self._binding = True

    # ---- question -------------------------------------------------------------------------------

    def can_admit(self, live_sessions: int) -> Admission:
        """May one more session open while `live_sessions` are live? Does not change the cap."""
        self.note_live(live_sessions)
        if live_sessions < self.cap:
            return Admission(True, self.cap, live_sessions, "admitted", None)
        return Admission(False, self.cap, live_sessions, "at_cap", self.config.retry_after_s)

    # ---- control law ----------------------------------------------------------------------------

    def window(self, now: float) -> list[float]:
        """Latencies currently in the window (drops the expired ones)."""
        self._prune(now)
        return [lat for _, lat in self._samples]

    def update(self, now: float, live_sessions: int | None = None) -> Decision:
        """Run the AIMD law if a control period has elapsed since the last evaluation."""
        if live_sessions is not None:
            self.note_live(live_sessions)
        cap_before, binding = self.cap, self._binding
        if now - self._period_start < self.config.control_period_s:
            return Decision(now, "hold", "period_not_elapsed", cap_before, cap_before, None, len(self._samples), binding)
        lats = self.window(now)
        value = p99(lats) if lats else None
        action, reason = self._decide(value, len(lats), binding)
        shed = 0
        if action == "decrease":
            if self.config.probe_hold_periods:
                self.ceiling = self.cap
            self.cap = lowered_cap(self.cap, self.config)
            self._cooling = self.config.cooldown_periods
            shed = self._shed()
        elif action == "increase":
            if self.probing:  # the probe held on target: the capacity grew past the old ceiling
                self.ceiling = None
            self.cap = raised_cap(self.cap, self.config, self.ceiling)
        elif reason == "cooling":
            self._cooling -= 1
        self._held = self._held + 1 if reason == "below_ceiling" else 0
        if action != "hold" or reason in ("draining", "cooling"):
            self._reset_window(now)
        self._period_start = now
        self._binding = self._live is not None and self._live >= self.cap - 1
        return Decision(now, action, reason, cap_before, self.cap, value, len(lats), binding, shed, self.ceiling)

    def _shed(self) -> int:
        """Under overload "shed": the live sessions over the new cap, counted gone (live == cap)."""
        if self.config.overload != "shed" or self._live is None or self._live <= self.cap:
            return 0
        shed, self._live = self._live - self.cap, self.cap
        self.shed_total += shed
        return shed

    def _decide(self, value: float | None, samples: int, binding: bool) -> tuple[Action, Reason]:
        cfg = self.config
        if self._cooling:
            return "hold", "cooling"
        if value is None or samples < cfg.min_samples:
            return "hold", "too_few_samples"
        if value > cfg.target_p99_s:
            if self._live is not None and self._live > self.cap:
                return "hold", "draining"
            if self.cap <= cfg.min_cap:
                return "hold", "at_limit"
            return "decrease", "overshoot"
        if not binding:
            return "hold", "not_binding"
        if self.cap >= cfg.max_cap:
            return "hold", "at_limit"
        if self.ceiling is not None and self.cap == self.ceiling - 1:
            return ("hold", "below_ceiling") if self._held < cfg.probe_hold_periods else ("increase", "probe")
        return "increase", "on_target"

    def _prune(self, now: float) -> None:
        # [ expired: t < max(window_start, now - window_s) | kept ... ]
        cut = bisect.bisect_left(self._samples, (max(self._window_start, now - self.config.window_s), -math.inf))
        del self._samples[:cut]

    def _reset_window(self, now: float) -> None:
        self._window_start = now
        self._prune(now)

    def check_integrity(self) -> None:
        cfg = self.config
        if not cfg.min_cap <= self.cap <= cfg.max_cap:
            raise AssertionError(f"cap {self.cap} outside [{cfg.min_cap}, {cfg.max_cap}]")
        times = [t for t, _ in self._samples]
        if times != sorted(times):
            raise AssertionError("window samples not sorted by time")
        if times and times[0] < self._window_start:
            raise AssertionError(f"sample at {times[0]} predates the window start {self._window_start}")
        if any(lat < 0 for _, lat in self._samples):
            raise AssertionError("negative latency in window")
        if cfg.overload == "drain" and self.shed_total:
            raise AssertionError(f"overload drain shed {self.shed_total} sessions")
        if not 0 <= self._cooling <= cfg.cooldown_periods:
            raise AssertionError(f"cooldown {self._cooling} outside [0, {cfg.cooldown_periods}]")
        if self.ceiling is not None and not (cfg.probe_hold_periods and cfg.min_cap < self.ceiling <= cfg.max_cap
                                             and self.cap <= self.ceiling):
            raise AssertionError(f"ceiling {self.ceiling} with cap {self.cap} in [{cfg.min_cap}, {cfg.max_cap}], "
                                 f"probe_hold_periods {cfg.probe_hold_periods}")
        if not 0 <= self._held <= cfg.probe_hold_periods:
            raise AssertionError(f"{self._held} below-ceiling holds, more than {cfg.probe_hold_periods}")
        if self._held and (self.ceiling is None or self.cap != self.ceiling - 1):
            raise AssertionError(f"{self._held} below-ceiling holds at cap {self.cap}, ceiling {self.ceiling}")
