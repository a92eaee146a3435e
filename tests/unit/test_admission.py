"""AIMD admission control (router/admission.py): convergence on a simulated latency curve
(baton/bench/admission_sim.py), refusal above the cap, the floor, the cases where it must hold,
overload drain vs shed (a load step with long sessions: shed holds the p99 that drain loses for
a session lifetime), and the cooldown after a cut and the ceiling it leaves (tested both with the
defaults and with the law before them, OLD: cooldown_periods = probe_hold_periods = 0). No
engine; milliseconds."""
from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from baton.bench.admission_sim import simulate, step_schedule
from router.admission import AdmissionConfig, AIMDController, Decision, p99, raised_cap

CFG = AdmissionConfig(target_p99_ms=605, initial_cap=8, min_cap=1, max_cap=1024, additive_step=1,
                      multiplicative_factor=0.7, control_period_s=2.0, window_s=10.0, min_samples=20,
                      retry_after_s=3.0)  # cooldown_periods, probe_hold_periods: the defaults (1, 10)
OLD = CFG.model_copy(update={"cooldown_periods": 0, "probe_hold_periods": 0})  # the law without cooldown and ceiling
LAWS = pytest.mark.parametrize("cfg", [OLD, CFG], ids=["old", "default"])


def linear(n: int) -> float:
    """0.2 s + 10 ms per session: crosses the 605 ms target at N* = 40.5."""
    return 0.2 + 0.01 * n


def knee(n: int) -> float:
    """Flat until 60 sessions, then steeply rising: crosses 605 ms at N* = 60 + 0.105 / 0.05 = 62.1."""
    return 0.5 + (0.05 * (n - 60) if n > 60 else 0.0)


def feed(c: AIMDController, latency: float, n: int, now: float) -> None:
    for _ in range(n):
        c.observe(latency, now)


# ---- config ----------------------------------------------------------------------------------------


def test_config_forbids_unknown_fields_and_checks_bounds() -> None:
    with pytest.raises(ValidationError, match="target_p99"):
        AdmissionConfig(target_p99=600)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="initial_cap"):
        AdmissionConfig(min_cap=4, initial_cap=2)
    with pytest.raises(ValidationError):
        AdmissionConfig(multiplicative_factor=1.0)
    with pytest.raises(ValidationError, match="window_s"):
        AdmissionConfig(window_s=1.0, control_period_s=2.0)
    assert AdmissionConfig().target_p99_s == pytest.approx(0.6)


def test_p99_is_nearest_rank() -> None:
    assert p99([1.0]) == 1.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0


# ---- convergence -----------------------------------------------------------------------------------


@LAWS
@pytest.mark.parametrize("curve, n_star", [(linear, 40.5), (knee, 62.1)], ids=["linear", "knee"])
def test_converges_to_a_sawtooth_band_around_n_star(curve, n_star: float, cfg: AdmissionConfig) -> None:
    """Band: cap in [floor(0.7 * (floor(N*) + 1)), floor(N*) + 1] once it first reaches the top."""
    c = AIMDController(cfg)
    trace = simulate(c, curve, offered_sessions=200, steps=1200, dt=0.5)  # 600 s, offered >> N*
    c.check_integrity()
    top = math.floor(n_star) + 1
    bottom = math.floor(0.7 * top)
    first_top = next(s.t for s in trace.steps if s.cap == top)
    assert first_top < 2.0 * (top - CFG.initial_cap) + 10  # +1 per 2 s period on the way up
    caps = trace.caps(since=first_top)
    assert min(caps) == bottom and max(caps) == top
    decreases = [s.decision for s in trace.steps if s.decision.action == "decrease"]
    assert len(decreases) >= 3 and all(d.cap_before == top and d.cap_after == bottom for d in decreases)
    # Only the probing periods at cap = floor(N*) + 1 run over target, so the mean cap sits in the band
    mean = sum(caps) / len(caps)
    assert bottom < mean < top


@LAWS
def test_whole_run_p99_overshoots_target_only_by_the_probe(cfg: AdmissionConfig) -> None:
    """Ticks over target come only from the one period per cycle spent at floor(N*) + 1."""
    c = AIMDController(cfg)
    trace = simulate(c, linear, offered_sessions=200, steps=1200, dt=0.5)
    lats = trace.latencies(since=100.0)
    over = sum(1 for x in lats if x > CFG.target_p99_s)
    assert 0 < over / len(lats) < 0.15
    assert max(lats) == pytest.approx(linear(41))


