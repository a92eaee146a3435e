"""The AIMD bench's load shape (baton/bench/admission_sim.py: step_schedule, ticks_to_fill): with
the real controller (router/admission.py) on a simulated latency curve, a step up and back down
with sessions that last makes it both raise the cap and cut it by ×0.7. No engine; milliseconds."""
from __future__ import annotations

import pytest

from baton.bench.admission_sim import LoadSchedule, LoadStep, simulate, step_schedule, ticks_to_fill
from router.admission import AdmissionConfig, AIMDController

PERIOD = 8.0  # the bench's tick period = control period


def test_the_schedule_steps_up_and_back_down() -> None:
    s = step_schedule(10, 20, 200.0)
    assert [(st.start_s, st.sessions) for st in s.steps] == [(0.0, 10), (60.0, 20), (140.0, 10)]
    assert [s.offered(t) for t in (0.0, 59.9, 60.0, 139.9, 140.0, 1e9)] == [10, 10, 20, 20, 10, 10]
    assert s.peak() == 20
    for bad in [(), (LoadStep(1.0, 3),), (LoadStep(0.0, 3), LoadStep(0.0, 4)), (LoadStep(0.0, -1),)]:
        with pytest.raises(ValueError):
            LoadSchedule(bad)
    with pytest.raises(ValueError):
        step_schedule(10, 10, 200.0)


def test_ticks_to_fill_the_window() -> None:
    # W = 256, S = 16, a 25-token preamble (9 past the sink), 40 tokens a tick: ceil(247 / 40) = 7
    assert ticks_to_fill(256, 16, 25, 40.0) == 7
    assert ticks_to_fill(256, 16, 400, 40.0) == 1  # the preamble alone fills it
    with pytest.raises(ValueError):
        ticks_to_fill(256, 16, 25, 0.0)


def test_the_step_schedule_exercises_both_the_increase_and_the_decrease() -> None:
    n_sust = 16  # sustainable: the latency curve crosses the 4 s target at 20 sessions
    cfg = AdmissionConfig(target_p99_ms=4000.0, initial_cap=n_sust // 2, max_cap=4 * n_sust, control_period_s=PERIOD,
                          window_s=6 * PERIOD, min_samples=5, retry_after_s=PERIOD)
    ctl = AIMDController(cfg, now=0.0)
    schedule = step_schedule(n_sust, 2 * n_sust, 300.0)
    session_s = (ticks_to_fill(256, 16, 25, 40.0) + 2) * PERIOD  # 9 ticks: 72 s

    def curve(live: int) -> float:
        return 1.0 + 0.15 * live  # 4 s at 20 live

    trace = simulate(ctl, curve, schedule.offered, steps=int(300 / PERIOD), dt=PERIOD, session_s=session_s)
    ctl.check_integrity()
    decisions = [s.decision for s in trace.steps]
    increases = [d for d in decisions if d.action == "increase"]
    decreases = [d for d in decisions if d.action == "decrease"]
    assert increases and decreases
    assert all(d.cap_after == int(d.cap_before * 0.7) for d in decreases)
    assert any(d.at < 90.0 for d in increases)  # the low part raised the cap before the step
    assert all(90.0 <= d.at for d in decreases)  # the decrease came with the high part
    # without the step (constant low load) the cap never falls: the bench would see no decrease
    flat = simulate(AIMDController(cfg, now=0.0), curve, n_sust, steps=int(300 / PERIOD), dt=PERIOD, session_s=session_s)
    assert not [s for s in flat.steps if s.decision.action == "decrease"]
