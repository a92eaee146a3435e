"""conditional_pd (router/policy.py), the prefill replica chosen from the queued prefill tokens
with a local fallback (router/placement.py, router/directory_loads.py), and new conversations
kept off decoders their KV would overflow. Pure functions, then the directory state with an
injected clock, then the backend sending the prefill to the chosen replica."""
from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
from directory_fixtures import MakeState, make_state, rep

from baton.engine.types import GenerationRequest, SamplingSpec
from deployments.turn_placement import Placement
from router.directory_loads import decoder_loads, pin_sums, prefill_loads
from router.placement import choose_prefill, decoder_idle
from router.policy import TurnPlan, needs_remote_prefill, place_new, plan_turn
from router.scoring import LoadWeights, ReplicaLoad, kv_fits

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.backend import PoolBackend
from fakes import FakeDirectory, FakePoolHandle, FakeResponseStream, scripted_deltas

__all__ = ["make_state"]
W = LoadWeights()
CAP = 10_000


def dec(rid: str, kv: float = 0.0, held: float = 0.0, cap: int = CAP) -> ReplicaLoad:
    return ReplicaLoad(rid, kv_usage=kv, kv_capacity_tokens=cap, kv_held=held)


# ---- the decision -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, held, threshold, remote", [
    (2000, 0, 512, True),  # a first turn with a long prompt
    (400, 0, 512, False),  # a short first turn
    (512, 0, 512, False),  # at the threshold: local
    (513, 0, 512, True),
    (2600, 2500, 512, False),  # a follow-up: 100 new tokens beside 2500 held
    (4000, 2500, 512, True),  # a long tool result
    (1000, 3000, 512, False),  # held beyond the prompt (a shorter history): nothing to prefill
    (10, 0, 0, True),  # threshold 0: every turn with anything uncached goes remote
])
def test_needs_remote_prefill(prompt: int, held: int, threshold: int, remote: bool) -> None:
    assert needs_remote_prefill(prompt, held, threshold) is remote


DECODERS = [dec("a", 0.6), dec("b", 0.1)]


def plan(**kw: Any) -> TurnPlan:
    args: dict[str, Any] = {"pinned": None, "decoders": DECODERS, "prompt_tokens": 2000, "prefill_available": True, "rr_counter": 0,
                            "w": W, "held_tokens": 0, "threshold_tokens": 512}
    return plan_turn("conditional_pd", **{**args, **kw})


@pytest.mark.parametrize("kw, expected", [
    ({}, TurnPlan("b", remote_prefill=True, reason="new")),
    ({"prompt_tokens": 300}, TurnPlan("b", remote_prefill=False, reason="new")),
    ({"pinned": "a", "prompt_tokens": 2100, "held_tokens": 2000}, TurnPlan("a", remote_prefill=False, reason="pinned")),
    ({"pinned": "a", "prompt_tokens": 3000, "held_tokens": 2000}, TurnPlan("a", remote_prefill=True, reason="pinned")),
    ({"pinned": "a", "prefill_available": False}, TurnPlan("a", remote_prefill=False, reason="pinned")),
    ({"pinned": "gone", "prompt_tokens": 2100, "held_tokens": 2000}, TurnPlan("b", remote_prefill=True, reason="repinned")),  # held KV is lost with its decoder
    ({"prefill_available": False}, TurnPlan("b", remote_prefill=False, reason="new")),
])
def test_conditional_pd_plans(kw: dict[str, Any], expected: TurnPlan) -> None:
    assert plan(**kw) == expected


def test_other_policies_ignore_the_threshold() -> None:
    common: dict[str, Any] = {"decoders": DECODERS, "prompt_tokens": 100, "prefill_available": True, "rr_counter": 0, "w": W}
    assert plan_turn("conversation", pinned=None, **common).remote_prefill  # a first turn is always remote
    assert not plan_turn("conversation", pinned="a", **common, held_tokens=0).remote_prefill  # a later turn never
    assert plan_turn("per_turn_pd", pinned="a", **common, held_tokens=100).remote_prefill


# ---- decoder pressure -------------------------------------------------------------------------------------


def test_kv_fits_counts_the_kv_held_for_pinned_conversations() -> None:
    assert kv_fits(dec("a", kv=0.1), 8000) and not kv_fits(dec("a", kv=0.1), 9500)
    assert not kv_fits(dec("a", kv=0.1, held=0.5), 6000)  # idle pins' cached KV counts
    assert kv_fits(dec("a", kv=0.9, cap=0), 10 ** 9)  # capacity unknown: fits


