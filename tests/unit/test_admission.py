"""AIMD admission control (router/admission.py): convergence on a simulated latency curve
(baton/bench/admission_sim.py), refusal above the cap, the floor, and the cases where it must
hold. No engine; milliseconds."""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from baton.bench.admission_sim import simulate
from router.admission import AdmissionConfig, AIMDController, p99

CFG = AdmissionConfig(target_p99_ms=605, initial_cap=8, min_cap=1, max_cap=1024, additive_step=1,
                      multiplicative_factor=0.7, control_period_s=2.0, window_s=10.0, min_samples=20,
                      retry_after_s=3.0)


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


@pytest.mark.parametrize("curve, n_star", [(linear, 40.5), (knee, 62.1)], ids=["linear", "knee"])
def test_converges_to_a_sawtooth_band_around_n_star(curve, n_star: float) -> None:
    """Band: cap in [floor(0.7 * (floor(N*) + 1)), floor(N*) + 1] once it first reaches the top."""
    c = AIMDController(CFG)
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


def test_whole_run_p99_overshoots_target_only_by_the_probe() -> None:
    """Ticks over target come only from the one period per cycle spent at floor(N*) + 1."""
    c = AIMDController(CFG)
    trace = simulate(c, linear, offered_sessions=200, steps=1200, dt=0.5)
    lats = trace.latencies(since=100.0)
    over = sum(1 for x in lats if x > CFG.target_p99_s)
    assert 0 < over / len(lats) < 0.15
    assert max(lats) == pytest.approx(linear(41))


def test_offered_load_below_n_star_gets_everyone_admitted_and_cap_stays_near_it() -> None:
    c = AIMDController(CFG)
    trace = simulate(c, linear, offered_sessions=20, steps=400, dt=0.5)
    assert all(s.live == 20 for s in trace.steps[-100:])
    assert max(trace.caps()) == 22  # grows while live >= cap - 1, i.e. up to offered + 2


def test_long_sessions_drain_instead_of_repeated_decreases() -> None:
    """100 sessions of 60 s admitted at once under a too-high initial cap: the first overshoot cuts
    the cap to 70; the 100 live sessions keep p99 over target until they end, and the controller
    holds ("draining") instead of cutting 70 -> 49 -> 34 -> ... -> 1 each period."""
    c = AIMDController(CFG.model_copy(update={"initial_cap": 100}))
    trace = simulate(c, linear, offered_sessions=200, steps=1200, dt=0.5, session_s=60.0)
    c.check_integrity()
    first = [s for s in trace.steps if s.t < 60.0 and s.decision.reason != "period_not_elapsed"]
    assert (first[0].decision.action, first[0].decision.cap_after) == ("decrease", 70)
    assert all(s.decision.reason == "draining" and s.cap == 70 for s in first[1:])
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
    c = AIMDController(CFG)
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