@LAWS
def test_offered_load_below_n_star_gets_everyone_admitted_and_cap_stays_near_it(cfg: AdmissionConfig) -> None:
    c = AIMDController(cfg)
    trace = simulate(c, linear, offered_sessions=20, steps=400, dt=0.5)
    assert all(s.live == 20 for s in trace.steps[-100:])
    assert max(trace.caps()) == 22  # grows while live >= cap - 1, i.e. up to offered + 2


@LAWS
def test_long_sessions_drain_instead_of_repeated_decreases(cfg: AdmissionConfig) -> None:
    """100 sessions of 60 s admitted at once under a too-high initial cap: the first overshoot cuts
    the cap to 70; the 100 live sessions keep p99 over target until they end, and the controller
    holds ("draining", after the cooldown's "cooling") instead of cutting 70 -> 49 -> 34 -> ... -> 1
    each period."""
    c = AIMDController(cfg.model_copy(update={"initial_cap": 100}))
    trace = simulate(c, linear, offered_sessions=200, steps=1200, dt=0.5, session_s=60.0)
    c.check_integrity()
    first = [s for s in trace.steps if s.t < 60.0 and s.decision.reason != "period_not_elapsed"]
    assert (first[0].decision.action, first[0].decision.cap_after) == ("decrease", 70)
    cooling = cfg.cooldown_periods
    assert all(s.decision.reason == "cooling" and s.cap == 70 for s in first[1:1 + cooling])
    assert all(s.decision.reason == "draining" and s.cap == 70 for s in first[1 + cooling:])
    # afterwards it still settles into the band, never below it
    assert min(trace.caps(since=200.0)) == math.floor(0.7 * 41)
    assert max(trace.caps(since=200.0)) == 41


# ---- refusal, floor, holds ---------------------------------------------------------------------------


def test_refuses_at_the_cap_with_reason_and_retry_hint() -> None:
    c = AIMDController(CFG)
    ok = c.can_admit(7)
    assert ok.admitted and ok.reason == "admitted" and ok.retry_after_s is None and ok.cap == 8
    no = c.can_admit(8)
    assert not no.admitted and no.reason == "at_cap" and no.retry_after_s == 3.0 and no.cap == 8
    assert "retry after 3 s" in no.describe()
    assert c.cap == 8  # asking does not move the cap


def test_decreases_on_overshoot() -> None:
    c = AIMDController(CFG)
    feed(c, 0.9, 30, now=1.0)
    d = c.update(2.0, live_sessions=8)
    assert (d.action, d.reason, d.cap_before, d.cap_after) == ("decrease", "overshoot", 8, 5)
    assert d.p99_s == pytest.approx(0.9) and d.samples == 30
    assert c.window(2.0) == []  # the window restarts under the new cap
    c.check_integrity()


def test_never_below_min_cap() -> None:
    c = AIMDController(CFG.model_copy(update={"min_cap": 3, "initial_cap": 8}))
    for k in range(1, 20):
        feed(c, 5.0, 30, now=2.0 * k - 0.5)
        c.update(2.0 * k, live_sessions=0)
        c.check_integrity()
        assert c.cap >= 3
    assert c.cap == 3
    assert c.update(100.0).reason in {"too_few_samples", "at_limit"}


def test_holds_with_too_few_samples() -> None:
    c = AIMDController(CFG)
    feed(c, 5.0, 19, now=1.0)
    d = c.update(2.0, live_sessions=8)
    assert (d.action, d.reason, d.cap_after, d.samples) == ("hold", "too_few_samples", 8, 19)


def test_acts_at_most_once_per_control_period() -> None:
    c = AIMDController(OLD)  # no cooldown: a decrease may follow a decrease one period later
    feed(c, 5.0, 30, now=1.0)
    assert c.update(1.5, live_sessions=8).reason == "period_not_elapsed"
    assert c.update(2.0, live_sessions=8).action == "decrease"
    feed(c, 5.0, 30, now=2.5)
    assert c.update(3.0, live_sessions=5).reason == "period_not_elapsed"
    assert c.update(4.0, live_sessions=5).action == "decrease"


