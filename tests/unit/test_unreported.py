"""router/unreported.py: turns routed to a replica and not yet shown by its reports."""
from __future__ import annotations

import random

import pytest

from router.report import ReplicaReport
from router.unreported import UnreportedTurns


def _report(replica: str, *served: str) -> ReplicaReport:
    return ReplicaReport(replica, "decode", conversations=tuple((s, 0.0) for s in served))


def test_a_keyed_turn_counts_until_its_conversation_is_listed() -> None:
    u = UnreportedTurns()
    u.add("d0", 100, now=1.0, session_id="a")
    u.add("d0", 50, now=1.0, session_id="b")
    u.add("d0", 10, now=1.0, session_id="a")  # a second turn of "a" before any report
    assert u.of("d0") == (3, 160)
    u.reported(_report("d0", "b", "zzz"), previous_at=0.5)
    assert u.of("d0") == (2, 110) and dict(u.totals) == {"d0": (2, 110)}
    u.reported(_report("d0", "a"), previous_at=1.5)
    assert u.of("d0") == (0, 0) and dict(u.totals) == {}
    u.check_integrity()


def test_an_unlisted_turn_goes_at_the_second_report_after_it_was_planned() -> None:
    u = UnreportedTurns()
    u.add("d0", 100, now=1.0, session_id="a")
    u.reported(_report("d0"), previous_at=0.5)  # planned after the previous report: kept
    assert u.of("d0") == (1, 100)
    u.reported(_report("d0"), previous_at=2.0)  # it had a whole report period to show up
    assert u.of("d0") == (0, 0)
    u.add("d1", 7, now=1.0, session_id="x")
    u.reported(_report("d1"), previous_at=None)  # no report before: nothing to measure the period by
    assert u.of("d1") == (0, 0)
    u.check_integrity()


def test_other_turns_count_until_the_next_report_and_replicas_are_apart() -> None:
    u = UnreportedTurns()
    u.add("p0", 300, now=1.0)  # a prefill replica's share: its reports list no conversations
    u.add("d0", 40, now=1.0)
    u.add("d0", 60, now=1.0, session_id="a")
    assert (u.of("p0"), u.of("d0")) == ((1, 300), (2, 100))
    u.reported(ReplicaReport("p0", "prefill"), previous_at=0.9)
    assert (u.of("p0"), u.of("d0")) == ((0, 0), (2, 100))
    u.reported(_report("d0"), previous_at=0.9)
    assert u.of("d0") == (1, 60)
    u.check_integrity()


def test_random_traffic_keeps_the_totals_exact() -> None:
    rng = random.Random(7)
    u = UnreportedTurns()
    last: dict[str, float] = {}
    t = 0.0
    for _ in range(3000):
        t += rng.random() * 0.05
        rid = rng.choice(("d0", "d1", "p0"))
        if rng.random() < 0.7:
            u.add(rid, rng.randrange(1, 500), t, rng.choice((None, *(f"s{i}" for i in range(12)))))
        else:
            u.reported(_report(rid, *rng.sample([f"s{i}" for i in range(12)], rng.randrange(4))), last.get(rid))
            last[rid] = t
        u.check_integrity()


def test_integrity_catches_a_drifted_total() -> None:
    u = UnreportedTurns()
    u.add("d0", 5, now=0.0, session_id="a")
    u._totals["d0"] = (2, 5)
    with pytest.raises(AssertionError, match="not its turns' sum"):
        u.check_integrity()
