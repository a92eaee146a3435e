"""deployments/turn_placement.py: the directory's TurnPlan as this ingress applies it."""
from __future__ import annotations

from deployments.turn_placement import BY_LOAD, Placement
from router.policy import TurnPlan


def test_by_load_targets_no_replica_and_prefills_locally() -> None:
    assert Placement.by_load() == Placement(decode_replica=None, remote_prefill=False, turn_index=None, reason=BY_LOAD)


def test_a_plan_is_applied_as_it_is_in_a_conversation_with_a_prefill_pool() -> None:
    plan = TurnPlan("d1", remote_prefill=True, reason="new", turn_index=3)
    assert Placement.of(plan, prefill_pool=True, in_conversation=True) == Placement("d1", True, 3, "new")


def test_no_prefill_pool_means_no_remote_prefill_and_no_conversation_no_turn_index() -> None:
    plan = TurnPlan("d1", remote_prefill=True, reason="per_turn", turn_index=2)
    assert Placement.of(plan, prefill_pool=False, in_conversation=True) == Placement("d1", False, 2, "per_turn")
    assert Placement.of(plan, prefill_pool=True, in_conversation=False) == Placement("d1", True, None, "per_turn")