def test_does_not_grow_when_not_binding() -> None:
    """An idle-ish system (live well under the cap) keeps its cap however good the latency."""
    c = AIMDController(CFG)
    for k in range(1, 30):
        feed(c, 0.1, 30, now=2.0 * k - 0.5)
        d = c.update(2.0 * k, live_sessions=3)
        assert d.action == "hold" and d.reason == "not_binding"
    assert c.cap == 8


def test_grows_when_binding_and_on_target() -> None:
    c = AIMDController(CFG)
    c.can_admit(8)  # refused: binding
    feed(c, 0.1, 30, now=1.0)
    d = c.update(2.0)
    assert (d.action, d.cap_after, d.binding) == ("increase", 9, True)


def test_old_latencies_leave_the_window() -> None:
    c = AIMDController(CFG)
    c.note_live(3)
    feed(c, 5.0, 30, now=1.0)  # bad, but 11 s old at t = 12
    feed(c, 0.1, 30, now=11.0)
    d = c.update(12.0)
    assert d.samples == 30 and d.p99_s == pytest.approx(0.1) and d.action == "hold"
    c.check_integrity()


def test_misses_count_as_overshoot() -> None:
    c = AIMDController(CFG)
    feed(c, 0.1, 98, now=1.0)
    c.observe_miss(1.0)
    c.observe_miss(1.0)  # 2 % misses: the p99 is +inf
    d = c.update(2.0, live_sessions=8)
    assert d.p99_s == math.inf and d.action == "decrease"


def test_one_miss_in_two_hundred_is_within_p99() -> None:
    c = AIMDController(CFG)
    c.note_live(8)
    feed(c, 0.1, 199, now=1.0)
    c.observe_miss(1.0)
    d = c.update(2.0)
    assert d.p99_s == pytest.approx(0.1) and d.action == "increase"


def test_curve_of_misses_drives_cap_down_in_simulation() -> None:
    c = AIMDController(CFG.model_copy(update={"initial_cap": 100}))
    trace = simulate(c, lambda n: math.inf if n > 30 else 0.3, offered_sessions=200, steps=400, dt=0.5)
    assert max(trace.caps(since=100.0)) <= 31
    c.check_integrity()


def test_rejects_negative_latency_and_ignores_samples_before_a_reset() -> None:
    c = AIMDController(CFG)
    with pytest.raises(ValueError):
        c.observe(-0.1, 1.0)
    feed(c, 5.0, 30, now=1.0)
    c.update(2.0, live_sessions=8)  # decrease, window restarts at 2.0
    c.observe(5.0, 1.5)  # a late report of a tick under the old cap
    assert c.window(2.5) == []
    c.check_integrity()


def test_max_cap_is_respected() -> None:
    c = AIMDController(CFG.model_copy(update={"initial_cap": 10, "max_cap": 10}))
    c.can_admit(10)
    feed(c, 0.1, 30, now=1.0)
    d = c.update(2.0)
    assert (d.action, d.reason, c.cap) == ("hold", "at_limit", 10)


# ---- overload: drain (default) vs shed -----------------------------------------------------------------------


SHED = CFG.model_copy(update={"overload": "shed"})


def test_overload_is_drain_by_default_and_only_drain_or_shed() -> None:
    assert AdmissionConfig().overload == "drain"
    assert AdmissionConfig(overload="shed").overload == "shed"
    with pytest.raises(ValidationError, match="overload"):
        AdmissionConfig(overload="drop")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="overlaod"):
        AdmissionConfig(overlaod="shed")  # type: ignore[call-arg]


def test_under_shed_a_decrease_says_how_many_live_sessions_to_close() -> None:
    c = AIMDController(SHED.model_copy(update={"cooldown_periods": 0, "probe_hold_periods": 0}))
    feed(c, 0.9, 30, now=1.0)
    d = c.update(2.0, live_sessions=8)
    assert (d.action, d.cap_before, d.cap_after, d.shed) == ("decrease", 8, 5, 3)
    assert c.shed_total == 3
    # counted gone at once: the next overshoot decreases again (no "draining" hold) and sheds the new excess
    feed(c, 0.9, 30, now=3.0)
    d = c.update(4.0)
    assert (d.action, d.reason, d.cap_after, d.shed) == ("decrease", "overshoot", 3, 2)
    # an increase or a hold never sheds; nor a decrease with live within the new cap
    feed(c, 0.1, 30, now=5.0)
    assert c.update(6.0, live_sessions=3).shed == 0
    feed(c, 0.9, 30, now=7.0)
    d = c.update(8.0, live_sessions=1)
    assert d.action == "decrease" and d.shed == 0
    c.check_integrity()


