"""Figures of a fleet run: goodput under TTFT/ITL SLOs, TTFET of every effective turn, from one
TurnRecord per sent turn (baton/traces/records.py, as `bench conserve` records them).

SLOs (stated; our choice, in the range DistServe (OSDI '24) used for chatbots: TTFT 2.5 s,
TPOT 0.15 s on OPT-13B): every turn's TTFT <= TTFT_SLO_S and its mean inter-token time
(TPOT: (e2e - TTFT) / (tokens - 1)) <= TPOT_SLO_S; a real-time tick must end within its deadline
(the tick period) instead. A conversation is good when every one of its turns was sent, succeeded
and met its SLO. Failures are never dropped: a conversation the fleet rejected, failed, or did not
finish is in the denominator and not good; its unsent effective turns are TTFET +inf
(conserve_stats.effective_ttfets), so a percentile that reaches them is +inf.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton.bench.conserve_stats import effective_ttfets, percentile
from baton.traces.records import TurnRecord

TTFT_SLO_S = 2.0
TPOT_SLO_S = 0.10


@dataclass(frozen=True)
class ConversationRun:
    conversation_id: str
    effective: tuple[bool, ...]  # of every turn in the workload, sent or not
    deadlines: tuple[float | None, ...]
    records: tuple[TurnRecord, ...]  # the sent turns, in order
    rejected: bool = False  # refused by admission: nothing sent

    @property
    def completed(self) -> bool:
        return not self.rejected and len(self.records) == len(self.effective) and all(r.ok for r in self.records)


def tpot_s(r: TurnRecord) -> float:
    """Mean inter-token time of one reply (0 for a one-token reply)."""
    n = r.completion_tokens or 0
    if r.ttft_s is None:
        return float("inf")
    return (r.e2e_s - r.ttft_s) / (n - 1) if n > 1 else 0.0


def turn_meets_slo(r: TurnRecord, deadline_s: float | None) -> bool:
    if not r.ok or r.ttft_s is None:
        return False
    if deadline_s is not None:
        return r.e2e_s <= deadline_s
    return r.ttft_s <= TTFT_SLO_S and tpot_s(r) <= TPOT_SLO_S


def conversation_good(c: ConversationRun) -> bool:
    return c.completed and all(turn_meets_slo(r, d) for r, d in zip(c.records, c.deadlines, strict=False))


@dataclass(frozen=True)
class RunFigures:
    conversations: int
    completed: int
    good: int
    goodput_fraction: float  # good / arrived
    ttfet_p50_s: float | None
    ttfet_p95_s: float | None
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    effective_turns: int


def run_figures(runs: Sequence[ConversationRun]) -> RunFigures:
    ttfets = [x for c in runs for x in effective_ttfets(c.effective, c.records)]
    records = [r for c in runs for r in c.records]
    ttfts = [r.ttft_s if r.ok and r.ttft_s is not None else float("inf") for r in records]
    tpots = [tpot_s(r) if r.ok else float("inf") for r in records]
    good = sum(conversation_good(c) for c in runs)
    return RunFigures(
        conversations=len(runs), completed=sum(c.completed for c in runs), good=good,
        goodput_fraction=good / len(runs) if runs else 0.0,
        ttfet_p50_s=percentile(ttfets, 50), ttfet_p95_s=percentile(ttfets, 95),
        ttft_p95_s=percentile(ttfts, 95), tpot_p95_s=percentile(tpots, 95), effective_turns=len(ttfets))
