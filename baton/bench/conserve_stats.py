"""Pure figures of the ConServe bench (baton/bench/conserve.py): TTFET of every effective turn,
percentiles that count failures, inter-token gaps, TTFT by turn index, the load level the
headline is read at, and the median/min/max over repetitions.

Failures are never dropped: a failed turn fails its conversation, and every effective turn of
that conversation from the failed chain on (sent or not) is a TTFET sample of +inf. A percentile
whose rank reaches a +inf sample is itself +inf, so a policy cannot look fast by losing its slow
conversations."""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from baton.traces.records import TurnRecord

INF = math.inf


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation (numpy's default); +inf samples sort
    last and any rank that touches one is +inf. None when there are no samples."""
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    if xs[hi] == INF and rank > lo or xs[lo] == INF:
        return INF
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def effective_ttfets(effective: Sequence[bool], records: Sequence[TurnRecord]) -> list[float]:
    """One TTFET per effective turn of a conversation whose trace turns are `effective` (in order)
    and whose sent turns are `records` (a prefix of them; the replay stops at the first failure).

    An effective turn's chain is the turns after the previous effective turn, up to and including
    it (docs/TRACES.md: the tool-call round trips before the user sees an answer). Its TTFET runs
    from the chain's first request being sent to the effective turn's first token. A chain with a
    failed or unsent turn, or an effective turn without a first token, is +inf."""
    out: list[float] = []
    chain_start = 0
    for index, is_effective in enumerate(effective):
        if not is_effective:
            continue
        chain = records[chain_start:index + 1]
        last = chain[-1] if len(chain) == index + 1 - chain_start else None
        if last is None or any(not r.ok for r in chain) or last.ttft_s is None:
            out.append(INF)
        else:
            out.append(last.send_time_s + last.ttft_s - chain[0].send_time_s)
        chain_start = index + 1
    return out


def chunk_gaps(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive streamed chunks of one reply (a chunk can carry several tokens
    when the server coalesces them, so these are per chunk, not per token)."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]


def token_gaps(chunk_times: Sequence[float], tokens: Sequence[int] | None) -> list[float] | None:
    """Inter-token latencies of one reply: a chunk that arrives g after the previous one with n
    tokens gives n samples of g / n (its tokens are spread over the gap; the mean over a reply is
    its time per output token after the first chunk). Chunks that held no token are skipped; the
    first chunk's tokens are part of the time to first token, not of any gap. None when the
    tokens per chunk are unknown (no usage on every chunk) or do not match the chunks."""
    if tokens is None or len(tokens) != len(chunk_times) or any(n < 0 for n in tokens):
        return None
    held = [(t, n) for t, n in zip(chunk_times, tokens, strict=True) if n > 0]
    return [(b - a) / n for (a, _), (b, n) in zip(held, held[1:], strict=False) for _ in range(n)]


@dataclass(frozen=True)
class TurnIndexTtft:
    turn_index: int
    sent: int
    failed: int  # failed turns at this index (their TTFT is +inf in the percentiles)
    ttft_p50_s: float | None
    ttft_p95_s: float | None


def ttft_by_turn(records: Iterable[TurnRecord]) -> list[TurnIndexTtft]:
    """TTFT p50/p95 by turn index over the sent turns; a failed one counts as +inf."""
    by: dict[int, list[float]] = {}
    failed: dict[int, int] = {}
    for r in records:
        value = r.ttft_s if r.ok and r.ttft_s is not None else INF
        by.setdefault(r.turn_index, []).append(value)
        failed[r.turn_index] = failed.get(r.turn_index, 0) + (value == INF)
    return [TurnIndexTtft(i, len(v), failed[i], percentile(v, 50), percentile(v, 95)) for i, v in sorted(by.items())]


@dataclass(frozen=True)
class Spread:
    """A figure over repetitions: the median of the per-repetition values, and their range."""

    median: float | None
    min: float | None
    max: float | None
    n: int

    def as_json(self) -> dict[str, float | int | str | None]:
        return {"median": _finite_or_str(self.median), "min": _finite_or_str(self.min), "max": _finite_or_str(self.max), "n": self.n}


def spread(values: Iterable[float | None]) -> Spread:
    """Median/min/max of the repetitions' values (None values, a repetition without samples, are left out)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return Spread(None, None, None, 0)
    return Spread(statistics.median(xs), xs[0], xs[-1], len(xs))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b for figures that may be +inf or missing: None when either is missing, b is 0 or both are +inf."""
    if a is None or b is None or b == 0 or (a == INF and b == INF):
        return None
    return a / b


def slo_level(rates: Sequence[float], p95_ttft_s: Sequence[float | None], slo_s: float) -> tuple[float, bool]:
    """(rate, met): the highest load level whose p95 TTFT meets the SLO (p95 <= slo_s); when
    none does, the lowest level and met=False (the headline is then flagged)."""
    if not rates or len(rates) != len(p95_ttft_s):
        raise ValueError("one p95 TTFT per load level")
    meeting = [rate for rate, p95 in zip(rates, p95_ttft_s, strict=True) if p95 is not None and p95 <= slo_s]
    return (max(meeting), True) if meeting else (min(rates), False)


def _finite_or_str(x: float | None) -> float | str | None:
    """JSON has no infinity: +inf is written as the string "inf"."""
    return "inf" if x == INF else x


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else ("inf" if x == INF else f"{x:.{digits}f}")


# ---- one policy at one load level in one repetition, then over repetitions -------------------------

SPREAD_FIGURES = ("ttfet_p50_s", "ttfet_p95_s", "itl_p50_s", "itl_p95_s", "ttft_p50_s", "ttft_p95_s", "handoffs_per_conversation",
                  "chunk_gap_p50_s", "chunk_gap_p95_s")


@dataclass(frozen=True)
class ConversationOutcome:
    """The part of a conversation's run the figures read (conserve_load.ConversationRun has it)."""

    effective: tuple[bool, ...]
    records: tuple[TurnRecord, ...]
    gaps: tuple[tuple[float, ...], ...]  # per sent turn: inter-token latencies (token_gaps), else chunk gaps
    chunk_gaps: tuple[tuple[float, ...], ...] | None = None  # per sent turn, per chunk; None: gaps are per chunk

    @property
    def failed(self) -> bool:
        return any(not r.ok for r in self.records) or len(self.records) < len(self.effective)


@dataclass(frozen=True)
class LevelFigures:
    conversations: int
    failed_conversations: int
    turns_sent: int
    turns_failed: int
    effective_turns: int  # TTFET samples (failed ones are +inf)
    ttfet_p50_s: float | None
    ttfet_p95_s: float | None
    itl_p50_s: float | None  # per token when every conversation knew its tokens per chunk (itl_per_token)
    itl_p95_s: float | None
    ttft_p50_s: float | None  # over sent turns, a failed one +inf
    ttft_p95_s: float | None
    by_turn: tuple[TurnIndexTtft, ...]
    handoffs_per_conversation: float | None = None  # KV transfers the decoders' connectors counted / conversations
    itl_per_token: bool = False  # itl_* are per token (token_gaps); False: per streamed chunk
    chunk_gap_p50_s: float | None = None  # gaps between streamed chunks, whatever they held
    chunk_gap_p95_s: float | None = None


def level_figures(runs: Sequence[ConversationOutcome], kv_transfers: int | None = None) -> LevelFigures:
    """The figures of one policy at one load level in one repetition."""
    ttfets = [x for r in runs for x in effective_ttfets(r.effective, r.records)]
    gaps = [g for r in runs for turn in r.gaps for g in turn]
    per_token = bool(runs) and all(r.chunk_gaps is not None for r in runs)
    chunks = [g for r in runs for turn in (r.gaps if r.chunk_gaps is None else r.chunk_gaps) for g in turn]
    records = [t for r in runs for t in r.records]
    ttfts = [t.ttft_s if t.ok and t.ttft_s is not None else INF for t in records]
    return LevelFigures(
        conversations=len(runs), failed_conversations=sum(r.failed for r in runs), turns_sent=len(records),
        turns_failed=sum(not t.ok for t in records), effective_turns=len(ttfets),
        ttfet_p50_s=percentile(ttfets, 50), ttfet_p95_s=percentile(ttfets, 95),
        itl_p50_s=percentile(gaps, 50), itl_p95_s=percentile(gaps, 95),
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95), by_turn=tuple(ttft_by_turn(records)),
        handoffs_per_conversation=None if kv_transfers is None or not runs else kv_transfers / len(runs),
        itl_per_token=per_token, chunk_gap_p50_s=percentile(chunks, 50), chunk_gap_p95_s=percentile(chunks, 95))


