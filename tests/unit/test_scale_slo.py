"""baton/sim/slo.py: goodput under TTFT/TPOT SLOs counts failures; TTFET of effective turns."""
import math

from baton.sim.slo import TPOT_SLO_S, TTFT_SLO_S, ConversationRun, conversation_good, run_figures, tpot_s
from baton.traces.records import TurnRecord


def rec(k, sent, ttft, e2e, tokens, effective=True, error=None):
    return TurnRecord("c", k, "user", effective, sent, ttft, e2e, None, tokens, 0, 200, error=error)


def test_tpot_is_the_mean_gap_after_the_first_token():
    assert tpot_s(rec(0, 0.0, 0.5, 1.5, 11)) == 0.1
    assert tpot_s(rec(0, 0.0, 0.5, 0.5, 1)) == 0.0


def test_a_conversation_is_good_only_when_every_turn_meets_its_slo():
    fast = rec(0, 0.0, TTFT_SLO_S / 2, TTFT_SLO_S / 2 + 9 * TPOT_SLO_S / 2, 10)
    slow_first = rec(0, 0.0, TTFT_SLO_S * 2, TTFT_SLO_S * 2 + 0.1, 2)
    assert conversation_good(ConversationRun("a", (True,), (None,), (fast,)))
    assert not conversation_good(ConversationRun("b", (True,), (None,), (slow_first,)))
    tick = rec(0, 0.0, 0.1, 0.6, 8)
    assert not conversation_good(ConversationRun("r", (True,), (0.5,), (tick,)))  # past the tick deadline
    assert conversation_good(ConversationRun("r", (True,), (1.0,), (tick,)))


def test_failed_unfinished_and_rejected_conversations_stay_in_the_denominator():
    ok = ConversationRun("a", (False, True), (None, None), (rec(0, 0.0, 0.1, 0.2, 2, False), rec(1, 1.0, 0.1, 0.2, 2)))
    unfinished = ConversationRun("b", (False, True), (None, None), (rec(0, 0.0, 0.1, 0.2, 2, False),))
    failed = ConversationRun("c", (True,), (None,), (rec(0, 0.0, None, 0.0, None, error="prompt too long"),))
    rejected = ConversationRun("d", (True,), (0.5,), (), rejected=True)
    figs = run_figures([ok, unfinished, failed, rejected])
    assert (figs.conversations, figs.completed, figs.good) == (4, 1, 1)
    assert figs.goodput_fraction == 0.25
    assert figs.effective_turns == 4  # one each; three of them +inf
    assert math.isinf(figs.ttfet_p95_s) and math.isinf(figs.ttfet_p50_s)
    assert run_figures([ok]).ttfet_p95_s == 1.1  # from the tool call's send (0) to the answer's first token (1.0 + 0.1)
