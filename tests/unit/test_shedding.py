"""Shedding live real-time sessions (overload: shed): the pure choice (router/shedding.py) and the
ingress's slot registry (deployments/realtime_sessions.py). No engine; milliseconds."""
from __future__ import annotations

import random

import pytest

from deployments.realtime_sessions import SessionRegistry, ShedNotice
from router.shedding import SHED_CODE, LiveSession, ShedPlan, choose_shed


def sessions(*admitted: tuple[str, float]) -> list[LiveSession]:
    return [LiveSession(sid, at) for sid, at in admitted]


# ---- the choice ------------------------------------------------------------------------------------


def test_sheds_the_newest_first_and_exactly_the_excess() -> None:
    live = sessions(("a", 1.0), ("b", 5.0), ("c", 3.0), ("d", 4.0), ("e", 2.0))
    plan = choose_shed(live, cap=2)
    assert plan.shed == ("b", "d", "c") and plan.count == 3 and (plan.cap, plan.live) == (2, 5)
    assert choose_shed(live, cap=4).shed == ("b",)
    assert choose_shed(live, cap=0).shed == ("b", "d", "c", "e", "a")


@pytest.mark.parametrize("cap", [5, 6, 100])
def test_sheds_nothing_when_live_is_within_the_cap(cap: int) -> None:
    plan = choose_shed(sessions(("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0), ("e", 5.0)), cap)
    assert plan.shed == () and plan.count == 0
    assert choose_shed([], cap).count == 0


def test_ties_in_admission_time_go_by_session_id_whatever_the_order_given() -> None:
    live = sessions(("s1", 7.0), ("s3", 7.0), ("s2", 7.0), ("old", 1.0))
    expected = ("s3", "s2")
    for seed in range(5):
        shuffled = live[:]
        random.Random(seed).shuffle(shuffled)
        assert choose_shed(shuffled, cap=2).shed == expected
    assert choose_shed(live, cap=1).shed == ("s3", "s2", "s1")  # the oldest is kept


def test_every_shed_session_is_newer_than_every_kept_one() -> None:
    rng = random.Random(0)
    for _ in range(50):
        live = [LiveSession(f"s{i}", float(rng.randint(0, 9))) for i in range(rng.randint(0, 12))]
        cap = rng.randint(0, 12)
        plan = choose_shed(live, cap)
        assert plan.count == max(0, len(live) - cap)
        shed = {s.session_id for s in live if s.session_id in plan.shed}
        kept = [s for s in live if s.session_id not in shed]
        by_id = {s.session_id: s for s in live}
        keys = [(by_id[sid].admitted_at, sid) for sid in plan.shed]
        assert keys == sorted(keys, reverse=True)  # newest first
        if keys:
            assert all(min(keys) > (k.admitted_at, k.session_id) for k in kept)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        choose_shed(sessions(("a", 1.0), ("a", 2.0)), cap=1)
    with pytest.raises(ValueError):
        choose_shed([], cap=-1)
    with pytest.raises(AssertionError):
        ShedPlan(cap=1, live=3, shed=("a",))  # not the excess
    with pytest.raises(AssertionError):
        ShedPlan(cap=1, live=3, shed=("a", "a"))


# ---- the registry of slots ------------------------------------------------------------------------------


def test_a_shed_session_frees_its_slot_once_and_is_told_why() -> None:
    reg = SessionRegistry()
    for i, sid in enumerate(("a", "b", "c")):
        reg.admit(sid, float(i))
    assert reg.live == 3
    plan = choose_shed(reg.holding(), cap=2)
    (entry,) = reg.shed(plan, ShedNotice(cap=2, live_sessions=3, retry_after_s=4.0))
    reg.check_integrity()
    assert entry.session_id == "c" and entry.stop.is_set() and not entry.holds_slot
    assert reg.live == 2 and reg.shed_total == 1
    assert [s.session_id for s in reg.holding()] == ["a", "b"]
    frame = entry.notice.frame() if entry.notice else {}
    assert frame["type"] == "error" and frame["code"] == SHED_CODE == "shed_overload"
    assert (frame["cap"], frame["live_sessions"], frame["retry_after_s"]) == (2, 3, 4.0) and "retry after 4 s" in frame["message"]
    # the shed session's ending frees nothing more; an ordinary ending frees its slot
    assert reg.release("c") is False and reg.live == 2
    assert reg.release("a") is True and reg.live == 1
    # a plan made before a session ended does not count it
    assert reg.shed(ShedPlan(cap=0, live=2, shed=("b", "a")), ShedNotice(0, 2, 1.0))[0].session_id == "b"
    assert reg.live == 0 and reg.shed_total == 2
    reg.check_integrity()
    with pytest.raises(ValueError):
        reg.admit("b", 9.0)  # still registered until it ends
    with pytest.raises(KeyError):
        reg.release("a")  # ended already
