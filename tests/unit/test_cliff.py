"""Metronome cliff predictor (router/cliff.py): least-squares fit of ρ(t) = ρ0 + N·r·t and the
predicted saturation time. Pure; milliseconds."""
from __future__ import annotations

import random

import pytest

from router.cliff import OccupancySample, OccupancyTracker, fit_cliff, prediction_error


def line(t0: float, rho0: float, slope: float, times: list[float], n: int | None = None) -> list[OccupancySample]:
    return [OccupancySample(t, rho0 + slope * (t - t0), n) for t in times]


def test_exact_recovery_on_a_noiseless_line() -> None:
    # 20 sessions x 0.0025 / s = 0.05 / s from 0.1 at t = 100: full at 100 + 0.9 / 0.05 = 118
    samples = line(100.0, 0.1, 0.05, [100.0 + 0.5 * i for i in range(20)], n=20)
    f = fit_cliff(samples, now=110.0)
    assert f is not None
    assert f.rho0 == pytest.approx(0.1) and f.slope_per_s == pytest.approx(0.05)
    assert f.per_session_rate == pytest.approx(0.0025)
    assert f.t_saturation == pytest.approx(118.0) and f.eta_s == pytest.approx(8.0)
    assert f.t0 == 100.0 and f.samples == 20 and f.r2 == pytest.approx(1.0)


def test_per_session_rate_is_none_without_session_counts() -> None:
    f = fit_cliff(line(0.0, 0.0, 0.1, [0.0, 1.0, 2.0]), now=2.0)
    assert f is not None and f.per_session_rate is None and f.t_saturation == pytest.approx(10.0)


def test_tolerance_on_noisy_data() -> None:
    rng = random.Random(7)
    times = [0.5 * i for i in range(120)]  # 60 s of samples, saturation at 0.2 + 0.8/0.01 = 80 s
    samples = [OccupancySample(t, min(1.0, max(0.0, 0.2 + 0.01 * t + rng.gauss(0, 0.02))), 10) for t in times]
    f = fit_cliff(samples, now=60.0)
    assert f is not None
    assert prediction_error(f.t_saturation, 80.0) < 0.05
    assert 0.9 < f.r2 < 1.0


@pytest.mark.parametrize("slope", [0.0, -0.01], ids=["flat", "decreasing"])
def test_no_forecast_for_flat_or_decreasing_occupancy(slope: float) -> None:
    assert fit_cliff(line(0.0, 0.5, slope, [float(i) for i in range(10)]), now=9.0) is None


def test_no_forecast_with_too_few_samples_or_one_instant() -> None:
    assert fit_cliff(line(0.0, 0.1, 0.1, [0.0]), now=0.0) is None
    assert fit_cliff(line(0.0, 0.1, 0.1, [0.0, 1.0, 2.0]), now=2.0, min_samples=4) is None
    assert fit_cliff([OccupancySample(1.0, 0.2), OccupancySample(1.0, 0.3)], now=1.0) is None


def test_eta_is_negative_when_the_fit_is_past_full() -> None:
    f = fit_cliff(line(0.0, 0.5, 0.1, [0.0, 1.0, 2.0]), now=10.0)
    assert f is not None and f.t_saturation == pytest.approx(5.0) and f.eta_s == pytest.approx(-5.0)


def test_tracker_window_drops_old_samples_and_follows_a_rate_change() -> None:
    tr = OccupancyTracker(window_s=10.0, min_samples=5)
    for i in range(20):  # t 0..19: slow fill 0.01/s
        tr.add(float(i), 0.01 * i, 5)
    for i in range(20, 40):  # t 20..39: fast fill 0.02/s (twice the sessions)
        tr.add(float(i), 0.19 + 0.02 * (i - 19), 10)
    tr.check_integrity()
    assert min(s.t for s in tr.samples) >= 39.0 - 10.0
    f = tr.forecast(now=39.0)
    assert f is not None and f.slope_per_s == pytest.approx(0.02) and f.per_session_rate == pytest.approx(0.002)
    # ρ(39) = 0.59: full 0.41 / 0.02 = 20.5 s later
    assert f.eta_s == pytest.approx(20.5)
    assert tr.forecast(now=100.0) is None  # everything expired
    assert tr.samples == ()


def test_tracker_keeps_samples_sorted_and_validates_occupancy() -> None:
    tr = OccupancyTracker(window_s=60.0, min_samples=3)
    for t in [3.0, 1.0, 2.0, 0.0]:
        tr.add(t, 0.1 * t)
    tr.check_integrity()
    assert [s.t for s in tr.samples] == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        tr.add(4.0, 1.5)
    with pytest.raises(ValueError):
        OccupancyTracker(window_s=0.0)


def test_prediction_error_metric() -> None:
    assert prediction_error(110.0, 100.0) == pytest.approx(0.10)
    assert prediction_error(90.0, 100.0) == pytest.approx(0.10)
    assert prediction_error(100.0, 100.0) == 0.0
    with pytest.raises(ValueError):
        prediction_error(1.0, 0.0)
