"""The conversation directory's state (router/directory_state.py), with an injected clock: which
replicas are live, where each turn goes, how pins follow failures and fallbacks, and what the
snapshot reports. Every state a test builds is checked with check_integrity() when it ends."""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from router.directory_state import DirectorySettings, DirectoryState, NoReplicaAvailable
from router.policy import PlacementWeights, TurnPlan

CAP = 10_000
STALE = 10.0
TTL = 1800.0

MakeState = Callable[..., DirectoryState]


@pytest.fixture
def make_state() -> Iterator[MakeState]:
    """DirectoryState factory; every state it made must pass check_integrity() at the end."""
    made: list[DirectoryState] = []

    def make(policy: str = "conversation", **settings: Any) -> DirectoryState:
        settings.setdefault("stale_after_s", STALE)
        settings.setdefault("conversation_ttl_s", TTL)
        state = DirectoryState(DirectorySettings(policy=policy, **settings))  # type: ignore[arg-type]
        made.append(state)
        return state

    yield make
    for state in made:
        state.check_integrity()


def stats(kv: float = 0.0, in_flight: int = 0, cap: int = CAP, **more: Any) -> dict[str, Any]:
    return {"kv_usage": kv, "kv_capacity_tokens": cap, "in_flight": in_flight, **more}


def up(state: DirectoryState, now: float, *decoders: str, prefill: tuple[str, ...] = ("p0",), **decoder_stats: Any) -> None:
    """Decoders (and prefill replicas) report equal loads at `now`."""
    for d in decoders:
        state.report(d, "decode", stats(**decoder_stats), now)
    for p in prefill:
        state.report(p, "prefill", stats(), now)


def live_ids(state: DirectoryState, pool: str, now: float) -> list[str]:
    return sorted(r.replica_id for r in state.live(pool, now))


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
    state.report("d0", "decode", stats(), 200.0)
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
    state.report("d0", "decode", stats(), 2.0)  # sent before the failure, delivered after: ignored
    assert live_ids(state, "decode", 2.0) == ["d1"]
    state.report("d0", "decode", stats(), 0.5 + STALE + 1)
    state.report("d1", "decode", stats(), 0.5 + STALE + 1)
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
        state.report("d0", "decode", stats(kv=0.95, in_flight=20), float(t))
        state.report("d1", "decode", stats(), float(t))
        state.report("p0", "prefill", stats(), float(t))
        assert state.route("s", None, 500 + 100 * t, now=float(t)) == TurnPlan("d0", remote_prefill=False, reason="pinned")
    pin = state.pin_of("s")
    assert pin is not None and pin.turns == 6 and pin.handoffs == 1 and pin.last_seen == 5.0 and pin.created == 0.0


def test_without_a_live_prefill_replica_the_first_turn_is_prefilled_on_the_decoder(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", prefill=())
    assert state.route("s", None, 100, now=0.0) == TurnPlan("d0", remote_prefill=False, reason="new")
    state.report("p0", "prefill", stats(), 0.0)
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
    state = make_state("per_turn_pd", weights=PlacementWeights(pin_weight=1.0, queue_weight=0.0))
    up(state, 0.0, "d0", "d1")
    state.report("d1", "decode", stats(kv=0.05), 0.0)
    for i in range(5):
        state.route(f"s{i}", None, 0, now=0.0)
    up(state, 1.0, "d0")
    state.report("d1", "decode", stats(kv=0.05), 1.0)  # reports clear the projection of turns routed
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


# ---- bursts: the projection of turns routed since the last report -------------------------------------


@pytest.mark.parametrize("policy", ["conversation", "colocated", "per_turn_pd"])
def test_a_burst_of_new_conversations_spreads_over_equally_loaded_decoders(make_state: MakeState, policy: str) -> None:
    # no pin penalty: only the projection of unreported turns tells the decoders apart
    state = make_state(policy, weights=PlacementWeights(pin_weight=0.0, queue_weight=0.05))
    up(state, 0.0, "d0", "d1", kv=0.2)
    got = Counter(state.route(f"s{i}", None, 1000, now=0.0).decode_replica for i in range(4))
    assert got == Counter({"d0": 2, "d1": 2})


def test_the_projection_alone_spreads_a_burst(make_state: MakeState) -> None:
    """Only the projected KV (prompt / capacity) of unreported turns differs between decoders."""
    state = make_state("conversation", weights=PlacementWeights(pin_weight=0.0, queue_weight=0.0))
    up(state, 0.0, "d0", "d1")
    assert Counter(state.route(f"s{i}", None, 1000, now=0.0).decode_replica for i in range(4)) == Counter({"d0": 2, "d1": 2})
    # with unknown capacities (and no queue or pin weight) nothing distinguishes them: all go to d0
    blind = make_state("conversation", weights=PlacementWeights(pin_weight=0.0, queue_weight=0.0))
    up(blind, 0.0, "d0", "d1", cap=0)
    assert Counter(blind.route(f"s{i}", None, 1000, now=0.0).decode_replica for i in range(4)) == Counter({"d0": 4})


def test_a_report_replaces_the_projection(make_state: MakeState) -> None:
    state = make_state("conversation", weights=PlacementWeights(pin_weight=0.0, queue_weight=0.05))
    up(state, 0.0, "d0", "d1")
    assert state.route("s0", None, 5000, now=0.0).decode_replica == "d0"
    assert state.route("s1", None, 100, now=0.0).decode_replica == "d1"  # d0 projected at 0.5
    # d0 reports: the 5k-token turn finished and its KV was evicted; d1 is still busy
    state.report("d0", "decode", stats(kv=0.0), 1.0)
    state.report("d1", "decode", stats(kv=0.3, in_flight=1), 1.0)
    assert state.route("s2", None, 100, now=1.0).decode_replica == "d0"


def test_the_burst_spreads_by_prompt_size(make_state: MakeState) -> None:
    # one huge first prompt on d0 weighs as much as several small ones on d1
    state = make_state("conversation", weights=PlacementWeights(pin_weight=0.0, queue_weight=0.0))
    up(state, 0.0, "d0", "d1")
    placed = [state.route(f"s{i}", None, tokens, now=0.0).decode_replica for i, tokens in enumerate([4000, 1000, 1000, 1000, 1000])]
    assert placed == ["d0", "d1", "d1", "d1", "d1"]  # d1 reaches 0.4 = d0 only with the 4th small prompt; ties go to d0
    assert state.route("s5", None, 1000, now=0.0).decode_replica == "d0"


# ---- snapshot --------------------------------------------------------------------------------------------


def test_snapshot_figures(make_state: MakeState) -> None:
    state = make_state("conversation")
    up(state, 0.0, "d0", "d1", prefill=("p0",))
    state.report("d1", "decode", stats(kv=0.5, kv_transfers_received=3), 1.0)
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


@pytest.mark.parametrize("policy", ["conversation", "per_turn_pd", "colocated", "round_robin"])
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
            state.report(rng.choice(decoders), "decode", stats(kv=rng.random(), in_flight=rng.randint(0, 3)), now)
            state.report("p0", "prefill", stats(), now)
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
