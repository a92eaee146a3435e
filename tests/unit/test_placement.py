"""Pure placement (router/placement.py): load ranking, conversation affinity and the pin table.

`place` below does what ConversationAffinityRouter.choose_replicas does with the pure parts, so
the scenarios exercise the same pin/route sequence without Ray; every scenario ends with
PinTable.check_integrity()."""
from __future__ import annotations

import random

import pytest

from router.placement import LoadWeights, PinTable, ReplicaLoad, RouteDecision, load_score, rank_by_load, route_with_affinity

W = LoadWeights()


def loads(**kv_and_queue: tuple[float, int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id=r, kv_usage=kv, queue_len=q) for r, (kv, q) in kv_and_queue.items()]


def place(pins: PinTable, session: str | None, candidates: list[ReplicaLoad], w: LoadWeights = W) -> RouteDecision:
    """The router's sequence: look up the pin, route, record the new pin (as serve_router does)."""
    pinned = pins.get(session) if session else None
    decision = route_with_affinity(session, pinned, candidates, w)
    if session and decision.reason != "pinned" and decision.ranks:
        pins.pin(session, decision.ranks[0][0])
    return decision


def flat(ranks: tuple[tuple[str, ...], ...]) -> list[str]:
    return [r for rank in ranks for r in rank]


# ---- load ranking ---------------------------------------------------------------------------------


def test_load_score_weighs_kv_and_queue() -> None:
    assert load_score(ReplicaLoad("a", kv_usage=0.5, queue_len=4), LoadWeights(kv_weight=2.0, queue_weight=0.25)) == pytest.approx(2.0)


def test_rank_by_kv_usage_least_loaded_first() -> None:
    assert rank_by_load(loads(a=(0.9, 0), b=(0.1, 0), c=(0.5, 0)), W) == (("b",), ("c",), ("a",))


def test_rank_by_queue_len() -> None:
    assert rank_by_load(loads(a=(0.0, 3), b=(0.0, 1), c=(0.0, 2)), W) == (("b",), ("c",), ("a",))


def test_weights_decide_between_kv_and_queue() -> None:
    candidates = loads(full_kv=(0.8, 0), long_queue=(0.0, 10))
    assert rank_by_load(candidates, LoadWeights(kv_weight=1.0, queue_weight=0.05))[0] == ("long_queue",)  # 0.8 vs 0.5
    assert rank_by_load(candidates, LoadWeights(kv_weight=1.0, queue_weight=0.1))[0] == ("full_kv",)  # 0.8 vs 1.0
    assert rank_by_load(candidates, LoadWeights(kv_weight=0.0, queue_weight=1.0))[0] == ("full_kv",)


def test_ties_are_grouped_in_one_rank_in_id_order() -> None:
    assert rank_by_load(loads(c=(0.2, 0), a=(0.2, 0), b=(0.0, 4), d=(0.5, 0)), W) == (("a", "b", "c"), ("d",))


def test_float_noise_does_not_split_a_tie() -> None:
    # 0.1 + 0.2 != 0.3 in floating point; the two replicas carry the same load
    candidates = [ReplicaLoad("a", kv_usage=0.1 + 0.2), ReplicaLoad("b", kv_usage=0.3), ReplicaLoad("c", kv_usage=0.5)]
    ranks = rank_by_load(candidates, W)
    assert len(ranks) == 2 and sorted(ranks[0]) == ["a", "b"] and ranks[1] == ("c",)


def test_rank_of_nothing_is_empty() -> None:
    assert rank_by_load([], W) == ()


# ---- affinity -------------------------------------------------------------------------------------


def test_requests_without_a_session_get_grouped_ranks() -> None:
    candidates = loads(a=(0.2, 0), b=(0.2, 0), c=(0.9, 0))
    decision = route_with_affinity(None, None, candidates, W)
    assert decision == RouteDecision(ranks=(("a", "b"), ("c",)), reason="no_session")


def test_no_candidates_means_no_ranks() -> None:
    assert route_with_affinity("s", "a", [], W) == RouteDecision(ranks=(), reason="no_session")