@LAWS
def test_under_drain_a_decrease_sheds_nothing_and_holds_while_live_exceeds_the_cap(cfg: AdmissionConfig) -> None:
    c = AIMDController(cfg)
    feed(c, 0.9, 30, now=1.0)
    d = c.update(2.0, live_sessions=8)
    assert (d.action, d.cap_after, d.shed) == ("decrease", 5, 0)
    for k in range(cfg.cooldown_periods):  # the cooldown's holds come first
        feed(c, 0.9, 30, now=3.0 + 2 * k)
        assert c.update(4.0 + 2 * k, live_sessions=8).reason == "cooling"
    t = 2.0 * cfg.cooldown_periods
    feed(c, 0.9, 30, now=3.0 + t)
    d = c.update(4.0 + t, live_sessions=8)  # the 8 are still live: the draining hold
    assert (d.action, d.reason, d.cap_after, d.shed) == ("hold", "draining", 5, 0)
    assert c.shed_total == 0
    c.check_integrity()


def test_a_decision_only_sheds_on_a_decrease() -> None:
    with pytest.raises(AssertionError):
        Decision(1.0, "hold", "draining", 5, 5, 0.9, 30, True, shed=2)
    with pytest.raises(AssertionError):
        Decision(1.0, "decrease", "overshoot", 8, 5, 0.9, 30, True, shed=-1)


def test_after_a_load_step_shed_holds_the_target_where_drain_overshoots_for_a_session_lifetime() -> None:
    """Sessions of 60 s, the cap at 80 (above N* = 40.5) while the load is low, then a step to 200
    offered at 180 s: 80 sessions are admitted at once. The first overshoot cuts 80 -> 56 in both;
    drain then holds while 80 sessions tick on for their lifetime, shed closes the 24 newest and
    keeps cutting until the load is under target, then saws around N* as without long sessions."""
    schedule = step_schedule(10, 200, 600.0)  # 10 -> 200 at 180 s -> 10 at 420 s
    traces = {}
    for mode in ("drain", "shed"):
        c = AIMDController(CFG.model_copy(update={"initial_cap": 80, "overload": mode}))
        traces[mode] = simulate(c, linear, schedule.offered, steps=1200, dt=0.5, session_s=60.0)
        c.check_integrity()
    drain, shed = traces["drain"], traces["shed"]
    first = {m: next(s.decision for s in tr.steps if s.decision.action == "decrease") for m, tr in traces.items()}
    assert (first["drain"].at, first["drain"].cap_after, first["drain"].shed) == (182.0, 56, 0)
    assert (first["shed"].at, first["shed"].cap_after, first["shed"].shed) == (182.0, 56, 24)
    assert drain.shed_total() == 0 and shed.shed_total() > 24
    assert not [s for s in shed.steps if s.decision.reason == "draining"]
    assert all(s.live <= s.cap for s in shed.steps)  # shed: never more live than the cap after a step
    assert any(s.live > s.cap for s in drain.steps)

    def steady(tr, since: float = 200.0, until: float = 420.0) -> list[float]:  # 20 s after the step, to its end
        return [s.latency_s for s in tr.steps if since <= s.t < until and s.latency_s is not None for _ in range(s.live)]

    target = CFG.target_p99_s
    a_drain, a_shed = p99(steady(drain)) / target, p99(steady(shed)) / target
    assert a_shed < a_drain
    assert a_shed == pytest.approx(linear(41) / target)  # only the one probing period per cycle overshoots
    assert a_drain > 1.2  # 56+ live sessions for most of a minute
    over = {m: sum(x > target for x in steady(tr)) / len(steady(tr)) for m, tr in traces.items()}
    assert over["shed"] < 0.15 < over["drain"]


# ---- cooldown after a cut, the ceiling and its probe --------------------------------------------------


