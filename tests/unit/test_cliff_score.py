"""Scoring the cliff predictor (baton/bench/cliff_score.py) and the engine-wide collapse onset
(baton/bench/collapse.collapse_onset) on synthetic series. Pure; milliseconds."""
from __future__ import annotations

import pytest

from baton.bench.cliff_score import ForecastSample, normalized_error, score_cliff
from baton.bench.collapse import TickOutcome, collapse_onset

SAT = 100.0  # measured saturation; the run starts at 0


def exact(times: list[float], saturation: float = SAT) -> list[ForecastSample]:
    return [ForecastSample(t, saturation - t) for t in times]


def every(step: float, until: float = SAT) -> list[float]:
    return [i * step for i in range(int(until / step))]


def test_an_exact_predictor_scores_zero_at_every_fit_point() -> None:
    score = score_cliff(exact(every(0.5)), start=0.0, saturation=SAT, onset=None)
    assert [p.fraction for p in score.points] == [0.25, 0.5, 0.75]
    assert [p.t_fit for p in score.points] == [25.0, 50.0, 75.0]
    assert all(p.horizon_error == 0.0 and p.predicted_s == SAT for p in score.points)
    assert score.horizon_error == 0.0 and score.onset_error is None and score.samples == 200


def test_a_biased_predictor_scores_its_bias_over_the_horizon() -> None:
    # always 10 s late: e = 10 / (100 - t_fit) = 0.133, 0.2, 0.4; the median is the 50 % point's
    samples = [ForecastSample(t, SAT + 10.0 - t) for t in every(0.5)]
    score = score_cliff(samples, start=0.0, saturation=SAT, onset=None)
    assert [p.horizon_error for p in score.points] == pytest.approx([10 / 75, 10 / 50, 10 / 25])
    assert score.horizon_error == pytest.approx(0.2)
    # a predictor 20 % of the horizon early everywhere scores 0.2 at every point
    early = [ForecastSample(t, 0.8 * (SAT - t)) for t in every(0.5)]
    assert score_cliff(early, start=0.0, saturation=SAT, onset=None).horizon_error == pytest.approx(0.2)


def test_the_fit_uses_the_latest_forecast_before_each_point_and_its_own_time() -> None:
    score = score_cliff(exact([0.0, 20.0, 40.0, 60.0, 80.0]), start=0.0, saturation=SAT, onset=None)
    assert [p.t_fit for p in score.points] == [20.0, 40.0, 60.0]
    assert score.horizon_error == 0.0


def test_errors_against_the_onset_only_where_it_lies_ahead() -> None:
    # the engine collapsed at 60 s, before the pool was full; the exact-saturation forecast is 40 s late
    score = score_cliff(exact(every(0.5)), start=0.0, saturation=SAT, onset=60.0)
    onset_errors = [p.onset_error for p in score.points]
    assert onset_errors == pytest.approx([40 / 35, 40 / 10, None])  # the 75 % fit came after the onset
    assert score.onset_error == pytest.approx((40 / 35 + 40 / 10) / 2)
    assert score_cliff(exact(every(0.5)), start=0.0, saturation=SAT, onset=10.0).onset_error is None


@pytest.mark.parametrize("samples, saturation", [
    (exact([10.0, 60.0]), SAT),  # too few forecasts: no score, never 0
    (exact(every(0.5)), None),  # the pool never filled
    ([], SAT),
], ids=["too few", "no saturation", "none"])
def test_nothing_to_score_gives_none(samples: list[ForecastSample], saturation: float | None) -> None:
    score = score_cliff(samples, start=0.0, saturation=saturation, onset=50.0)
    assert score.horizon_error is None and score.onset_error is None and score.points == ()


def test_a_fit_point_that_said_not_filling_leaves_the_median_unscored() -> None:
    samples = [ForecastSample(t, None if t < 30 else SAT - t) for t in every(0.5)]
    score = score_cliff(samples, start=0.0, saturation=SAT, onset=None)
    assert score.points[0].predicted_s is None and score.points[0].horizon_error is None
    assert score.points[1].horizon_error == 0.0
    assert score.horizon_error is None  # a missed forecast is no score, not a good one


def test_a_fit_point_before_any_forecast_has_no_fit() -> None:
    score = score_cliff(exact([30.0, 40.0, 60.0, 80.0]), start=0.0, saturation=SAT, onset=None)
    assert score.points[0].t_fit is None and score.horizon_error is None


def test_normalized_error_and_fractions_are_checked() -> None:
    assert normalized_error(110.0, 100.0, 50.0) == pytest.approx(0.2)
    assert normalized_error(110.0, 100.0, 100.0) is None
    with pytest.raises(ValueError):
        score_cliff(exact(every(1.0)), start=0.0, saturation=SAT, onset=None, fractions=(0.5, 1.0))
    assert score_cliff(exact(every(1.0)), start=0.0, saturation=SAT, onset=None).as_json()["points"][0]["fraction"] == 0.25


# ---- collapse onset from the latency series ------------------------------------------------------------


def outcome(session: int, seq: int, latency: float | None, period: float = 8.0, sessions: int = 4) -> TickOutcome:
    sent = seq * period + session * period / sessions
    return TickOutcome(seq, sent, sent + period, None if latency is None else sent + latency, 5)


def test_onset_is_the_first_run_of_k_late_ticks_across_sessions_in_send_order() -> None:
    ticks = []
    for seq in range(6):
        for s in range(4):
            late = seq == 1 and s == 0 or seq >= 3  # one slow tick early; everyone late from tick 3
            ticks.append(outcome(s, seq, 9.0 if late else 1.0))
    ticks[-1] = outcome(3, 5, None)  # a missing tick is late too
    # tick 3 of session 0 is sent at 24 s; its deadline (32 s) is the onset
    assert collapse_onset(ticks) == 32.0
    assert collapse_onset(ticks, consecutive=1) == 16.0  # the lone slow tick of session 0 at seq 1
    assert collapse_onset([outcome(s, q, 1.0) for s in range(4) for q in range(6)]) is None
    with pytest.raises(ValueError):
        collapse_onset(ticks, consecutive=0)


def test_an_empty_but_timely_reply_is_not_late_for_the_onset() -> None:
    ticks = [TickOutcome(q, 8.0 * q, 8.0 * q + 8.0, 8.0 * q + 1.0, 0) for q in range(5)]
    assert collapse_onset(ticks) is None
