"""The conversation directory's state (router/directory_state.py) under load: the projection of
turns routed since a replica's last report, the snapshot it shows, and its invariants under
random traffic. Every state a test builds is checked with check_integrity() when it ends."""
from __future__ import annotations

import random
from collections import Counter

import pytest
from directory_fixtures import STALE, MakeState, live_ids, make_state, rep, up

from router.directory_state import NoReplicaAvailable
from router.policy import TurnPlan
from router.scoring import LoadWeights

__all__ = ["make_state"]  # the fixture, used by name


# ---- bursts: the projection of turns routed since the last report -------------------------------------


@pytest.mark.parametrize("policy", ["conversation", "colocated", "per_turn_pd", "conditional_pd"])
def test_a_burst_of_new_conversations_spreads_over_equally_loaded_decoders(make_state: MakeState, policy: str) -> None:
    # no pin penalty: only the projection of unreported turns tells the decoders apart
    state = make_state(policy, weights=LoadWeights(pin_weight=0.0, queue_weight=0.05))
    up(state, 0.0, "d0", "d1", kv=0.2)
    got = Counter(state.route(f"s{i}", None, 1000, now=0.0).decode_replica for i in range(4))
    assert got == Counter({"d0": 2, "d1": 2})


def test_the_projection_alone_spreads_a_burst(make_state: MakeState) -> None:
    """Only the projected KV (prompt / capacity) of unreported turns differs between decoders."""
    state = make_state("conversation", weights=LoadWeights(pin_weight=0.0, queue_weight=0.0))
    up(state, 0.0, "d0", "d1")
    assert Counter(state.route(f"s{i}", None, 1000, now=0.0).decode_replica for i in range(4)) == Counter({"d0": 2, "d1": 2})
    # with unknown capacities (and no queue or pin weight) nothing distinguishes them: all go to d0
    blind = make_state("conversation", weights=LoadWeights(pin_weight=0.0, queue_weight=0.0))
    up(blind, 0.0, "d0", "d1", cap=0)
    assert Counter(blind.route(f"s{i}", None, 1000, now=0.0).decode_replica for i in range(4)) == Counter({"d0": 4})


def test_a_report_replaces_the_projection(make_state: MakeState) -> None:
    state = make_state("conversation", weights=LoadWeights(pin_weight=0.0, queue_weight=0.05))
    up(state, 0.0, "d0", "d1")
    assert state.route("s0", None, 5000, now=0.0).decode_replica == "d0"
    assert state.route("s1", None, 100, now=0.0).decode_replica == "d1"  # d0 projected at 0.5
    # d0 reports: the 5k-token turn arrived (its conversation listed), finished and its KV was evicted; d1 is still busy
    state.report(rep("d0", "decode", kv=0.0, conversations=(("s0", 0.5),)), 1.0)
    state.report(rep("d1", "decode", kv=0.3, in_flight=1, conversations=(("s1", 0.5),)), 1.0)
    assert state.route("s2", None, 100, now=1.0).decode_replica == "d0"


def test_a_report_made_before_a_turn_arrived_keeps_its_projection(make_state: MakeState) -> None:
    """A report that does not list a routed turn's conversation was made before the turn reached its
    replica (router/unreported.py): the turn still counts, so a burst split by reports still spreads."""
    state = make_state("colocated", weights=LoadWeights(pin_weight=0.0, queue_weight=0.05))
    up(state, 0.0, "d0", "d1")
    placed = []
    for i in range(8):
        placed.append(state.route(f"s{i}", None, 1000, now=0.5).decode_replica)
        if i == 3:  # d1 reports mid-burst, before any of the turns arrived (a report wiping them made d1 look idle: 3 vs 5)
            up(state, 0.6, "d1", prefill=())
    assert Counter(placed) == Counter({"d0": 4, "d1": 4})
    # the turns arrive: listed in the next reports, they count no more
    for d in ("d0", "d1"):
        state.report(rep(d, "decode", conversations=tuple((s, 0.1) for s, r in zip((f"s{i}" for i in range(8)), placed, strict=True) if r == d)), 1.0)
    assert state.pool_in_flight(1.0) == 0


