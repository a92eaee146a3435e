"""Client-visible truth of tick sessions (baton/bench/collapse.py): classification, runs of
misses, collapse, and the naive server counter that misses the collapse. Pure; milliseconds."""
from __future__ import annotations

import pytest

from baton.bench.collapse import (
    SessionLedger,
    TickOutcome,
    classify,
    collapsed_sessions,
    is_miss,
    summarize,
)

PERIOD = 0.5  # tick period = deadline budget


def tick(seq: int, latency: float | None, text_len: int = 5, server_s: float | None = 0.05,
         server_error: bool = False) -> TickOutcome:
    sent = seq * PERIOD
    return TickOutcome(seq, sent, sent + PERIOD, None if latency is None else sent + latency, text_len,
                       server_s, server_error)


def ledger(sid: str, outcomes: list[TickOutcome]) -> SessionLedger:
    led = SessionLedger(sid)
    for o in outcomes:
        led.record(o)
    led.check_integrity()
    return led


def test_classify_each_case() -> None:
    assert classify(tick(0, 0.1)) == "on_time"
    assert classify(tick(0, PERIOD)) == "on_time"  # exactly at the deadline
    assert classify(tick(0, 0.6)) == "late"
    assert classify(tick(0, 0.6, text_len=0)) == "late"  # lateness wins over emptiness
    assert classify(tick(0, 0.1, text_len=0)) == "empty"
    assert classify(tick(0, None)) == "missing"
    assert not is_miss(tick(0, 0.1)) and all(is_miss(tick(0, x)) for x in (0.6, None))


def test_runs_collapse_and_onset() -> None:
    # seq: 0 ok, 1 late, 2 ok, 3 late, 4 empty, 5 missing, 6 missing, 7 ok
    led = ledger("s", [tick(0, 0.1), tick(1, 0.7), tick(2, 0.1), tick(3, 0.9), tick(4, 0.1, text_len=0),
                       tick(5, None), tick(6, None), tick(7, 0.2)])
    assert led.misses() == 5 and led.longest_miss_run() == 4
    assert led.collapsed() and led.collapsed(consecutive=4) and not led.collapsed(consecutive=5)
    assert led.collapse_onset() == pytest.approx(3 * PERIOD + PERIOD)  # deadline of seq 3
    assert led.collapse_onset(consecutive=5) is None
    t = led.truth()
    assert (t.ticks, t.on_time, t.late, t.empty, t.missing, t.misses) == (8, 3, 2, 1, 2, 5)
    assert t.collapsed and t.longest_miss_run == 4


def test_scattered_misses_do_not_collapse() -> None:
    led = ledger("s", [tick(i, 0.9 if i % 2 else 0.1) for i in range(40)])
    assert led.misses() == 20 and led.longest_miss_run() == 1 and not led.collapsed()


def test_run_at_the_end_counts_and_record_order_does_not_matter() -> None:
    outcomes = [tick(i, 0.1) for i in range(5)] + [tick(i, None) for i in range(5, 8)]
    led = ledger("s", list(reversed(outcomes)))
    assert led.longest_miss_run() == 3 and led.collapsed()


def test_p99_latency_of_replied_ticks_only() -> None:
    led = ledger("s", [tick(i, 0.01 * (i + 1)) for i in range(100)] + [tick(100, None)])
    assert led.p99_latency_s() == pytest.approx(0.99)
    assert SessionLedger("empty").p99_latency_s() is None


def test_naive_view_misses_a_silent_collapse() -> None:
    """An unbounded session at the KV wall: the server keeps answering quickly once it gets to a
    tick (server_s small), but ticks queue before it, replies arrive late or never: the naive
    counter says 0 errors and 0 deadline misses while the client saw a collapse."""
    outcomes = [tick(i, 0.1) for i in range(10)]
    outcomes += [tick(i, 0.8 + 0.1 * i, server_s=0.08) for i in range(10, 20)]  # queued: late
    outcomes += [tick(i, None, server_s=None) for i in range(20, 25)]  # never served
    led = ledger("u", outcomes)
    naive, truth = led.naive_view(), led.truth()
    assert (naive.ticks_served, naive.errors, naive.deadline_misses) == (20, 0, 0)
    assert truth.misses == 15 and truth.collapsed and truth.collapse_onset == pytest.approx(10 * PERIOD + PERIOD)


def test_naive_view_counts_what_the_server_noticed() -> None:
    led = ledger("s", [tick(0, 0.7, server_s=0.6), tick(1, 0.1, text_len=0, server_s=None, server_error=True),
                       tick(2, 0.1)])
    n = led.naive_view()
    assert (n.ticks_served, n.errors, n.deadline_misses) == (2, 1, 1)


def test_collapsed_sessions_and_summary() -> None:
    good = ledger("a", [tick(i, 0.1) for i in range(10)])
    bad = ledger("b", [tick(i, 0.1 if i < 4 else None, server_s=0.05 if i < 4 else None) for i in range(10)])
    late = ledger("c", [tick(i, 0.1 if i != 5 else 0.9) for i in range(10)])
    assert collapsed_sessions([good, bad, late]) == 1
    assert collapsed_sessions([good, bad, late], consecutive=1) == 2
    s = summarize([good, bad, late])
    assert (s.sessions, s.collapsed, s.ticks, s.true_misses, s.naive_errors, s.naive_deadline_misses) == (3, 1, 30, 7, 0, 0)
    assert s.earliest_collapse_onset == pytest.approx(4 * PERIOD + PERIOD)


def test_integrity_and_validation() -> None:
    led = SessionLedger("s")
    led.record(tick(0, 0.1))
    with pytest.raises(ValueError):
        led.record(tick(0, 0.2))
    with pytest.raises(ValueError):
        led.record(TickOutcome(1, 1.0, 0.5, None, 0))
    led.record(tick(2, 0.1))  # seq 1 never recorded
    with pytest.raises(AssertionError, match="contiguous"):
        led.check_integrity()
    with pytest.raises(ValueError):
        led.truth(consecutive=0)