@dataclass(frozen=True)
class Cell:
    """One policy at one load level in one repetition."""

    rep: int
    policy: str
    rate: float
    figures: LevelFigures


def over_reps(cells: Iterable[Cell]) -> dict[str, dict[float, dict[str, Spread | int]]]:
    """policy -> rate -> {figure: Spread over the repetitions (median of the per-rep values, min,
    max), "failed_conversations": the sum over them, "conversations": likewise}."""
    grouped: dict[str, dict[float, list[LevelFigures]]] = {}
    for c in cells:
        grouped.setdefault(c.policy, {}).setdefault(c.rate, []).append(c.figures)
    out: dict[str, dict[float, dict[str, Spread | int]]] = {}
    for policy, by_rate in grouped.items():
        out[policy] = {}
        for rate, figs in sorted(by_rate.items()):
            row: dict[str, Spread | int] = {name: spread(getattr(f, name) for f in figs) for name in SPREAD_FIGURES}
            row["failed_conversations"] = sum(f.failed_conversations for f in figs)
            row["conversations"] = sum(f.conversations for f in figs)
            out[policy][rate] = row
    return out


@dataclass(frozen=True)
class Headline:
    """The RESULT line: `policy` against each baseline at the load level chosen by the SLO."""

    rate: float
    slo_met: bool
    p95_ttfet_ratio_vs: dict[str, float | None]
    p95_itl_ratio_vs_colocated: float | None
    handoffs_per_conversation: float | None
    failed_conversations: int  # over every policy and repetition at that level

    def result_line(self) -> str:
        vs = " ".join(f"p95_ttfet_ratio_vs_{b}={fmt(r)}" for b, r in self.p95_ttfet_ratio_vs.items())
        return (f"RESULT {vs} p95_itl_ratio_vs_colocated={fmt(self.p95_itl_ratio_vs_colocated)} "
                f"handoffs_per_conversation={fmt(self.handoffs_per_conversation, 2)} failed_conversations={self.failed_conversations} "
                f"load={self.rate:g} slo_met={int(self.slo_met)}")