def test_a_new_conversation_skips_a_decoder_it_would_overflow() -> None:
    # a scores lower (less in use) but holds 0.9 of its pool for its pinned conversations
    a, b = dec("a", kv=0.05, held=0.9), dec("b", kv=0.3)
    assert place_new([a, b], 2000, W) == ("b", True)
    assert place_new([a, b], 500, W) == ("a", True)  # it fits both: the lower score wins
    p = plan_turn("conversation", pinned=None, decoders=[a, b], prompt_tokens=2000, prefill_available=True, rr_counter=0, w=W)
    assert p.decode_replica == "b" and not p.kv_overflow


def test_when_no_decoder_fits_the_least_loaded_takes_it_and_the_plan_says_so() -> None:
    a, b = dec("a", kv=0.5, held=0.9), dec("b", kv=0.6, held=0.95)
    assert place_new([a, b], 2000, W) == ("a", False)
    p = plan_turn("colocated", pinned=None, decoders=[a, b], prompt_tokens=2000, prefill_available=False, rr_counter=0, w=W)
    assert p.decode_replica == "a" and p.kv_overflow


class P:
    def __init__(self, decoder: str, prompt_tokens: int):
        self.decoder, self.prompt_tokens = decoder, prompt_tokens


def test_decoder_loads_hold_pinned_contexts_up_to_what_is_resident() -> None:
    reports = [rep("d0", "decode", kv=0.1, kv_resident=0.3), rep("d1", "decode", kv=0.1)]
    loads = decoder_loads(reports, {"d0": (1, 1000)}, *pin_sums([P("d0", 4000), P("d0", 1000), P("d1", 2000)]))
    by = {x.replica_id: x for x in loads}
    # d0: pins hold 5000/10000 but only 0.3 is resident; plus the 1000 unreported tokens
    assert by["d0"].kv_held == pytest.approx(0.3 + 0.1) and by["d0"].kv_usage == pytest.approx(0.2)
    assert by["d0"].pinned == 2 and by["d0"].in_flight == 1
    assert by["d1"].kv_held == pytest.approx(0.2) and by["d1"].pinned == 1  # no kv_resident reported: the pins' sum


# ---- the prefill replica -------------------------------------------------------------------------------


def pf(rid: str, queued: int, in_flight: int = 0) -> ReplicaLoad:
    return ReplicaLoad(rid, pending_prefill_tokens=queued, in_flight=in_flight)


def test_the_prefill_replica_with_the_fewest_queued_tokens_is_chosen() -> None:
    assert choose_prefill([pf("p0", 9000), pf("p1", 3000), pf("p2", 5000)], decoder_idle=False, limit_tokens=16384) == "p1"
    assert choose_prefill([pf("p0", 0, 3), pf("p1", 0, 1)], decoder_idle=False, limit_tokens=16384) == "p1"  # then in flight
    assert choose_prefill([pf("p1", 0), pf("p0", 0)], decoder_idle=False, limit_tokens=16384) == "p0"  # then id
    assert choose_prefill([], decoder_idle=False, limit_tokens=0) is None


def test_a_saturated_prefill_pool_falls_back_to_an_idle_decoder_only() -> None:
    full = [pf("p0", 20000), pf("p1", 17000)]
    assert choose_prefill(full, decoder_idle=True, limit_tokens=16384) is None
    assert choose_prefill(full, decoder_idle=False, limit_tokens=16384) == "p1"  # a busy decoder: queue anyway
    assert choose_prefill([pf("p0", 20000), pf("p1", 100)], decoder_idle=True, limit_tokens=16384) == "p1"  # one has room


def test_decoder_idle() -> None:
    assert decoder_idle(0, 0, 512) and decoder_idle(0, 512, 512)
    assert not decoder_idle(1, 0, 512) and not decoder_idle(0, 513, 512)


def test_prefill_loads_add_what_was_sent_since_the_report() -> None:
    loads = prefill_loads([rep("p0", "prefill", pending_prefill_tokens=100)], {"p0": (2, 3000)})
    assert loads == [ReplicaLoad("p0", pending_prefill_tokens=3100, in_flight=2)]


# ---- the directory --------------------------------------------------------------------------------------


def test_directory_conditional_pd_prefills_remotely_only_long_suffixes(make_state: MakeState) -> None:
    state = make_state("conditional_pd", conditional_pd_threshold_tokens=512)
    for r in (rep("d0", "decode"), rep("p0", "prefill")):
        state.report(r, 0.0)
    first = state.route("s", "u", 3000, 1.0)
    assert (first.decode_replica, first.remote_prefill, first.prefill_replica) == ("d0", True, "p0")
    follow = state.route("s", "u", 3200, 2.0)  # 200 tokens beside the 3000 held
    assert (follow.reason, follow.remote_prefill, follow.prefill_replica) == ("pinned", False, None)
    tool = state.route("s", "u", 4000, 3.0)  # an 800-token tool result
    assert (tool.reason, tool.remote_prefill) == ("pinned", True)
    assert state.pin_of("s").handoffs == 2  # type: ignore[union-attr]
    short = state.route("t", "u", 100, 4.0)
    assert not short.remote_prefill


