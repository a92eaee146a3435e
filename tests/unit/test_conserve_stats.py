"""The ConServe bench's figures (baton/bench/conserve_stats.py): TTFET of every effective turn,
percentiles that count failures as +inf, chunk gaps, TTFT by turn, the SLO level, the spread
over repetitions, the headline. Pure; numbers worked by hand."""
from __future__ import annotations

import math

import pytest

from baton.bench.conserve_stats import (
    INF,
    Cell,
    ConversationOutcome,
    Spread,
    chunk_gaps,
    effective_ttfets,
    headline,
    level_figures,
    over_reps,
    percentile,
    ratio,
    slo_level,
    spread,
    ttft_by_turn,
)
from baton.traces.records import TurnRecord


def rec(index: int, send: float, ttft: float | None, error: str | None = None, effective: bool = False) -> TurnRecord:
    return TurnRecord(conversation_id="c", turn_index=index, role="user", effective=effective, send_time_s=send, ttft_s=ttft,
                      e2e_s=(ttft or 0) + 1, prompt_tokens=10, completion_tokens=2, cached_tokens=0, status=200 if error is None else 500,
                      error=error)


# ---- percentile ---------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def test_a_failure_reached_by_the_rank_makes_the_percentile_infinite() -> None:
    xs = [1.0] * 19 + [INF]
    assert percentile(xs, 95) == INF  # rank 18.05 reaches the failure
    assert percentile(xs, 50) == 1.0  # the median is untouched
    assert percentile([1.0, 2.0, INF], 50) == 2.0  # rank exactly on a finite sample: no nan
    assert percentile([1.0, INF, INF], 50) == INF
    assert percentile([1.0] * 99 + [INF], 95) == 1.0  # 1 % failures: p95 is finite
    assert not math.isnan(percentile([INF, INF], 50) or 0.0)


# ---- effective turns ---------------------------------------------------------------------------------------


def test_every_effective_turn_has_a_ttfet_from_its_chains_first_request() -> None:
    # user (tool call) -> tool (effective) -> user (tool call) -> tool (effective)
    records = [rec(0, 0.0, 0.5), rec(1, 1.0, 0.4), rec(2, 3.0, 0.2), rec(3, 4.5, 0.3)]
    assert effective_ttfets([False, True, False, True], records) == pytest.approx([1.4, 1.8])


def test_a_single_effective_user_turn_is_its_own_chain() -> None:
    records = [rec(0, 0.0, 0.5), rec(1, 2.0, 0.25)]
    assert effective_ttfets([True, True], records) == pytest.approx([0.5, 0.25])
    assert effective_ttfets([False, False], records) == []  # no effective turn: no sample


def test_a_failure_makes_its_chain_and_every_later_effective_turn_infinite() -> None:
    failed_tool_call = [rec(0, 0.0, None, error="HTTP 503")]  # the replay stopped there
    assert effective_ttfets([False, True, False, True], failed_tool_call) == [INF, INF]
    failed_later = [rec(0, 0.0, 0.5), rec(1, 1.0, 0.4), rec(2, 3.0, None, error="timeout")]
    assert effective_ttfets([False, True, False, True], failed_later) == [pytest.approx(1.4), INF]
    no_token = [rec(0, 0.0, 0.5), rec(1, 1.0, None)]  # finished without a token
    assert effective_ttfets([False, True], no_token) == [INF]


def test_chunk_gaps() -> None:
    assert chunk_gaps([1.0, 1.25, 1.75]) == [0.25, 0.5]
    assert chunk_gaps([1.0]) == [] and chunk_gaps([]) == []


def test_ttft_by_turn_counts_failed_turns_as_infinite() -> None:
    rows = ttft_by_turn([rec(0, 0, 0.5), rec(0, 0, 1.5), rec(1, 0, 0.2), rec(1, 0, None, error="x")])
    assert [(r.turn_index, r.sent, r.failed) for r in rows] == [(0, 2, 0), (1, 2, 1)]
    assert rows[0].ttft_p50_s == 1.0 and rows[1].ttft_p95_s == INF and rows[1].ttft_p50_s == INF


# ---- one level ---------------------------------------------------------------------------------------


def test_level_figures_report_failed_conversations_and_keep_their_samples() -> None:
    ok = ConversationOutcome((False, True), (rec(0, 0.0, 0.5), rec(1, 1.0, 0.5)), ((0.1, 0.1), (0.2,)))
    failed = ConversationOutcome((False, True), (rec(0, 0.0, None, error="HTTP 500"),), ((),))
    unsent = ConversationOutcome((False, True), (rec(0, 0.0, 0.5),), ((0.3,),))  # stopped early without an error record
    f = level_figures([ok, failed, unsent], kv_transfers=3)
    assert (f.conversations, f.failed_conversations, f.turns_sent, f.turns_failed, f.effective_turns) == (3, 2, 4, 1, 3)
    assert f.ttfet_p50_s == INF and f.ttfet_p95_s == INF  # 2 of 3 effective turns failed
    assert f.itl_p50_s == pytest.approx(0.15) and f.handoffs_per_conversation == 1.0
    alone = level_figures([ok])
    assert alone.ttfet_p95_s == pytest.approx(1.5) and alone.failed_conversations == 0 and alone.handoffs_per_conversation is None


# ---- over repetitions, the SLO level, the headline ---------------------------------------------------------


