"""The conversation directory's state (router/directory_state.py), with an injected clock: which
replicas are live, where each turn goes, and how pins follow failures, fallbacks and time.
Bursts, the snapshot and the invariants: test_directory_load.py. Every state a test builds is
checked with check_integrity() when it ends (directory_fixtures.make_state)."""
from __future__ import annotations

from collections import Counter

import pytest
from directory_fixtures import STALE, TTL, MakeState, live_ids, make_state, rep, up

from router.directory_state import NoReplicaAvailable
from router.policy import TurnPlan
from router.scoring import LoadWeights

__all__ = ["make_state"]  # the fixture, used by name


# ---- replicas: live, stale, failed --------------------------------------------------------------------


def test_a_report_makes_a_replica_live_in_its_pool(make_state: MakeState) -> None:
    state = make_state()
    assert state.live("decode", 0.0) == []
    up(state, 0.0, "d0", "d1", prefill=("p0",))
    assert live_ids(state, "decode", 0.0) == ["d0", "d1"]
    assert live_ids(state, "prefill", 0.0) == ["p0"]


def test_a_silent_replica_goes_stale_after_stale_after_s(make_state: MakeState) -> None:
    state = make_state()
    up(state, 100.0, "d0", prefill=())
    assert live_ids(state, "decode", 100.0 + STALE) == ["d0"]
    assert live_ids(state, "decode", 100.0 + STALE + 0.001) == []
    state.report(rep("d0", "decode"), 200.0)
    assert live_ids(state, "decode", 200.0) == ["d0"]


def test_no_live_decoder_means_no_replica_available(make_state: MakeState) -> None:
    state = make_state()
    up(state, 0.0, "d0")
    with pytest.raises(NoReplicaAvailable):
        state.route("s", None, 100, now=STALE + 1)
    assert state.pin_of("s") is None  # nothing recorded for a turn that could not be placed


def test_a_failed_replica_is_not_live_until_it_reports_again(make_state: MakeState) -> None:
    state = make_state()
    up(state, 0.0, "d0", "d1")
    state.replica_failed("d0", 0.5)
    assert live_ids(state, "decode", 1.0) == ["d1"]
    assert live_ids(state, "decode", 0.0) == ["d1"]  # the report before the failure no longer counts
    state.report(rep("d0", "decode"), 2.0)  # sent before the failure, delivered after: ignored
    assert live_ids(state, "decode", 2.0) == ["d1"]
    state.report(rep("d0", "decode"), 0.5 + STALE + 1)
    state.report(rep("d1", "decode"), 0.5 + STALE + 1)
    assert live_ids(state, "decode", 0.5 + STALE + 1) == ["d0", "d1"]


# ---- conversation policy --------------------------------------------------------------------------------