def test_directory_sends_each_prefill_to_the_least_queued_replica(make_state: MakeState) -> None:
    state = make_state("conversation")
    for r in (rep("d0", "decode", num_waiting=1), rep("p0", "prefill", pending_prefill_tokens=1000), rep("p1", "prefill")):
        state.report(r, 0.0)
    got = [state.route(f"s{i}", "u", 2000, 1.0).prefill_replica for i in range(3)]
    # p1 (0 queued) takes 2000; then p0 (1000) < p1 (2000); then p1 (2000) < p0 (3000)
    assert got == ["p1", "p0", "p1"]
    state.report(rep("p1", "prefill", pending_prefill_tokens=0), 2.0)  # its report clears what it was sent
    assert state.route("s9", "u", 2000, 2.0).prefill_replica == "p1"


def test_directory_prefills_on_an_idle_decoder_when_the_prefill_pool_is_saturated(make_state: MakeState) -> None:
    state = make_state("conversation", prefill_queue_limit_tokens=4000)
    for r in (rep("d0", "decode"), rep("p0", "prefill", pending_prefill_tokens=5000)):
        state.report(r, 0.0)
    p = state.route("s", "u", 2000, 1.0)
    assert (p.remote_prefill, p.prefill_replica) == (False, None)
    assert state.totals["prefill_fallback_local"] == 1 and state.totals.get("planned_handoffs", 0) == 0
    assert state.pin_of("s").handoffs == 0  # type: ignore[union-attr]
    assert state.snapshot(1.0)["prefill_fallback_local_total"] == 1
    # the same pool and a decoder with requests waiting: the turn queues for the prefill pool
    state.report(rep("d0", "decode", num_waiting=2), 2.0)
    assert state.route("t", "u", 2000, 2.0).remote_prefill and state.totals["prefill_fallback_local"] == 1


def test_directory_keeps_new_conversations_off_a_decoder_full_of_pinned_context(make_state: MakeState) -> None:
    state = make_state("conversation")
    for r in (rep("d0", "decode", kv_resident=0.9), rep("d1", "decode", kv=0.05, kv_resident=0.9), rep("p0", "prefill")):
        state.report(r, 0.0)
    state.route("big", "u", 8000, 1.0)  # d0 (the lower id of two equal decoders) now holds 8000 of 10000
    state.report(rep("d0", "decode", kv_resident=0.9), 2.0)
    state.report(rep("d1", "decode", kv=0.3, kv_resident=0.9), 2.0)  # d1 busier, but with room
    p = state.route("next", "u", 3000, 3.0)
    assert p.decode_replica == "d1" and not p.kv_overflow
    state.report(rep("d1", "decode", kv=0.9, kv_resident=0.9), 4.0)
    q = state.route("third", "u", 3000, 4.0)
    assert q.kv_overflow and state.totals["placed_without_kv_room"] == 1
    assert state.snapshot(4.0)["placed_without_kv_room_total"] == 1


# ---- the backend ------------------------------------------------------------------------------------------


def test_the_prefill_request_targets_the_directorys_prefill_replica() -> None:
    kv = {"remote_block_ids": [1]}
    decode = FakePoolHandle([FakeResponseStream(scripted_deltas(2, replica="d0"))])
    prefill = FakePoolHandle([FakeResponseStream(scripted_deltas(1, replica="p1", kv_transfer_params=kv))])
    plan = TurnPlan("d0", remote_prefill=True, reason="new", prefill_replica="p1")
    req = GenerationRequest(request_id="r", prompt_token_ids=(1, 2), sampling=SamplingSpec(max_tokens=2), session_id="s")

    async def run() -> None:
        async for _ in PoolBackend(decode, prefill, FakeDirectory([plan])).generate(req):
            pass

    asyncio.run(run())
    assert prefill.sent[0].target_replica == "p1" and decode.sent[0].kv_transfer_params == kv


def test_placement_carries_the_prefill_replica_only_for_a_remote_prefill() -> None:
    plan = TurnPlan("d0", remote_prefill=True, reason="new", prefill_replica="p1")
    assert Placement.of(plan, prefill_pool=True, in_conversation=True).prefill_replica == "p1"
    assert Placement.of(plan, prefill_pool=False, in_conversation=True).prefill_replica is None