def test_spread_is_the_median_with_the_range() -> None:
    assert spread([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0, 3)
    assert spread([1.0, INF, 2.0]) == Spread(2.0, 1.0, INF, 3)  # one failed rep does not hide
    assert spread([None, 4.0]) == Spread(4.0, 4.0, 4.0, 1)
    assert spread([]) == Spread(None, None, None, 0)
    assert Spread(1.0, 0.5, INF, 3).as_json() == {"median": 1.0, "min": 0.5, "max": "inf", "n": 3}


def test_ratio() -> None:
    assert ratio(1.0, 2.0) == 0.5
    assert ratio(INF, 2.0) == INF and ratio(1.0, INF) == 0.0
    assert ratio(INF, INF) is None and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_slo_level_is_the_highest_level_that_meets_it() -> None:
    assert slo_level([0.1, 0.5, 1.0, 2.0], [0.5, 1.0, 2.9, 6.0], 3.0) == (1.0, True)
    assert slo_level([0.1, 0.5], [0.5, None], 3.0) == (0.1, True)  # no figure: not met
    assert slo_level([0.5, 0.1], [4.0, 5.0], 3.0) == (0.1, False)  # none: the lowest, flagged
    assert slo_level([0.1, 0.5, 1.0], [1.0, 4.0, 2.0], 3.0) == (1.0, True)  # the highest meeting, not the first failing
    with pytest.raises(ValueError):
        slo_level([0.1], [], 3.0)


def cell(rep: int, policy: str, rate: float, p95: float, itl_p95: float = 0.05, failed: bool = False) -> Cell:
    """A cell of one conversation with one effective turn: its TTFET = its TTFT = `p95` (every percentile)."""
    if failed:
        return Cell(rep, policy, rate, level_figures([ConversationOutcome((True,), (rec(0, 0, None, error="x"),), ((),))], 0))
    figs = level_figures([ConversationOutcome((True,), (rec(0, 0.0, p95),), ((itl_p95,),))], kv_transfers=1)
    assert figs.ttfet_p95_s == figs.ttft_p95_s == p95
    return Cell(rep, policy, rate, figs)


def test_headline_is_read_where_colocated_meets_the_slo_from_medians_over_reps() -> None:
    cells = []
    for rep, jitter in enumerate((0.0, 0.2, -0.1)):
        for rate, base in ((0.5, 1.0), (1.0, 2.0), (2.0, 8.0)):
            cells.append(cell(rep, "colocated", rate, base + jitter, itl_p95=0.1))
            cells.append(cell(rep, "conversation", rate, base / 2 + jitter, itl_p95=0.05))
            cells.append(cell(rep, "per_turn_pd", rate, base * 2 + jitter))
            cells.append(cell(rep, "conditional_pd", rate, base + jitter))
    summary = over_reps(cells)
    row = summary["colocated"][1.0]
    assert row["ttfet_p95_s"] == Spread(2.0, 1.9, 2.2, 3) and row["failed_conversations"] == 0 and row["conversations"] == 3
    h = headline(summary, [0.5, 1.0, 2.0], slo_p95_ttft_s=3.0)
    assert (h.rate, h.slo_met) == (1.0, True)  # colocated's median p95 TTFT 2.0 <= 3 at 1.0/s, 8.0 at 2.0/s
    assert h.p95_ttfet_ratio_vs == {"per_turn_pd": pytest.approx(1.0 / 4.0), "colocated": pytest.approx(0.5),
                                    "conditional_pd": pytest.approx(0.5)}
    assert h.p95_itl_ratio_vs_colocated == pytest.approx(0.5) and h.handoffs_per_conversation == 1.0
    line = h.result_line()
    assert line.startswith("RESULT p95_ttfet_ratio_vs_per_turn_pd=0.250 p95_ttfet_ratio_vs_colocated=0.500 p95_ttfet_ratio_vs_conditional_pd=0.500 ")
    assert line.endswith("p95_itl_ratio_vs_colocated=0.500 handoffs_per_conversation=1.00 failed_conversations=0 load=1 slo_met=1")


def test_a_failed_repetition_shows_in_the_headline() -> None:
    cells = [cell(0, "colocated", 1.0, 1.0), cell(0, "conversation", 1.0, 0.0, failed=True),
             cell(1, "colocated", 1.0, 1.0), cell(1, "conversation", 1.0, 0.5),
             cell(2, "colocated", 1.0, 1.0), cell(2, "conversation", 1.0, 0.5)]
    summary = over_reps(cells)
    assert summary["conversation"][1.0]["ttfet_p95_s"] == Spread(0.5, 0.5, INF, 3)  # median over reps, the failure is the max
    h = headline(summary, [1.0], 3.0, baselines=("colocated",))
    assert h.failed_conversations == 1 and h.p95_ttfet_ratio_vs == {"colocated": 0.5}
    assert "failed_conversations=1" in h.result_line()


def test_no_level_meeting_the_slo_is_flagged() -> None:
    cells = [cell(0, "colocated", r, 9.0) for r in (0.5, 1.0)] + [cell(0, "conversation", r, 3.0) for r in (0.5, 1.0)]
    h = headline(over_reps(cells), [0.5, 1.0], 3.0, baselines=("colocated",))
    assert (h.rate, h.slo_met) == (0.5, False) and h.result_line().endswith("load=0.5 slo_met=0")


def test_token_gaps_spread_each_chunk_gap_over_its_tokens() -> None:
    from baton.bench.conserve_stats import token_gaps

    # chunks at 0, 0.3, 0.5, 0.5 with 2, 3, 0, 2 tokens: the first chunk's tokens are the TTFT's,
    # the empty chunk is skipped, so 3 x 0.1 then 2 x 0.1 (0.5 - 0.3 over 2)
    assert token_gaps([0.0, 0.3, 0.5, 0.5], [2, 3, 0, 2]) == pytest.approx([0.1] * 5)
    assert token_gaps([0.0, 0.3], None) is None
    assert token_gaps([0.0, 0.3], [1]) is None  # counts that do not match the chunks
    assert token_gaps([0.0, 0.3], [1, -1]) is None
    assert token_gaps([], []) == [] and token_gaps([1.0], [4]) == []
