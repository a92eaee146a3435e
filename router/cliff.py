"""Metronome cliff predictor, pure: when will an append-forever KV pool saturate?

With N live sessions each appending r of the pool per second, occupancy grows as
ρ(t) = ρ0 + s·(t − t0) with s = N·r, and the pool saturates (ρ = 1) at

    t_sat = t0 + (1 − ρ0) / s

`fit_cliff` fits ρ0 and s by ordinary least squares over (t, ρ) samples, with the fit origin t0
= the first sample's time (so ρ0 is the fitted occupancy at t0). No forecast (None) with fewer
than 2 samples (or `min_samples`), with all samples at one time, or with s <= 0 (flat or
draining pool: no saturation ahead).

`OccupancyTracker` owns a sliding window of recent samples (the last `window_s` seconds), so a
change in N or r shows up in the forecast once the window has turned over.

Errors against a measured collapse: `prediction_error(predicted, measured) = |p − m| / m`, with
both as durations from the same origin (e.g. seconds since the ramp began), never epoch times.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OccupancySample:
    t: float  # seconds (any clock, as long as it is the one `now` comes from)
    rho: float  # fraction of the KV pool in use, in [0, 1]
    sessions: int | None = None  # live sessions N at t, when known


@dataclass(frozen=True)
class CliffForecast:
    """A fit of ρ(t) = ρ0 + s·(t − t0). t_saturation is absolute (same clock as the samples);
    eta_s = t_saturation − now (negative: the fit says the pool is already past full)."""

    rho0: float
    slope_per_s: float  # s = N·r
    per_session_rate: float | None  # r = s / N (mean N over the samples), None when N unknown or 0
    t_saturation: float
    eta_s: float
    samples: int
    r2: float  # coefficient of determination of the fit (1.0: the samples lie on the line)
    t0: float  # the fit origin: the first sample's time


def fit_cliff(samples: Sequence[OccupancySample], now: float, *, min_samples: int = 2) -> CliffForecast | None:
    """Least-squares line through the samples; None when no saturation can be predicted."""
    n = len(samples)
    if n < max(2, min_samples):
        return None
    t0 = samples[0].t
    xs = [s.t - t0 for s in samples]
    ys = [s.rho for s in samples]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    if slope <= 0:
        return None
    rho0 = my - slope * mx
    ss_res = sum((y - (rho0 + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    known = [s.sessions for s in samples if s.sessions is not None]
    mean_n = sum(known) / len(known) if known else 0.0
    t_sat = t0 + (1.0 - rho0) / slope
    return CliffForecast(rho0, slope, slope / mean_n if mean_n > 0 else None, t_sat, t_sat - now, n, r2, t0)


def prediction_error(predicted: float, measured: float) -> float:
    """e = |predicted − measured| / measured; both durations from a common origin, measured > 0."""
    if measured <= 0:
        raise ValueError(f"measured must be > 0, got {measured}")
    return abs(predicted - measured) / measured


class OccupancyTracker:
    """Owns the recent (t, ρ, N) samples of one KV pool.

    Invariants (`check_integrity`): samples sorted by time; every ρ in [0, 1]; after `forecast(now)`
    no sample is older than now − window_s.
    """

    def __init__(self, window_s: float, min_samples: int = 5) -> None:
        if window_s <= 0 or min_samples < 2:
            raise ValueError("need window_s > 0 and min_samples >= 2")
        self.window_s = window_s
        self.min_samples = min_samples
        self._samples: list[OccupancySample] = []

    def add(self, t: float, rho: float, sessions: int | None = None) -> None:
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"occupancy must be in [0, 1], got {rho}")
        times = [s.t for s in self._samples]
        self._samples.insert(bisect.bisect_right(times, t), OccupancySample(t, rho, sessions))
        self._prune(max(t, self._samples[-1].t))

    def forecast(self, now: float) -> CliffForecast | None:
        self._prune(now)
        return fit_cliff(self._samples, now, min_samples=self.min_samples)

    @property
    def samples(self) -> tuple[OccupancySample, ...]:
        return tuple(self._samples)

    def _prune(self, now: float) -> None:
        # [ older than now − window_s | kept ... ]
        cut = bisect.bisect_left([s.t for s in self._samples], now - self.window_s)
        del self._samples[:cut]

    def check_integrity(self) -> None:
        times = [s.t for s in self._samples]
        if times != sorted(times):
            raise AssertionError("occupancy samples not sorted by time")
        if any(not 0.0 <= s.rho <= 1.0 for s in self._samples):
            raise AssertionError("occupancy outside [0, 1]")
