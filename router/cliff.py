"""Metronome cliff predictor, physical and pure: when will a decoder's KV pool run out of tokens?

Between its ticks a real-time session retains KV in the decoder's pool: an unbounded session its
whole history (the prefix cache keeps every earlier tick), a bounded one nothing (its sink and
window live on the host and enter the pool only during its tick). While a tick runs, its request
holds every block of its prompt and reply so far, the partial tail block included. Per decoder,
from what its replica counts (baton/engine/realtime/growth.py):

    retained R  = Σ live sessions' tokens in the pool now: between ticks the whole KV blocks of
                  completed ticks (what the prefix cache keeps: growth.retained_tokens); during a
                  tick the blocks its request holds (growth.in_flight_tokens). An engine that runs
                  behind has most sessions' ticks in flight at once, and the pool holds that much more
    offered g_o = Σ tokens a session appended over its recent ticks ÷ (those ticks × its period)
    served  g_s = Σ the same tokens ÷ the seconds those ticks really took (measured tokens/s)
    growth  g   = min(g_o, g_s)       the pool fills no faster than the engine serves the ticks
    t_sat       = at + (C − R) ÷ g    C: the pool's capacity in tokens

No saturation ahead (eta None) when g = 0 or C is unknown (0); eta 0 when R >= C already.
Sessions still warming up (one tick so far) count at the others' mean rate (growth.py).
Counting the sessions' tokens, not the pool's blocks, keeps other requests' KV and dead cached blocks out of R.

`cliff_admission` turns a forecast into a verdict for a new real-time session: refuse (or warn)
when the decoder's cliff is closer than `horizon_s` (realtime.cliff in the YAML). The directory
first places a new real-time session on a decoder whose cliff is not that close, when one is live.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class DecoderTokens:
    """What one decoder's replica reports about its real-time sessions' KV, in tokens.
    Invariant (checked at construction): every figure finite and >= 0."""

    capacity_tokens: int  # tokens the KV pool holds (0 = unknown)
    retained_tokens: int
    offered_tokens_per_s: float
    served_tokens_per_s: float

    def __post_init__(self) -> None:
        figures = (self.capacity_tokens, self.retained_tokens, self.offered_tokens_per_s, self.served_tokens_per_s)
        if any(not math.isfinite(x) or x < 0 for x in figures):
            raise ValueError(f"token figures must be finite and >= 0, got {figures}")


@dataclass(frozen=True)
class CliffForecast:
    """The forecast made at `at` (any clock, as long as `now` comes from the same one)."""

    at: float
    capacity_tokens: int
    retained_tokens: int
    growth_tokens_per_s: float  # min(offered, served)
    capped: bool  # the engine serves less than the sessions offer: growth is the served rate
    eta_s: float | None  # seconds from `at` until R reaches C; None: not filling or capacity unknown

    @property
    def t_saturation(self) -> float | None:
        return None if self.eta_s is None else self.at + self.eta_s

    def seconds_to(self, fraction: float) -> float | None:
        """Seconds from `at` until R reaches fraction × C (0 when already there; None: never)."""
        return _seconds_to(fraction * self.capacity_tokens if self.capacity_tokens > 0 else None, self.retained_tokens,
                           self.growth_tokens_per_s, fraction)

    def eta_at(self, now: float) -> float | None:
        """The forecast's seconds to saturation as seen at `now` (>= at), never below 0."""
        return None if self.eta_s is None else max(0.0, self.eta_s - max(0.0, now - self.at))


def forecast_cliff(state: DecoderTokens, at: float) -> CliffForecast:
    growth = min(state.offered_tokens_per_s, state.served_tokens_per_s)
    capped = state.served_tokens_per_s < state.offered_tokens_per_s
    eta = _seconds_to(float(state.capacity_tokens) if state.capacity_tokens > 0 else None, state.retained_tokens, growth, 1.0)
    return CliffForecast(at, state.capacity_tokens, state.retained_tokens, growth, capped, eta)


def _seconds_to(level: float | None, retained: int, growth: float, fraction: float) -> float | None:
    """Seconds until `retained` grows to `level` tokens at `growth`/s (None: level unknown or no growth)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if level is None:
        return None
    room = level - retained
    if room <= 0:
        return 0.0
    return room / growth if growth > 0 else None


class CliffAdmissionConfig(BaseModel):
    """What a new real-time session meets when its decoder's cliff is near (YAML: realtime.cliff)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: Literal["off", "warn", "refuse"] = Field(
        "warn", description="off: ignore the forecast; warn: admit, log, count it and tell the client in session.started; "
        "refuse: an error frame `cliff_ahead` with retry_after_s and close 1013")
    horizon_s: float = Field(30.0, gt=0, description="act when the decoder's KV pool is forecast full within this many seconds")
    retry_after_s: float = Field(10.0, ge=0, description="retry hint given to a refused client")


@dataclass(frozen=True)
class CliffVerdict:
    action: Literal["admit", "warn", "refuse"]
    eta_s: float | None
    horizon_s: float

    def describe(self) -> str:
        if self.eta_s is None:
            return "no KV cliff ahead"
        return f"the decoder's KV pool is forecast full in {self.eta_s:.1f} s (horizon {self.horizon_s:g} s)"


def within_horizon(eta_s: float | None, horizon_s: float) -> bool:
    """The cliff (eta_s seconds away; None: none ahead) is closer than horizon_s."""
    return eta_s is not None and eta_s < horizon_s


def cliff_admission(eta_s: float | None, cfg: CliffAdmissionConfig) -> CliffVerdict:
    """admit unless the forecast cliff (eta_s, None: none ahead) is within cfg.horizon_s."""
    near = within_horizon(eta_s, cfg.horizon_s)
    action: Literal["admit", "warn", "refuse"] = "admit" if cfg.action == "off" or not near else cfg.action
    return CliffVerdict(action, eta_s, cfg.horizon_s)
