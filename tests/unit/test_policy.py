"""Routing policies (router/policy.py) as pure functions: plan_turn per policy, and how a new
conversation's decoder is chosen (choose_decoder over router/scoring.py's load_score)."""
from __future__ import annotations

import random
from typing import Any

import pytest

from router.policy import DISAGGREGATED, NoReplicaAvailable, TurnPlan, choose_decoder, plan_turn
from router.scoring import LoadWeights, ReplicaLoad, kv_fits, load_score

W = LoadWeights()
CAP = 10_000  # tokens each decoder's KV pool holds in these scenarios


def dec(replica_id: str, kv: float = 0.0, *, cap: int = CAP, in_flight: int = 0, pinned: int = 0) -> ReplicaLoad:
    return ReplicaLoad(replica_id=replica_id, kv_usage=kv, kv_capacity_tokens=cap, in_flight=in_flight, pinned=pinned)


# a: busy, b: least loaded, c: in between; a fresh conversation goes to b
DECODERS = [dec("a", 0.6), dec("b", 0.1), dec("c", 0.3)]


def plan(policy: str, *, pinned: str | None = None, decoders: list[ReplicaLoad] = DECODERS, prompt_tokens: int = 500,
         prefill_available: bool = True, rr_counter: int = 0, w: LoadWeights = W) -> TurnPlan:
    return plan_turn(
        policy,  # type: ignore[arg-type]
        pinned=pinned, decoders=decoders, prompt_tokens=prompt_tokens, prefill_available=prefill_available, rr_counter=rr_counter, w=w,
    )


def test_disaggregated_policies() -> None:
    assert DISAGGREGATED == {"conversation", "per_turn_pd", "conditional_pd"}


# ---- plan_turn: a table per policy -------------------------------------------------------------------

SCENARIOS: list[tuple[str, str, dict[str, Any], TurnPlan]] = [
    # conversation: remote prefill and a KV handoff only when a conversation gets a (new) decoder
    ("conversation", "first turn", {}, TurnPlan("b", remote_prefill=True, reason="new")),
    ("conversation", "later turn, live pin", {"pinned": "a"}, TurnPlan("a", remote_prefill=False, reason="pinned")),
    ("conversation", "pin on a dead decoder", {"pinned": "gone"}, TurnPlan("b", remote_prefill=True, reason="repinned")),
    ("conversation", "first turn, no prefill", {"prefill_available": False}, TurnPlan("b", remote_prefill=False, reason="new")),
    ("conversation", "dead pin, no prefill", {"pinned": "gone", "prefill_available": False}, TurnPlan("b", remote_prefill=False, reason="repinned")),
    ("conversation", "live pin, no prefill", {"pinned": "c", "prefill_available": False}, TurnPlan("c", remote_prefill=False, reason="pinned")),
    # per_turn_pd: remote prefill every turn to the least-loaded decoder; pins are ignored
    ("per_turn_pd", "first turn", {}, TurnPlan("b", remote_prefill=True, reason="per_turn")),
    ("per_turn_pd", "later turn, live pin", {"pinned": "a"}, TurnPlan("b", remote_prefill=True, reason="per_turn")),
    ("per_turn_pd", "pin on a dead decoder", {"pinned": "gone"}, TurnPlan("b", remote_prefill=True, reason="per_turn")),
    ("per_turn_pd", "no prefill", {"pinned": "a", "prefill_available": False}, TurnPlan("b", remote_prefill=False, reason="per_turn")),
    # colocated: conversation affinity, never a remote prefill (even if a prefill replica is up)
    ("colocated", "first turn", {}, TurnPlan("b", remote_prefill=False, reason="new")),
    ("colocated", "later turn, live pin", {"pinned": "a"}, TurnPlan("a", remote_prefill=False, reason="pinned")),
    ("colocated", "pin on a dead decoder", {"pinned": "gone"}, TurnPlan("b", remote_prefill=False, reason="repinned")),
    ("colocated", "no prefill", {"prefill_available": False}, TurnPlan("b", remote_prefill=False, reason="new")),
    # round_robin: sorted live replicas, by counter; load and pins play no part
    ("round_robin", "counter 0", {"pinned": "c"}, TurnPlan("a", remote_prefill=False, reason="round_robin")),
    ("round_robin", "counter 1", {"rr_counter": 1}, TurnPlan("b", remote_prefill=False, reason="round_robin")),
    ("round_robin", "counter 5", {"rr_counter": 5}, TurnPlan("c", remote_prefill=False, reason="round_robin")),
]


@pytest.mark.parametrize("policy, scenario, kwargs, expected", SCENARIOS, ids=[f"{p}: {s}" for p, s, _, _ in SCENARIOS])
def test_plan_turn(policy: str, scenario: str, kwargs: dict[str, Any], expected: TurnPlan) -> None:
    assert plan(policy, **kwargs) == expected


@pytest.mark.parametrize("policy", ["conversation", "per_turn_pd", "colocated", "round_robin"])
@pytest.mark.parametrize("pinned", [None, "a"])
def test_no_live_decoder_is_no_replica_available(policy: str, pinned: str | None) -> None:
    with pytest.raises(NoReplicaAvailable):
        plan(policy, pinned=pinned, decoders=[])


def test_no_replica_available_is_a_runtime_error() -> None:
    assert issubclass(NoReplicaAvailable, RuntimeError)