def period(c: AIMDController, latency: float, live: int, t: float) -> Decision:
    """One control period ending at t: 30 ticks at `latency` observed just before, `live` sessions."""
    feed(c, latency, 30, now=t - 0.5)
    d = c.update(t, live_sessions=live)
    c.check_integrity()
    return d


def test_an_overshoot_with_late_ticks_after_the_cut_gives_one_decrease_not_a_cascade() -> None:
    """30 live at cap 30 overshoot: cut to 21, 9 shed. The ticks queued under 30 live are answered
    in the next period, late. Without the cooldown they cut again (21 -> 14); with it the period is
    a "cooling" hold whose window is thrown away, and the on-target period after it raises the cap."""
    runs = {}
    for name, cfg in (("old", OLD), ("default", CFG)):
        c = AIMDController(cfg.model_copy(update={"initial_cap": 30, "overload": "shed"}))
        first = period(c, 0.9, 30, 2.0)
        assert (first.action, first.cap_after, first.shed) == ("decrease", 21, 9)
        feed(c, 0.9, 21, now=2.5)  # the backlog: queued before the cut, answered after it
        runs[name] = [first, period(c, 0.5, 21, 4.0), period(c, 0.5, 21, 6.0)]
    assert [(d.action, d.cap_after) for d in runs["old"][1:]] == [("decrease", 14), ("increase", 15)]
    assert [(d.action, d.reason, d.cap_after) for d in runs["default"][1:]] == [
        ("hold", "cooling", 21), ("increase", "on_target", 22)]
    assert runs["default"][1].p99_s == pytest.approx(0.9)  # seen, and not acted on


@pytest.mark.parametrize("backlog_steps, cooldown", [(4, 1), (8, 2)], ids=["one_period", "two_periods"])
def test_with_a_backlog_each_overshoot_cuts_once_when_the_cooldown_covers_it(backlog_steps: int, cooldown: int) -> None:
    """The simulator's backlog: ticks run late for backlog_steps steps (0.5 s each) after the load
    fell. A cooldown of as many control periods gives one cut per overshoot, always 41 -> 28; one
    period less, and OLD, cut again below the band."""
    cfg = CFG.model_copy(update={"cooldown_periods": cooldown})
    trace = simulate(AIMDController(cfg), linear, offered_sessions=200, steps=1200, dt=0.5, backlog_steps=backlog_steps)
    decreases = trace.decisions("decrease")
    assert len(decreases) >= 3 and all((d.cap_before, d.cap_after) == (41, 28) for d in decreases)
    for short in (cfg.model_copy(update={"cooldown_periods": cooldown - 1}), OLD):
        cascade = simulate(AIMDController(short), linear, offered_sessions=200, steps=1200, dt=0.5, backlog_steps=backlog_steps)
        assert any(d.cap_before == 28 for d in cascade.decisions("decrease"))


def test_the_default_sawtooth_cools_climbs_holds_below_the_ceiling_and_probes_once() -> None:
    """Between two cuts (41 -> 28, ceiling 41): one cooling period, 12 increases to 40, 10 holds
    below the ceiling, one probe to 41 (the only period over target), then the cut."""
    trace = simulate(AIMDController(CFG), linear, offered_sessions=200, steps=1200, dt=0.5)
    evaluated = [s.decision for s in trace.steps if s.decision.reason != "period_not_elapsed"]
    cuts = [i for i, d in enumerate(evaluated) if d.action == "decrease"]
    assert len(cuts) >= 5
    cycle = ["cooling"] + ["on_target"] * 12 + ["below_ceiling"] * 10 + ["probe"]
    for a, b in zip(cuts, cuts[1:], strict=False):
        assert [d.reason for d in evaluated[a + 1:b]] == cycle
        assert all(d.ceiling == 41 for d in evaluated[a:b + 1])
    at_top = [s.latency_s > CFG.target_p99_s for s in trace.steps if s.cap == 41 and s.t > 200.0]
    assert at_top and all(at_top)
    assert all(s.latency_s <= CFG.target_p99_s for s in trace.steps if s.cap < 41 and s.latency_s is not None)