def test_a_new_session_goes_to_exactly_the_least_loaded_replica() -> None:
    decision = route_with_affinity("s", None, loads(a=(0.5, 0), b=(0.1, 0), c=(0.3, 0)), W)
    assert decision == RouteDecision(ranks=(("b",), ("c",), ("a",)), reason="new")


def test_a_new_session_breaks_a_tie_deterministically() -> None:
    decision = route_with_affinity("s", None, loads(b=(0.0, 0), a=(0.0, 0)), W)
    assert decision.ranks == (("a",), ("b",)) and decision.reason == "new"


def test_a_pinned_session_stays_even_when_its_replica_is_busiest() -> None:
    decision = route_with_affinity("s", "a", loads(a=(0.9, 5), b=(0.1, 0), c=(0.1, 0), d=(0.4, 0)), W)
    assert decision == RouteDecision(ranks=(("a",), ("b", "c"), ("d",)), reason="pinned")


def test_a_pinned_replica_that_was_alone_in_its_rank_leaves_no_empty_rank() -> None:
    decision = route_with_affinity("s", "b", loads(a=(0.0, 0), b=(0.5, 0), c=(0.9, 0)), W)
    assert decision.ranks == (("b",), ("a",), ("c",))


def test_a_pin_on_a_vanished_replica_is_repinned_to_one_replica() -> None:
    decision = route_with_affinity("s", "gone", loads(a=(0.3, 0), b=(0.3, 0), c=(0.1, 0)), W)
    assert decision.reason == "repinned"
    assert decision.ranks == (("c",), ("a",), ("b",))
    assert len(decision.ranks[0]) == 1


# ---- scenarios through the pin table ---------------------------------------------------------------


def test_conversation_keeps_its_replica_across_turns() -> None:
    pins = PinTable()
    first = place(pins, "conv-1", loads(a=(0.5, 0), b=(0.0, 0)))
    assert first.reason == "new" and pins.get("conv-1") == "b"
    # b gets busy; the conversation stays there (its KV lives on b), a is the fallback
    later = place(pins, "conv-1", loads(a=(0.0, 0), b=(0.9, 8)))
    assert later == RouteDecision(ranks=(("b",), ("a",)), reason="pinned")
    assert pins.get("conv-1") == "b" and len(pins) == 1
    pins.check_integrity()


def test_new_conversations_spread_by_load() -> None:
    pins = PinTable()
    queue = {"a": 0, "b": 0, "c": 0}
    for i in range(6):
        decision = place(pins, f"conv-{i}", [ReplicaLoad(r, queue_len=q) for r, q in queue.items()])
        queue[decision.ranks[0][0]] += 1
    assert queue == {"a": 2, "b": 2, "c": 2}
    pins.check_integrity()


def test_replica_death_drops_its_pins_and_the_session_moves() -> None:
    pins = PinTable()
    place(pins, "s1", loads(a=(0.0, 0), b=(0.5, 0)))
    place(pins, "s2", loads(a=(0.5, 0), b=(0.0, 0)))
    place(pins, "s3", loads(a=(0.0, 0), b=(0.5, 0)))
    assert (pins.get("s1"), pins.get("s2"), pins.get("s3")) == ("a", "b", "a")
    assert pins.drop_replica("a") == 2
    assert pins.drop_replica("a") == 0
    assert pins.get("s1") is None and pins.get("s2") == "b" and len(pins) == 1
    moved = place(pins, "s1", loads(b=(0.2, 0), c=(0.1, 0)))
    assert moved.reason == "new" and pins.get("s1") == "c"
    pins.check_integrity()


def test_pinned_replica_missing_from_candidates_is_repinned() -> None:
    pins = PinTable()
    place(pins, "s", loads(a=(0.0, 0), b=(0.5, 0)))
    moved = place(pins, "s", loads(b=(0.5, 0), c=(0.6, 0)))
    assert moved.reason == "repinned" and moved.ranks == (("b",), ("c",))
    assert pins.get("s") == "b"
    again = place(pins, "s", loads(a=(0.0, 0), b=(0.5, 0), c=(0.0, 0)))
    assert again.reason == "pinned" and again.ranks[0] == ("b",)
    pins.check_integrity()