def test_round_robin_rotates_over_sorted_live_replicas() -> None:
    decoders = [dec("r2", 0.9), dec("r0"), dec("r1", 0.5)]
    got = [plan("round_robin", decoders=decoders, rr_counter=i).decode_replica for i in range(7)]
    assert got == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


def test_round_robin_skips_a_replica_that_left() -> None:
    decoders = [dec("r0"), dec("r2")]
    assert [plan("round_robin", decoders=decoders, rr_counter=i).decode_replica for i in range(4)] == ["r0", "r2", "r0", "r2"]


def test_a_pinned_conversation_stays_even_on_the_busiest_decoder() -> None:
    busy = [dec("a", 0.97, in_flight=30, pinned=50), dec("b")]
    for policy in ("conversation", "colocated"):
        assert plan(policy, pinned="a", decoders=busy) == TurnPlan("a", remote_prefill=False, reason="pinned")


def test_per_turn_pd_follows_the_load_turn_after_turn() -> None:
    turn1 = plan("per_turn_pd", decoders=[dec("a", 0.2), dec("b", 0.5)])
    turn2 = plan("per_turn_pd", pinned=turn1.decode_replica, decoders=[dec("a", 0.7), dec("b", 0.5)])
    assert (turn1.decode_replica, turn2.decode_replica) == ("a", "b")
    assert turn1.remote_prefill and turn2.remote_prefill


def test_the_new_conversation_goes_where_the_prompt_fits() -> None:
    # same occupancy; a's pool is 4x smaller, so a long first prompt fills it 4x faster
    decoders = [dec("a", 0.3, cap=2_000), dec("b", 0.3, cap=8_000)]
    assert plan("conversation", decoders=decoders, prompt_tokens=1_000).decode_replica == "b"


# ---- choose_decoder ----------------------------------------------------------------------------------


def test_choose_decoder_prefers_lower_projected_occupancy() -> None:
    # b holds less now, but a has the room: after this 3k-token prompt a is at 0.35, b at 0.4
    decoders = [dec("a", 0.2, cap=20_000), dec("b", 0.1, cap=10_000)]
    assert choose_decoder(decoders, 3_000, W) == "a"
    assert choose_decoder(decoders, 0, W) == "b"


def test_choose_decoder_penalises_pinned_conversations_by_pin_weight() -> None:
    decoders = [dec("a", 0.10, pinned=3), dec("b", 0.15, pinned=0)]
    assert choose_decoder(decoders, 0, LoadWeights(pin_weight=0.02, queue_weight=0)) == "b"  # 0.16 vs 0.15
    assert choose_decoder(decoders, 0, LoadWeights(pin_weight=0.01, queue_weight=0)) == "a"  # 0.13 vs 0.15
    assert choose_decoder(decoders, 0, LoadWeights(pin_weight=0.0, queue_weight=0)) == "a"


def test_choose_decoder_penalises_requests_in_flight_by_queue_weight() -> None:
    decoders = [dec("a", 0.10, in_flight=2), dec("b", 0.15, in_flight=0)]
    assert choose_decoder(decoders, 0, LoadWeights(pin_weight=0, queue_weight=0.05)) == "b"  # 0.20 vs 0.15
    assert choose_decoder(decoders, 0, LoadWeights(pin_weight=0, queue_weight=0.01)) == "a"  # 0.12 vs 0.15


def test_choose_decoder_breaks_ties_by_replica_id() -> None:
    decoders = [dec("r2"), dec("r10"), dec("r1")]
    assert choose_decoder(decoders, 100, W) == "r1"
    assert choose_decoder(list(reversed(decoders)), 100, W) == "r1"


def test_choose_decoder_of_nothing_is_no_replica_available() -> None:
    with pytest.raises(NoReplicaAvailable):
        choose_decoder([], 10, W)


@pytest.mark.parametrize("seed", range(20))
def test_the_chosen_decoder_always_has_the_minimal_score(seed: int) -> None:
    """Property-style (hypothesis is not installed here): 100 random cases per seed. Minimal
    among the decoders the prompt fits (kv_fits), or among all when it fits none."""
    rng = random.Random(seed)
    for _ in range(100):
        ids = rng.sample([f"d{i}" for i in range(12)], rng.randint(1, 6))
        decoders = [
            dec(r, rng.choice([0.0, 0.1, 0.5, 0.9]), cap=rng.choice([0, 4_096, 16_384]), in_flight=rng.randint(0, 4), pinned=rng.randint(0, 5))
            for r in ids
        ]
        w = LoadWeights(pin_weight=rng.choice([0.0, 0.02, 0.1]), queue_weight=rng.choice([0.0, 0.05]))
        prompt = rng.choice([0, 100, 4_000])
        chosen = choose_decoder(decoders, prompt, w)
        room = [d for d in decoders if kv_fits(d, prompt)] or decoders
        scores = {d.replica_id: load_score(d, w, prompt) for d in room}
        best = min(scores.values())
        case = (decoders, w, prompt, chosen)
        assert scores[chosen] == best, case
        assert chosen == min(r for r, s in scores.items() if s == best), case  # lowest id among the best
        # a fresh conversation under the disaggregated policy lands on the same decoder
        assert plan("conversation", decoders=decoders, prompt_tokens=prompt, w=w) == TurnPlan(chosen, remote_prefill=True, reason="new"), case
        # and a live pin is kept whatever the scores
        pinned = rng.choice(ids)
        assert plan("colocated", pinned=pinned, decoders=decoders, prompt_tokens=prompt, w=w).decode_replica == pinned, case