@pytest.mark.parametrize("curve, top", [(linear, 41), (knee, 63)], ids=["linear", "knee"])
def test_the_probe_hold_lowers_the_share_of_over_target_periods(curve, top: int) -> None:
    """Over-target periods (only the probe's) per cycle of 1 + cooldown + climb + hold periods: with
    the defaults at most 1 / (probe_hold_periods + 1), and fewer than without the hold or in OLD."""
    share = {}
    for name, cfg in (("default", CFG), ("no_hold", CFG.model_copy(update={"probe_hold_periods": 0})), ("old", OLD)):
        trace = simulate(AIMDController(cfg), curve, offered_sessions=200, steps=2400, dt=0.5)
        share[name] = trace.over_target_share(CFG.target_p99_s, since=200.0)
    assert 0 < share["default"] <= 1 / (CFG.probe_hold_periods + 1)
    assert share["default"] < share["no_hold"] and share["default"] < share["old"]
    bottom = math.floor(0.7 * top)
    assert share["default"] == pytest.approx(1 / (1 + CFG.cooldown_periods + (top - 1 - bottom) + CFG.probe_hold_periods), abs=0.005)
    assert share["old"] == pytest.approx(1 / (1 + top - bottom), abs=0.005)


def test_a_probe_on_target_clears_the_ceiling_and_the_holds_must_be_consecutive() -> None:
    c = AIMDController(CFG.model_copy(update={"initial_cap": 10, "probe_hold_periods": 2}))
    assert (period(c, 0.9, 10, 2.0).cap_after, c.ceiling) == (7, 10)
    assert period(c, 0.1, 7, 4.0).reason == "cooling"
    assert [period(c, 0.1, live, t).cap_after for live, t in ((7, 6.0), (8, 8.0))] == [8, 9]
    assert period(c, 0.1, 3, 10.0).reason == "below_ceiling"  # binding in that period; 3 live from now
    assert period(c, 0.1, 3, 12.0).reason == "not_binding"  # breaks the run of holds
    assert [period(c, 0.1, 9, t).reason for t in (14.0, 16.0)] == ["below_ceiling", "below_ceiling"]
    probe = period(c, 0.1, 9, 18.0)
    assert (probe.action, probe.reason, probe.cap_after, probe.ceiling) == ("increase", "probe", 10, 10) and c.probing
    held = period(c, 0.1, 10, 20.0)  # the probe was on target: the capacity grew, the ceiling goes
    assert (held.action, held.reason, held.cap_after, held.ceiling) == ("increase", "on_target", 11, None)
    assert not c.probing and period(c, 0.1, 11, 22.0).cap_after == 12


def test_a_probe_over_target_cuts_and_keeps_the_ceiling() -> None:
    c = AIMDController(CFG.model_copy(update={"initial_cap": 10, "probe_hold_periods": 0}))
    period(c, 0.9, 10, 2.0)
    assert c.ceiling is None  # probe_hold_periods 0: no ceiling memory
    c = AIMDController(CFG.model_copy(update={"initial_cap": 9, "probe_hold_periods": 1, "cooldown_periods": 0}))
    c.ceiling = 10  # as after a cut from 10
    assert period(c, 0.1, 9, 2.0).reason == "below_ceiling"
    assert period(c, 0.1, 9, 4.0).reason == "probe"
    d = period(c, 0.9, 10, 6.0)
    assert (d.action, d.cap_before, d.cap_after, d.ceiling) == ("decrease", 10, 7, 10)


def test_a_cut_below_the_ceiling_lowers_it() -> None:
    """The capacity fell: the cap overshoots at 8, under the ceiling 10; 8 is the ceiling now and
    the climb stops at 7."""
    c = AIMDController(CFG.model_copy(update={"initial_cap": 10, "probe_hold_periods": 3}))
    period(c, 0.9, 10, 2.0)
    period(c, 0.1, 7, 4.0)  # cooling
    assert period(c, 0.1, 7, 6.0).cap_after == 8 and c.ceiling == 10
    d = period(c, 0.9, 8, 8.0)
    assert (d.action, d.cap_before, d.cap_after, d.ceiling) == ("decrease", 8, 5, 8)
    period(c, 0.1, 5, 10.0)  # cooling
    assert [period(c, 0.1, live, t).cap_after for live, t in ((5, 12.0), (6, 14.0), (7, 16.0))] == [6, 7, 7]
    assert c.update(16.0).reason == "period_not_elapsed" and period(c, 0.1, 7, 18.0).reason == "below_ceiling"