# ---- pin table ---------------------------------------------------------------------------------------


def test_pin_table_is_a_bounded_lru() -> None:
    pins = PinTable(capacity=2)
    pins.pin("s1", "a")
    pins.pin("s2", "b")
    assert pins.get("s1") == "a"  # s1 is now the most recent
    pins.pin("s3", "c")  # evicts s2, the least recently used
    assert len(pins) == 2
    assert pins.get("s2") is None and pins.get("s1") == "a" and pins.get("s3") == "c"
    pins.check_integrity()


def test_repinning_a_session_moves_it_without_growing() -> None:
    pins = PinTable(capacity=2)
    pins.pin("s1", "a")
    pins.pin("s2", "b")
    pins.pin("s1", "c")  # s1 refreshed and moved; s2 is now the oldest
    pins.pin("s3", "a")
    assert len(pins) == 2 and pins.get("s1") == "c" and pins.get("s2") is None
    pins.check_integrity()


def test_get_of_an_unknown_session_is_none_and_changes_nothing() -> None:
    pins = PinTable(capacity=1)
    pins.pin("s1", "a")
    assert pins.get("nobody") is None
    assert len(pins) == 1 and pins.get("s1") == "a"
    pins.check_integrity()


def test_pin_table_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PinTable(capacity=0)


# ---- property: ranks are a partition of the candidates -------------------------------------------------


def random_case(rng: random.Random) -> tuple[str | None, str | None, list[ReplicaLoad], LoadWeights]:
    n = rng.randint(0, 7)
    ids = rng.sample([f"r{i}" for i in range(10)], n)
    # few distinct values so ties are common
    candidates = [ReplicaLoad(r, kv_usage=rng.choice([0.0, 0.25, 0.5, 1.0]), queue_len=rng.randint(0, 3)) for r in ids]
    session = rng.choice([None, "s"])
    pinned = rng.choice([None, "gone", *ids]) if session else None
    w = LoadWeights(kv_weight=rng.choice([0.0, 1.0, 2.0]), queue_weight=rng.choice([0.0, 0.05, 0.25]))
    return session, pinned, candidates, w


@pytest.mark.parametrize("seed", range(20))
def test_every_candidate_appears_exactly_once_across_ranks(seed: int) -> None:
    """Property-style (hypothesis is not installed here): 50 random cases per seed."""
    rng = random.Random(seed)
    for _ in range(50):
        session, pinned, candidates, w = random_case(rng)
        decision = route_with_affinity(session, pinned, candidates, w)
        ids = sorted(c.replica_id for c in candidates)
        case = (session, pinned, candidates, w, decision)
        assert sorted(flat(decision.ranks)) == ids, case
        assert all(decision.ranks), case  # no empty rank
        if session is None or not candidates:
            assert decision.reason == "no_session", case
            assert decision.ranks == rank_by_load(candidates, w), case
            continue
        assert len(decision.ranks[0]) == 1, case  # a session goes to exactly one replica first
        if pinned in ids:
            assert decision.reason == "pinned" and decision.ranks[0] == (pinned,), case
        else:
            assert decision.reason == ("new" if pinned is None else "repinned"), case
            best = min(load_score(c, w) for c in candidates)
            chosen = next(c for c in candidates if c.replica_id == decision.ranks[0][0])
            assert load_score(chosen, w) == pytest.approx(best), case


@pytest.mark.parametrize("seed", range(5))
def test_pin_table_stays_within_capacity_under_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    pins = PinTable(capacity=5)
    replicas = ["a", "b", "c"]
    for _ in range(200):
        op = rng.random()
        if op < 0.1:
            pins.drop_replica(rng.choice(replicas))
        else:
            alive = rng.sample(replicas, rng.randint(1, 3))
            place(pins, f"s{rng.randint(0, 12)}", [ReplicaLoad(r, queue_len=rng.randint(0, 3)) for r in alive])
        pins.check_integrity()
        assert len(pins) <= 5
