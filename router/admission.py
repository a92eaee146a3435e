"""AIMD admission control for real-time tick sessions (Metronome), pure: the clock is injected.

The ingress asks `can_admit(live_sessions)` when a session opens; "no room" is a value
(`Admission(admitted=False, reason="at_cap", retry_after_s=...)`) that the endpoint turns into a
429 / WebSocket close. Every tick reply (or a tick that never arrived) is fed to `observe` /
`observe_miss`; `update(now)` runs the control law at most once per `control_period_s`:

    p99 = nearest-rank 99th percentile of the tick latencies in the window (a miss is +inf)
    samples < min_samples                 -> hold  ("too_few_samples")
    p99 > target and live > cap           -> hold  ("draining": the last decrease has not bitten)
    p99 > target                          -> cap = max(min_cap, floor(cap * factor))  "decrease"
                                             (overload shed: and shed = max(0, live - cap))
    p99 <= target and cap was binding     -> cap = min(max_cap, cap + step)           "increase"
    p99 <= target and cap not binding     -> hold  ("not_binding")

Binding: at some point in the period the live-session count (seen through `can_admit`,
`note_live` or `update(live_sessions=)`) reached cap - 1 or more. Without this an idle system
would raise its cap without bound and then admit a burst it cannot serve.

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
reset (emptied) whenever the cap changes or a drain-hold is taken, so each decision looks only
at latencies observed under the current cap and load.

Invariants (`check_integrity`): min_cap <= cap <= max_cap; window samples sorted by time and
none before the last reset; latencies >= 0 (+inf for misses); under drain nothing is ever shed
(shed_total == 0). A Decision checks its own: shed >= 0, and shed > 0 only on a decrease.

Convergence on a latency curve rising through the target at N* (curve(n) <= target iff n <= N*)
with offered load above N*: the cap climbs by `additive_step` per period to floor(N*) + 1, the
first period there overshoots, the cap falls to floor(factor * (floor(N*) + 1)) and climbs
again: a sawtooth in [floor(factor * (floor(N*) + 1)), floor(N*) + 1] (tests/unit/test_admission.py,
driven by the simulator in baton/bench/admission_sim.py).
The one probing period per cycle at floor(N*) + 1 runs over target (about 6-9 % of ticks in the
tests' curves), so a whole-run p99 sits just above the target; to hold an SLO, set target_p99_ms
about 10 % under it (whole-run p99 = 0.91 x SLO on the same curves).
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
Reason = Literal["overshoot", "on_target", "too_few_samples", "not_binding", "draining", "at_limit", "period_not_elapsed"]


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

    def __post_init__(self) -> None:
        if self.shed < 0 or (self.shed and self.action != "decrease"):
            raise AssertionError(f"a {self.action} decision cannot shed {self.shed} sessions")


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (the smallest value >= 99 % of the values); values non-empty."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


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
            self.cap = max(self.config.min_cap, math.floor(self.cap * self.config.multiplicative_factor))
            shed = self._shed()
        elif action == "increase":
            self.cap = min(self.config.max_cap, self.cap + self.config.additive_step)
        if action != "hold" or reason == "draining":
            self._reset_window(now)
        self._period_start = now
        self._binding = self._live is not None and self._live >= self.cap - 1
        return Decision(now, action, reason, cap_before, self.cap, value, len(lats), binding, shed)

    def _shed(self) -> int:
        """Under overload "shed": the live sessions over the new cap, counted gone (live == cap)."""
        if self.config.overload != "shed" or self._live is None or self._live <= self.cap:
            return 0
        shed, self._live = self._live - self.cap, self.cap
        self.shed_total += shed
        return shed

    def _decide(self, value: float | None, samples: int, binding: bool) -> tuple[Action, Reason]:
        cfg = self.config
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