def test_the_increase_stops_one_under_the_ceiling_and_the_probe_steps_onto_it() -> None:
    cfg = CFG.model_copy(update={"additive_step": 3, "max_cap": 50})
    assert [raised_cap(cap, cfg, 41) for cap in (35, 38, 39, 40)] == [38, 40, 40, 41]
    assert raised_cap(49, cfg, None) == 50 and raised_cap(40, cfg, None) == 43


@pytest.mark.parametrize("cfg", [CFG, OLD, SHED, CFG.model_copy(update={"additive_step": 3, "min_cap": 3, "max_cap": 45,
                                                                      "probe_hold_periods": 2, "cooldown_periods": 2})],
                         ids=["default", "old", "shed", "step3"])
def test_integrity_holds_under_a_noisy_changing_load(cfg: AdmissionConfig) -> None:
    """A random walk of offered load against a noisy linear curve with misses, the integrity checked
    after every update; the default-like laws pass through every new reason."""
    rng = random.Random(11)
    c, offered, reasons = AIMDController(cfg), 30, set()
    for i in range(6000):
        t = 0.5 * i
        d = c.update(t, live_sessions=min(offered, c.cap))
        c.check_integrity()
        reasons.add(d.reason)
        offered = max(0, min(90, offered + rng.randint(-3, 3)))
        live = min(offered, c.cap)
        c.can_admit(live) if offered > live else c.note_live(live)
        for _ in range(live):
            c.observe_miss(t) if rng.random() < 0.001 else c.observe(linear(live) * rng.uniform(0.9, 1.1), t)
    expected = {"overshoot", "on_target", "not_binding"}
    if cfg.probe_hold_periods:
        expected |= {"cooling", "below_ceiling", "probe"}
    assert expected <= reasons


def test_check_integrity_catches_a_corrupted_cooldown_or_ceiling() -> None:
    def cut() -> AIMDController:  # cap 8 -> 5, ceiling 8, one cooling period to go
        c = AIMDController(CFG)
        period(c, 0.9, 8, 2.0)
        assert (c.cap, c.ceiling) == (5, 8)
        return c

    corruptions = {
        "cap over the ceiling": lambda c: setattr(c, "ceiling", 4),
        "ceiling at min_cap": lambda c: (setattr(c, "ceiling", 1), setattr(c, "cap", 1)),
        "ceiling over max_cap": lambda c: setattr(c, "ceiling", 2000),
        "negative cooldown": lambda c: setattr(c, "_cooling", -1),
        "cooldown too long": lambda c: setattr(c, "_cooling", 2),
        "holds away from the ceiling": lambda c: setattr(c, "_held", 1),
        "too many holds": lambda c: (setattr(c, "cap", 7), setattr(c, "_held", 11)),
    }
    for name, corrupt in corruptions.items():
        c = cut()
        corrupt(c)
        with pytest.raises(AssertionError):
            c.check_integrity()
            pytest.fail(name)
    old = AIMDController(OLD)
    old.ceiling = 20  # OLD keeps no ceiling
    with pytest.raises(AssertionError):
        old.check_integrity()
    with pytest.raises(AssertionError):
        Decision(1.0, "increase", "on_target", 8, 9, 0.1, 30, True, ceiling=8)


def test_cooldown_and_probe_hold_config() -> None:
    d = AdmissionConfig()
    assert (d.cooldown_periods, d.probe_hold_periods) == (1, 10)
    for name in ("cooldown_periods", "probe_hold_periods"):
        assert AdmissionConfig.model_fields[name].description
        assert getattr(AdmissionConfig(**{name: 0}), name) == 0  # 0: the law without it
        with pytest.raises(ValidationError, match=name):
            AdmissionConfig(**{name: -1})
        with pytest.raises(ValidationError, match=name):
            AdmissionConfig(**{name: 1.5})
    with pytest.raises(ValidationError, match="cooldown_period"):
        AdmissionConfig(cooldown_period=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="probe_hold"):
        AdmissionConfig(probe_hold=10)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="backlog_steps"):
        simulate(AIMDController(CFG), linear, 10, steps=1, dt=0.5, backlog_steps=-1)