def _median(summary: dict[str, dict[float, dict[str, Spread | int]]], policy: str, rate: float, name: str) -> float | None:
    cell = summary.get(policy, {}).get(rate, {}).get(name)
    return cell.median if isinstance(cell, Spread) else None


def headline(summary: dict[str, dict[float, dict[str, Spread | int]]], rates: Sequence[float], slo_p95_ttft_s: float, *,
             policy: str = "conversation", baselines: Sequence[str] = ("per_turn_pd", "colocated", "conditional_pd"),
             slo_policy: str = "colocated") -> Headline:
    """Ratios of medians (over repetitions) of p95s, at the highest level at which `slo_policy`
    meets the TTFT SLO (slo_level)."""
    rate, met = slo_level(rates, [_median(summary, slo_policy, r, "ttft_p95_s") for r in rates], slo_p95_ttft_s)
    mine = _median(summary, policy, rate, "ttfet_p95_s")
    failed = sum(int(by[rate]["failed_conversations"]) for by in summary.values() if rate in by)
    return Headline(
        rate=rate, slo_met=met,
        p95_ttfet_ratio_vs={b: ratio(mine, _median(summary, b, rate, "ttfet_p95_s")) for b in baselines},
        p95_itl_ratio_vs_colocated=ratio(_median(summary, policy, rate, "itl_p95_s"), _median(summary, "colocated", rate, "itl_p95_s")),
        handoffs_per_conversation=_median(summary, policy, rate, "handoffs_per_conversation"),
        failed_conversations=failed)
