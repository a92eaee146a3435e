"""Scoring the KV cliff predictor (router/cliff.py) against what a run measured, pure.

Inputs: the predictor's forecasts over a run, as (t, eta_s) samples (eta_s None: "not filling");
the run's start (the first sample with a live session), the measured saturation t_sat, and the
collapse onset t_onset (baton/bench/collapse.py `collapse_onset`), all on one clock.

Fit points: for each fraction f (FIT_FRACTIONS = 25 / 50 / 75 %) the nominal time
start + f·(t_sat − start); the forecast used is the latest sample at or before it, and t_fit is
that sample's own time (the time of the fit). Its prediction is t̂ = t_fit + eta_s. Errors,
normalized by the forecast horizon (how far ahead the forecast looked):

    horizon error = |t̂ − t_sat|   ÷ (t_sat − t_fit)
    onset error   = |t̂ − t_onset| ÷ (t_onset − t_fit)     only where t_onset > t_fit

A fit point whose forecast said "not filling", or that has no sample, has no error (None).
The headline `horizon_error` is the median over the fit points, None unless every fit point was
scored; `onset_error` the median over the fit points the onset lies ahead of, None unless each of
them was scored (or there are none).
No saturation, or fewer than `min_samples` forecasts in [start, t_sat), scores nothing (None,
never 0).
"""
from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

FIT_FRACTIONS = (0.25, 0.5, 0.75)
MIN_SAMPLES = 3


@dataclass(frozen=True)
class ForecastSample:
    t: float
    eta_s: float | None  # seconds from t to the predicted saturation; None: not filling


@dataclass(frozen=True)
class FitPointScore:
    fraction: float
    t_fit: float | None  # the time of the forecast used (None: no sample before the fit point)
    predicted_s: float | None  # t̂
    horizon_error: float | None
    onset_error: float | None


@dataclass(frozen=True)
class CliffScore:
    start_s: float | None
    saturation_s: float | None
    onset_s: float | None
    samples: int  # forecasts in [start, saturation)
    points: tuple[FitPointScore, ...]
    horizon_error: float | None  # median over the fit points
    onset_error: float | None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "points": [asdict(p) for p in self.points]}


def normalized_error(predicted: float, measured: float, t_fit: float) -> float | None:
    """|predicted − measured| ÷ (measured − t_fit); None when the event is not ahead of the fit."""
    horizon = measured - t_fit
    return abs(predicted - measured) / horizon if horizon > 0 else None


def score_cliff(samples: Sequence[ForecastSample], *, start: float | None, saturation: float | None, onset: float | None,
                fractions: Sequence[float] = FIT_FRACTIONS, min_samples: int = MIN_SAMPLES) -> CliffScore:
    if any(not 0 < f < 1 for f in fractions) or not fractions:
        raise ValueError(f"fit fractions must lie in (0, 1), got {fractions}")
    ordered = sorted(samples, key=lambda s: s.t)
    usable = [] if start is None or saturation is None else [s for s in ordered if start <= s.t < saturation]
    if start is None or saturation is None or saturation <= start or len(usable) < min_samples:
        return CliffScore(start, saturation, onset, len(usable), (), None, None)
    times = [s.t for s in usable]
    points = []
    for f in fractions:
        i = bisect.bisect_right(times, start + f * (saturation - start)) - 1
        if i < 0:
            points.append(FitPointScore(f, None, None, None, None))
            continue
        s = usable[i]
        predicted = None if s.eta_s is None else s.t + s.eta_s
        points.append(FitPointScore(
            f, s.t, predicted,
            None if predicted is None else normalized_error(predicted, saturation, s.t),
            None if predicted is None or onset is None else normalized_error(predicted, onset, s.t)))
    return CliffScore(start, saturation, onset, len(usable), tuple(points), _median([p.horizon_error for p in points]),
                      _median([p.onset_error for p in points if onset is not None and p.t_fit is not None and onset > p.t_fit]))


def _median(errors: list[float | None]) -> float | None:
    """The median, None when there are none or any is missing (a failed forecast is no score, not a good one)."""
    if not errors or any(e is None for e in errors):
        return None
    return statistics.median(e for e in errors if e is not None)