def test_a_turn_that_never_arrives_stops_counting_at_the_second_report(make_state: MakeState) -> None:
    state = make_state("colocated", weights=LoadWeights(pin_weight=0.0, queue_weight=0.05))
    up(state, 0.0, "d0", "d1")
    assert state.route("lost", None, 1000, now=0.5).decode_replica == "d0"
    up(state, 1.0, "d0", "d1")  # its turn never reached d0 (the caller went away)
    assert state.pool_in_flight(1.0) == 1
    up(state, 2.0, "d0", "d1")
    assert state.pool_in_flight(2.0) == 0


def test_turns_without_a_conversation_count_until_the_next_report(make_state: MakeState) -> None:
    state = make_state("colocated", weights=LoadWeights(pin_weight=0.0, queue_weight=0.05))
    up(state, 0.0, "d0", "d1")
    state.route(None, None, 1000, now=0.5)
    state.route("s", None, 1000, now=0.5)
    assert state.pool_in_flight(0.5) == 2
    up(state, 1.0, "d0", "d1")
    assert state.pool_in_flight(1.0) == 1  # the sessionless one went with the report; "s" is not listed yet


def test_the_burst_spreads_by_prompt_size(make_state: MakeState) -> None:
    # one huge first prompt on d0 weighs as much as several small ones on d1
    state = make_state("conversation", weights=LoadWeights(pin_weight=0.0, queue_weight=0.0))
    up(state, 0.0, "d0", "d1")
    placed = [state.route(f"s{i}", None, tokens, now=0.0).decode_replica for i, tokens in enumerate([4000, 1000, 1000, 1000, 1000])]
    assert placed == ["d0", "d1", "d1", "d1", "d1"]  # d1 reaches 0.4 = d0 only with the 4th small prompt; ties go to d0
    assert state.route("s5", None, 1000, now=0.0).decode_replica == "d0"


# ---- snapshot --------------------------------------------------------------------------------------------