def test_two_ingress_replicas_asking_for_one_new_conversation_get_one_decoder_and_one_handoff(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1")
    first = state.route("s", "u", 800, now=1.0)
    second = state.route("s", "u", 800, now=1.0)  # the other ingress replica, same instant
    assert first == TurnPlan(first.decode_replica, remote_prefill=True, reason="new")
    assert second == TurnPlan(first.decode_replica, remote_prefill=False, reason="pinned")
    pin = state.pin_of("s")
    assert pin is not None and (pin.decoder, pin.user, pin.turns, pin.handoffs) == (first.decode_replica, "u", 2, 1)
    assert state.totals["planned_handoffs"] == 1 and state.totals["conversations"] == 1
    state.check_integrity()


def test_a_conversation_keeps_its_decoder_while_it_is_live(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1")
    assert state.route("s", None, 500, now=0.0).decode_replica == "d0"
    for t in range(1, 6):
        # d0 fills up; the conversation's KV is there, so it stays
        state.report(rep("d0", "decode", kv=0.95, in_flight=20), float(t))
        state.report(rep("d1", "decode"), float(t))
        state.report(rep("p0", "prefill"), float(t))
        assert state.route("s", None, 500 + 100 * t, now=float(t)) == TurnPlan("d0", remote_prefill=False, reason="pinned")
    pin = state.pin_of("s")
    assert pin is not None and pin.turns == 6 and pin.handoffs == 1 and pin.last_seen == 5.0 and pin.created == 0.0


def test_without_a_live_prefill_replica_the_first_turn_is_prefilled_on_the_decoder(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", prefill=())
    assert state.route("s", None, 100, now=0.0) == TurnPlan("d0", remote_prefill=False, reason="new")
    state.report(rep("p0", "prefill"), 0.0)
    up(state, 20.0, "d0", prefill=())  # the prefill replica went silent: stale at t=20
    assert state.route("t", None, 100, now=20.0) == TurnPlan("d0", remote_prefill=False, reason="new")
    up(state, 21.0, "d0", prefill=("p0",))
    assert state.route("u", None, 100, now=21.0) == TurnPlan("d0", remote_prefill=True, reason="new")
    state.replica_failed("p0", 21.0)
    assert state.route("v", None, 100, now=21.0) == TurnPlan("d0", remote_prefill=False, reason="new")
    assert state.totals["planned_handoffs"] == 1
    s = state.pin_of("s")
    assert s is not None and s.handoffs == 0  # a conversation whose first turn ran locally keeps its decoder
    assert state.route("s", None, 100, now=21.0) == TurnPlan("d0", remote_prefill=False, reason="pinned")


def test_replica_failure_repins_the_next_turn_to_another_decoder_with_a_remote_prefill(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1")
    sessions = ["s0", "s1", "s2", "s3"]
    placed = {s: state.route(s, None, 1000, now=0.0).decode_replica for s in sessions}
    on_d0 = [s for s in sessions if placed[s] == "d0"]
    assert on_d0 and len(on_d0) < len(sessions)
    assert state.replica_failed("d0", 0.0) == len(on_d0)
    state.check_integrity()
    for s in sessions:
        expected = TurnPlan("d1", remote_prefill=True, reason="repinned") if s in on_d0 else TurnPlan("d1", remote_prefill=False, reason="pinned")
        assert state.route(s, None, 1500, now=1.0) == expected
        pin = state.pin_of(s)
        assert pin is not None and pin.decoder == "d1" and pin.handoffs == (2 if s in on_d0 else 1)
    assert state.pinned_counts() == Counter({"d1": 4})
    assert state.totals["replica_failures"] == 1 and state.totals["plan_repinned"] == len(on_d0)


def test_served_moves_the_pin_to_the_replica_that_actually_ran_the_turn(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1")
    assert state.route("s", None, 100, now=0.0).decode_replica == "d0"
    state.served("s", "d0", now=1.0)  # as planned: nothing moves
    assert state.totals["pin_moved_by_fallback"] == 0
    state.served("s", "d1", now=2.0)  # the router fell back to d1
    pin = state.pin_of("s")
    assert pin is not None and pin.decoder == "d1" and pin.last_seen == 2.0
    assert state.totals["pin_moved_by_fallback"] == 1
    assert state.pinned_counts() == Counter({"d1": 1})
    assert state.route("s", None, 100, now=3.0) == TurnPlan("d1", remote_prefill=False, reason="pinned")
    state.served("unknown", "d0", now=4.0)
    state.served(None, "d0", now=4.0)
    assert state.pin_of("unknown") is None and state.totals["pin_moved_by_fallback"] == 1


def test_turns_without_a_session_are_placed_but_never_pinned(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0")
    assert state.route(None, None, 100, now=0.0) == TurnPlan("d0", remote_prefill=True, reason="new")
    assert state.route(None, None, 100, now=0.0) == TurnPlan("d0", remote_prefill=True, reason="new")
    assert state.snapshot(0.0)["live_pins"] == 0 and state.totals["conversations"] == 0 and state.totals["turns"] == 2


# ---- other policies --------------------------------------------------------------------------------------


def test_per_turn_pd_plans_one_handoff_per_turn(make_state: MakeState) -> None:
    state = make_state("per_turn_pd")
    up(state, 0.0, "d0", "d1")
    plans = [state.route("s", None, 400, now=float(t)) for t in range(3)]
    assert all(p.remote_prefill and p.reason == "per_turn" for p in plans)
    pin = state.pin_of("s")
    assert pin is not None and pin.turns == 3 and pin.handoffs == 3 and pin.decoder == plans[-1].decode_replica
    snap = state.snapshot(3.0)
    assert snap["handoffs_planned_total"] == 3 and snap["handoffs_per_live_conversation"] == 3.0


def test_per_turn_pd_does_not_count_the_last_decoder_as_pinned_load(make_state: MakeState) -> None:
    # d0 has served many conversations' last turns; under per_turn_pd that is no commitment
    state = make_state("per_turn_pd", weights=LoadWeights(pin_weight=1.0, queue_weight=0.0))
    up(state, 0.0, "d0", "d1")
    state.report(rep("d1", "decode", kv=0.05), 0.0)
    for i in range(5):
        state.route(f"s{i}", None, 0, now=0.0)
    up(state, 1.0, "d0")
    state.report(rep("d1", "decode", kv=0.05), 1.0)  # reports clear the projection of turns routed
    assert state.pinned_counts()["d0"] == 5
    assert state.route("new", None, 0, now=1.0).decode_replica == "d0"


def test_colocated_pins_without_remote_prefill_even_with_a_prefill_replica_up(make_state: MakeState) -> None:
    state = make_state("colocated")
    up(state, 0.0, "d0", "d1", prefill=("p0",))
    first = state.route("s", None, 300, now=0.0)
    assert first == TurnPlan("d0", remote_prefill=False, reason="new")
    assert state.route("s", None, 300, now=1.0) == TurnPlan("d0", remote_prefill=False, reason="pinned")
    state.replica_failed("d0", 1.0)
    assert state.route("s", None, 300, now=2.0) == TurnPlan("d1", remote_prefill=False, reason="repinned")
    assert state.totals["planned_handoffs"] == 0 and state.snapshot(2.0)["handoffs_per_live_conversation"] == 0.0


def test_round_robin_rotates_over_live_decoders_whatever_the_session(make_state: MakeState) -> None:
    state = make_state("round_robin")
    up(state, 0.0, "d1", "d0", "d2", prefill=())
    got = [state.route("s", None, 10, now=0.0) for _ in range(6)]
    assert [p.decode_replica for p in got] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert not any(p.remote_prefill for p in got) and {p.reason for p in got} == {"round_robin"}


def test_a_plan_says_when_every_live_decoder_has_requests_waiting(make_state: MakeState) -> None:
    state = make_state("colocated")
    up(state, 0.0, "d0", "d1", prefill=(), num_waiting=2)
    assert state.route(None, None, 100, now=0.0).pool_queueing
    state.report(rep("d1", "decode", num_waiting=0), 1.0)  # one decoder with room is enough: no hint
    assert not state.route(None, None, 100, now=1.0).pool_queueing
    assert state.route(None, None, 100, now=1.0) == TurnPlan("d0", remote_prefill=False, reason="new")  # not part of equality


# ---- lifetime of conversations ------------------------------------------------------------------------------


def test_expire_drops_only_conversations_idle_longer_than_the_ttl(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0")
    state.route("idle", None, 10, now=0.0)
    state.route("active", None, 10, now=0.0)
    up(state, 1000.0, "d0")
    state.route("active", None, 10, now=1000.0)
    assert state.expire(TTL) == []  # exactly the TTL: not yet
    assert state.expire(TTL + 1.0) == ["idle"]
    assert state.pin_of("idle") is None and state.pin_of("active") is not None
    assert state.expire(TTL + 1.0) == []
    assert state.totals["expired"] == 1
    # an expired conversation that comes back is a new one
    up(state, TTL + 2.0, "d0")
    assert state.route("idle", None, 10, now=TTL + 2.0).reason == "new"


def test_served_keeps_a_conversation_from_expiring(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0")
    state.route("s", None, 10, now=0.0)
    state.served("s", "d0", now=TTL)  # a long turn that finished at TTL
    assert state.expire(TTL + 1.0) == []


def test_max_conversations_evicts_the_least_recently_seen(make_state: MakeState) -> None:
    state = make_state("conversation", max_conversations=2)
    up(state, 0.0, "d0")
    state.route("s1", None, 10, now=1.0)
    state.route("s2", None, 10, now=2.0)
    state.route("s1", None, 10, now=3.0)  # s1 seen again; s2 is now the oldest
    state.route("s3", None, 10, now=4.0)
    assert state.pin_of("s2") is None and state.pin_of("s1") is not None and state.pin_of("s3") is not None
    assert state.totals["evicted"] == 1 and state.snapshot(4.0)["live_pins"] == 2
    state.check_integrity()


def test_end_conversation_drops_the_pin_once(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0")
    state.route("s", None, 10, now=0.0)
    assert state.end_conversation("s") is True
    assert state.end_conversation("s") is False
    assert state.pin_of("s") is None and state.pinned_counts() == Counter()


def test_pin_of_returns_a_copy(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1")
    state.route("s", None, 10, now=0.0)
    pin = state.pin_of("s")
    assert pin is not None
    pin.decoder = "d1"
    assert state.pin_of("s").decoder == "d0"  # type: ignore[union-attr]
