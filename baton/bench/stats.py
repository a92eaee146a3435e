"""Small statistics shared by benchmarks."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    e2e_s: float
    completion_tokens: int


@dataclass(frozen=True)
class PhaseSummary:
    name: str
    requests: int
    wall_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_p50_s: float
    output_tok_per_s: float


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile, q in [0, 1]."""
    if not values:
        raise ValueError("no values")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_phase(name: str, timings: Sequence[RequestTiming], wall_s: float) -> PhaseSummary:
    ttfts = [t.ttft_s for t in timings]
    return PhaseSummary(
        name=name,
        requests=len(timings),
        wall_s=wall_s,
        ttft_p50_s=quantile(ttfts, 0.5),
        ttft_p95_s=quantile(ttfts, 0.95),
        e2e_p50_s=quantile([t.e2e_s for t in timings], 0.5),
        output_tok_per_s=sum(t.completion_tokens for t in timings) / wall_s,
    )