def test_snapshot_figures(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1", prefill=("p0",))
    state.report(rep("d1", "decode", kv=0.5, kv_transfers_received=3), 1.0)
    state.route("a", "alice", 100, now=2.0)  # new: d0, handoff
    state.route("a", "alice", 100, now=3.0)  # pinned
    state.route("b", None, 100, now=3.0)  # new, handoff
    state.route(None, None, 100, now=3.0)  # no session: a handoff, no pin
    state.replica_failed("d1", 3.0)
    snap = state.snapshot(4.0)
    assert snap["policy"] == "conversation"
    assert snap["live_pins"] == 2
    assert snap["conversations_total"] == 2
    assert snap["turns_total"] == 4
    assert snap["handoffs_planned_total"] == 3
    assert snap["handoffs_per_live_conversation"] == pytest.approx(1.0)  # a: 1 over 2 turns, b: 1
    assert snap["totals"]["plan_new"] == 3 and snap["totals"]["plan_pinned"] == 1 and snap["totals"]["replica_failures"] == 1
    replicas = snap["replicas"]
    assert set(replicas) == {"d0", "d1", "p0"}
    assert replicas["p0"]["pool"] == "prefill" and replicas["p0"]["live"] is True and replicas["p0"]["age_s"] == 4.0
    assert replicas["d0"]["live"] is True and replicas["d1"]["live"] is False  # failed
    assert replicas["d1"]["kv_transfers_received"] == 3 and replicas["d1"]["kv_usage"] == 0.5 and replicas["d1"]["age_s"] == 3.0
    pinned = {r: replicas[r]["pinned"] for r in replicas}
    assert pinned == dict(state.pinned_counts()) | {r: 0 for r in replicas if r not in state.pinned_counts()}
    assert sum(pinned.values()) == 2
    # stale later
    assert all(not r["live"] for r in state.snapshot(100.0)["replicas"].values())


def test_snapshot_of_an_empty_directory(make_state: MakeState) -> None:
    snap = make_state("round_robin").snapshot(0.0)
    assert snap["live_pins"] == 0 and snap["handoffs_per_live_conversation"] == 0.0 and snap["replicas"] == {}
    assert snap["turns_total"] == 0 and snap["policy"] == "round_robin"


# ---- integrity ----------------------------------------------------------------------------------------------


def test_check_integrity_catches_a_corrupted_pin(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0")
    state.route("s", None, 10, now=5.0)
    state.check_integrity()
    state._pins["s"].last_seen = 1.0  # before it was created
    with pytest.raises(AssertionError, match="bad pin"):
        state.check_integrity()
    state._pins["s"].last_seen = 5.0
    state._pins["s"].turns = 0
    with pytest.raises(AssertionError, match="bad pin"):
        state.check_integrity()
    state._pins["s"].turns = 1


@pytest.mark.parametrize("policy", ["conversation", "per_turn_pd", "conditional_pd", "colocated", "round_robin"])
@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_the_invariants(make_state: MakeState, policy: str, seed: int) -> None:
    """Reports, turns, fallbacks, failures, expiry and ends in random order; invariants after each."""
    rng = random.Random(seed)
    state = make_state(policy, max_conversations=6, conversation_ttl_s=30.0)
    decoders, now = ["d0", "d1", "d2"], 0.0
    handoffs = 0
    for _ in range(300):
        now += rng.choice([0.0, 0.5, 2.0])
        op = rng.random()
        if op < 0.3:
            state.report(rep(rng.choice(decoders), "decode", kv=rng.random(), in_flight=rng.randint(0, 3)), now)
            state.report(rep("p0", "prefill"), now)
        elif op < 0.8:
            sid = rng.choice([None, *(f"s{i}" for i in range(10))])
            before = state.pin_of(sid) if sid else None
            live = live_ids(state, "decode", now)
            try:
                plan = state.route(sid, None, rng.choice([10, 1000, 4000]), now)
            except NoReplicaAvailable:
                assert live == []
                continue
            assert plan.decode_replica in live
            handoffs += plan.remote_prefill
            if policy in ("conversation", "colocated") and before is not None and before.decoder in live:
                assert plan == TurnPlan(before.decoder, remote_prefill=False, reason="pinned")
            if policy in ("colocated", "round_robin"):
                assert not plan.remote_prefill
            if sid is not None:
                assert state.pin_of(sid).decoder == plan.decode_replica  # type: ignore[union-attr]
        elif op < 0.85:
            state.served(f"s{rng.randint(0, 9)}", rng.choice(decoders), now)
        elif op < 0.9:
            state.replica_failed(rng.choice(decoders), now)
        elif op < 0.95:
            state.expire(now)
        else:
            state.end_conversation(f"s{rng.randint(0, 9)}")
        state.check_integrity()
        assert sum(state.pinned_counts().values()) == state.snapshot(now)["live_pins"] <= 6
    assert state.totals["planned_handoffs"] == handoffs


def test_turn_index_counts_the_turns_of_a_conversation(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1")
    assert [state.route("s", None, 100, now=0.1 * i).turn_index for i in range(3)] == [0, 1, 2]
    assert state.route("other", None, 100, now=0.5).turn_index == 0
    state.check_integrity()


def test_each_plan_tells_the_pools_in_flight_reported_and_placed_since(make_state: MakeState) -> None:
    state = make_state("conversation")
    state.report(rep("d0", "decode", in_flight=2), 0.0)
    state.report(rep("d1", "decode", in_flight=1), 0.0)
    state.report(rep("p0", "prefill", in_flight=4), 0.0)  # a first turn's prefill is part of its turn: not counted
    assert state.pool_in_flight(0.0) == 3
    first = state.route("s0", None, 100, now=0.0)
    assert first.pool_in_flight == 4  # the 3 reported and this turn
    second = state.route("s1", None, 100, now=0.0)
    assert second.pool_in_flight == 5
    # d0's report replaces what was placed on it since, once it lists those turns' conversations
    state.report(rep("d0", "decode", in_flight=0, conversations=(("s0", 0.5), ("s1", 0.5))), 1.0)
    placed_on_d1 = [first.decode_replica, second.decode_replica].count("d1")
    assert state.pool_in_flight(1.0) == 1 + placed_on_d1
    assert state.pool_in_flight(1.0 + STALE + 5.0) == 0  # stale replicas are not live: nothing counted
