"""The ingress's pin cache (router/pin_cache.py), the directory's change log and touches
(router/pin_log.py, router/directory_state.py) and the backend planning from the cache
(deployments/backend.py, deployments/pin_sync.py) over a fake directory handle holding a real
DirectoryState. No Ray."""
from __future__ import annotations

import asyncio
import warnings

import pytest
from fakes import FakeDirectory, FakePoolHandle, FakeResponseStream, scripted_deltas
from ray import exceptions as rx

from baton.engine.types import GenerationRequest, SamplingSpec
from router.directory_state import DirectorySettings, DirectoryState
from router.pin_cache import PinCache, PinSync, PinUpdate, Placed, Touch, with_placed
from router.pin_log import PinChangeLog
from router.policy import TurnPlan
from router.report import ReplicaReport
from router.scoring import LoadWeights, ReplicaLoad

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.backend import PoolBackend
    from deployments.pin_sync import PinSyncer, ShardedPins


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def synced(live: tuple[str, ...] = ("d0", "d1"), *, incarnation: str = "dir-1", seq: int = 0, changed: tuple[PinUpdate, ...] = (),
           reset: bool = False) -> PinSync:
    return PinSync(incarnation, seq, changed, reset, live, pool_queueing=True, pool_in_flight=7)


def sids(sync: PinSync) -> tuple[str, ...]:
    return tuple(u.session_id for u in sync.changed)


def new_plan(decoder: str = "d0", turn_index: int = 0, reason: str = "new") -> TurnPlan:
    return TurnPlan(decoder, remote_prefill=False, reason=reason, turn_index=turn_index)  # type: ignore[arg-type]


def cache(policy: str = "conversation", period: float = 0.5, clock: Clock | None = None, **kw: int) -> PinCache:
    return PinCache(policy, period, clock=clock or Clock(), **kw)  # type: ignore[arg-type]


# ---- PinCache ---------------------------------------------------------------------------------------


def test_a_remembered_pin_plans_the_next_turns_after_a_sync_and_records_them_as_touches() -> None:
    clock = Clock(10.0)
    c = cache(clock=clock)
    c.remember("s", "ana", new_plan("d1"), 100)
    assert c.plan("s", "ana", 150) is None  # never synced: the directory's view is unknown
    c.apply(synced())  # the first sync cannot vouch for pins cached before it (no seq to ask from): dropped
    assert c.plan("s", "ana", 150) is None
    c.remember("s", "ana", new_plan("d1"), 100)
    first = c.plan("s", "ana", 150)
    second = c.plan("s", "ana", 220)
    assert first == TurnPlan("d1", remote_prefill=False, reason="pinned")
    assert (first.turn_index, second.turn_index) == (1, 2)
    assert (first.pool_queueing, first.pool_in_flight) == (True, 7)  # the pools' load as of the last sync, for admission
    clock.t = 10.4
    touches = c.take_touches()
    assert [(t.session_id, t.user, t.decoder, t.prompt_tokens) for t in touches] == [("s", "ana", "d1", 150), ("s", "ana", "d1", 220)]
    assert all(t.age_s == pytest.approx(0.4) for t in touches)
    assert c.take_touches() == []  # handed over once
    assert (c.totals["hits"], c.totals["misses"]) == (2, 2)
    c.check_integrity()


@pytest.mark.parametrize("why", ["other_user", "unknown", "stale", "decoder_not_live", "no_session"])
def test_a_turn_the_cache_cannot_vouch_for_goes_to_the_directory(why: str) -> None:
    clock = Clock(0.0)
    c = cache(clock=clock)
    c.apply(synced(live=("d0",) if why == "decoder_not_live" else ("d0", "d1")))
    c.remember("s", "ana", new_plan("d1"), 100)
    if why == "stale":
        clock.t = 1.01  # two periods of 0.5 s without a sync: the directory may be down
    sid = {"unknown": "t", "no_session": None}.get(why, "s")
    user = "bob" if why == "other_user" else "ana"
    assert c.plan(sid, user, 120) is None
    assert c.take_touches() == []
    if sid is not None:
        reason = {"other_user": "other_user", "unknown": "unknown", "stale": "stale", "decoder_not_live": "not_live"}[why]
        assert c.totals[f"misses_{reason}"] == c.totals["misses"] == 1


def test_a_sync_at_the_freshness_bound_still_vouches() -> None:
    clock = Clock(0.0)
    c = cache(clock=clock)
    c.apply(synced())
    c.remember("s", "ana", new_plan(), 100)
    clock.t = 1.0
    assert c.plan("s", "ana", 120) is not None


@pytest.mark.parametrize("policy", ["per_turn_pd", "round_robin"])
def test_policies_that_do_not_pin_never_cache(policy: str) -> None:
    c = cache(policy)
    c.remember("s", "ana", new_plan(), 100)
    c.apply(synced())
    assert not c.enabled and c.plan("s", "ana", 120) is None


def test_a_zero_period_turns_the_cache_off() -> None:
    c = cache(period=0.0)
    c.remember("s", "ana", new_plan(), 100)
    c.apply(synced())
    assert not c.enabled and c.plan("s", "ana", 120) is None


def test_conditional_pd_plans_only_turns_prefilled_on_their_decoder() -> None:
    c = cache("conditional_pd", threshold_tokens=512)
    c.apply(synced())
    c.remember("s", "ana", new_plan(), 1000)
    assert c.plan("s", "ana", 1400) is not None  # 400 new tokens beside the 1000 held: on the decoder
    assert c.plan("s", "ana", 2000) is None  # 600 new tokens: the directory picks a prefill replica
    assert c.totals["misses_remote_prefill"] == 1


def test_pins_moved_or_ended_elsewhere_are_dropped_and_a_reset_drops_all() -> None:
    c = cache()
    c.apply(synced(seq=5))
    for sid in ("a", "b", "c", "d"):
        c.remember(sid, "ana", new_plan(), 10)
    c.apply(synced(seq=9, changed=(PinUpdate("b", "d1", "ana", 3, 50), PinUpdate("c", None), PinUpdate("d", "d0", "bob", 2, 9),
                                   PinUpdate("zzz", "d0", "ana", 1, 1))))
    assert c.sync_args() == ("dir-1", 9)
    assert [c.plan(s, "ana", 20) is not None for s in ("a", "b", "c", "d")] == [True, False, False, False]
    c.apply(synced(seq=2, incarnation="dir-2"))  # a restarted directory: nothing cached holds
    assert c.plan("a", "ana", 30) is None and c.sync_args() == ("dir-2", 2)
    c.remember("a", "ana", new_plan(), 10)
    c.apply(synced(seq=3, incarnation="dir-2", reset=True))
    assert c.plan("a", "ana", 30) is None and c.totals["resets"] == 2


def test_a_failed_decoder_drops_its_pins_here_at_once() -> None:
    c = cache()
    c.apply(synced())
    c.remember("a", "ana", new_plan("d0"), 10)
    c.remember("b", "ana", new_plan("d1"), 10)
    assert c.forget_decoder("d0") == 1
    assert c.plan("a", "ana", 20) is None and c.plan("b", "ana", 20) is not None


def test_plans_of_other_reasons_are_not_cached_and_capacity_evicts_the_least_recent() -> None:
    c = cache(capacity=2)
    c.apply(synced())
    c.remember("rr", "ana", TurnPlan("d0", remote_prefill=False, reason="per_turn"), 10)
    for sid in ("a", "b"):
        c.remember(sid, "ana", new_plan(), 10)
    assert c.plan("a", "ana", 20) is not None  # a is now the most recent
    c.remember("c", "ana", new_plan(), 10)
    assert [c.plan(s, "ana", 30) is not None for s in ("rr", "a", "b", "c")] == [False, True, False, True]
    c.check_integrity()


def test_touches_of_a_failed_sync_go_out_with_the_next_within_the_bound() -> None:
    clock = Clock(0.0)
    c = cache(clock=clock, max_pending=3)
    c.apply(synced())
    c.remember("s", "ana", new_plan(), 10)
    c.plan("s", "ana", 11)
    c.plan("s", "ana", 12)
    lost = c.take_touches()
    c.plan("s", "ana", 13)
    c.plan("s", "ana", 14)
    c.give_back(lost)  # 4 pending: the oldest one is dropped
    clock.t = 0.3
    assert [t.prompt_tokens for t in c.take_touches()] == [12, 13, 14]
    assert (c.totals["touches_dropped"], c.totals["sync_failures"]) == (1, 1)


# ---- the directory's log and touches -----------------------------------------------------------------


def directory(policy: str = "conversation") -> DirectoryState:
    state = DirectoryState(DirectorySettings(policy=policy))  # type: ignore[arg-type]
    for d in ("d0", "d1"):
        state.report(ReplicaReport(d, "decode"), 0.0)
    state.report(ReplicaReport("p0", "prefill"), 0.0)
    return state


def test_a_sync_answers_changes_made_by_others_not_by_the_asker() -> None:
    state = directory()
    first = state.sync("ing-a", None, 0, [], 1.0)
    assert first.reset and first.live_decoders == ("d0", "d1")
    state.route("s", "ana", 100, 1.0, via="ing-a")
    state.route("t", "bob", 100, 1.0, via="ing-b")
    a = state.sync("ing-a", first.incarnation, first.seq, [], 1.5)
    assert not a.reset and sids(a) == ("t",)  # its own turn of s is not sent back to it
    b = state.sync("ing-b", first.incarnation, first.seq, [], 1.5)
    assert sids(b) == ("s",) and b.changed[0].decoder is not None
    assert sids(state.sync("ing-a", a.incarnation, a.seq, [], 2.0)) == ()
    state.end_conversation("s", "ana")  # made by the directory: everyone hears of it
    ended = state.sync("ing-a", a.incarnation, a.seq, [], 2.0).changed
    assert ended == (PinUpdate("s", None),)
    state.check_integrity()


def test_touches_are_recorded_like_routed_turns_unless_the_pin_moved() -> None:
    state = directory()
    plan = state.route("s", "ana", 100, 1.0, via="ing-a")
    start = state.sync("ing-a", None, 0, [], 1.0)
    reply = state.sync("ing-a", start.incarnation, start.seq, [Touch("s", "ana", plan.decode_replica, 180, 0.5)], 3.0)
    pin = state.pin_of("s")
    assert pin is not None and (pin.turns, pin.prompt_tokens, pin.last_seen) == (2, 180, 2.5)
    assert sids(reply) == () and state.snapshot(3.0)["turns_total"] == 2
    other = "d1" if plan.decode_replica == "d0" else "d0"
    state.sync("ing-a", reply.incarnation, reply.seq, [Touch("s", "ana", other, 200, 0.0), Touch("s", "bob", plan.decode_replica, 200, 0.0),
                                                        Touch("gone", "ana", plan.decode_replica, 200, 0.0)], 3.0)
    assert state.pin_of("s").turns == 2 and state.totals["pin_touches_stale"] == 3  # type: ignore[union-attr]
    state.check_integrity()


def test_a_log_that_no_longer_reaches_back_resets_the_asker() -> None:
    log = PinChangeLog(capacity=3, incarnation="x")
    for sid in "abcde":
        log.changed(sid, "ing-b")
    assert log.since("ing-a", "x", 2) == (("c", "d", "e"), False)  # changes 3..5 are all kept
    assert log.since("ing-a", "x", 1) == ((), True)  # change 2 fell out
    assert log.since("ing-a", "x", 9) == ((), True)  # a seq from the future: another directory
    assert log.since("ing-a", "y", 5) == ((), True)
    log.check_integrity()


def test_expiry_and_adoption_are_changes_too() -> None:
    state = directory()
    state.route("s", "ana", 100, 1.0, via="ing-a")
    start = state.sync("ing-a", None, 0, [], 1.0)
    state.expire(1.0 + state.settings.conversation_ttl_s + 1)
    assert state.sync("ing-a", start.incarnation, start.seq, [], 1.0).changed == (PinUpdate("s", None),)


# ---- the backend planning from its cache ----------------------------------------------------------


def turn(sid: str, user: str = "ana", n: int = 3) -> GenerationRequest:
    return GenerationRequest(request_id=f"r-{sid}-{n}", prompt_token_ids=tuple(range(n)), sampling=SamplingSpec(max_tokens=2),
                             session_id=sid, user=user)


def run_turns(backend: PoolBackend, syncer: PinSyncer, requests: list[GenerationRequest]) -> None:
    async def go() -> None:
        for req in requests:
            async for _ in backend.generate(req):
                pass
            await syncer.sync_once()  # as the periodic task would between turns

    asyncio.run(go())


def backend_over(state: DirectoryState, decode: FakePoolHandle, period: float = 60.0) -> tuple[PoolBackend, PinSyncer, FakeDirectory]:
    directory = FakeDirectory(state=state, clock=lambda: 1.0)
    syncer = PinSyncer(PinCache("colocated", period), directory.handle)
    return PoolBackend(decode, None, directory, pins=ShardedPins([syncer], directory)), syncer, directory


def test_later_turns_of_a_conversation_skip_the_directory_and_it_still_counts_them() -> None:
    state = directory("colocated")
    decode = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(2, replica=req.target_replica)))
    backend, syncer, fake = backend_over(state, decode)
    run_turns(backend, syncer, [turn("s", n=3), turn("s", n=5), turn("s", n=8), turn("t", user="bob")])
    assert [args[0] for args in fake.called("route")] == ["s", "t"]  # s's second and third turns came from the cache
    assert len({r.target_replica for r in decode.sent[:3]}) == 1  # pinned
    pin = state.pin_of("s")
    assert pin is not None and (pin.turns, pin.prompt_tokens) == (3, 8)  # the directory recorded the cached turns
    assert syncer.cache.totals["hits"] == 2
    state.check_integrity()
    syncer.cache.check_integrity()


def test_a_decoder_lost_on_a_cached_turn_is_re_placed_by_the_directory() -> None:
    state = directory("colocated")
    sent: list[str | None] = []

    def script(req: GenerationRequest) -> FakeResponseStream:
        sent.append(req.target_replica)
        if len(sent) == 2:  # the second turn (from the cache) meets a dead decoder
            return FakeResponseStream(scripted_deltas(2), error=rx.ActorDiedError(), error_after=0)
        return FakeResponseStream(scripted_deltas(2, replica=req.target_replica))

    backend, syncer, fake = backend_over(state, FakePoolHandle(script))
    run_turns(backend, syncer, [turn("s", n=3), turn("s", n=5)])
    assert len(fake.called("route")) == 2 and len(fake.called("replica_failed")) == 1
    assert sent[2] != sent[0]  # re-placed by the directory, away from the failed decoder
    assert syncer.cache.totals["hits"] == 1


def test_a_directory_that_stops_answering_stops_the_cache_within_two_periods() -> None:
    state = directory("colocated")
    decode = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(2, replica=req.target_replica)))
    clock = Clock(0.0)
    fake = FakeDirectory(state=state, clock=lambda: 1.0)
    syncer = PinSyncer(PinCache("colocated", 0.5, clock=clock), fake.handle)
    backend = PoolBackend(decode, None, fake, pins=ShardedPins([syncer], fake))
    run_turns(backend, syncer, [turn("s", n=3)])
    fake.errors["sync"] = rx.ActorDiedError()
    clock.t = 0.9
    run_turns(backend, syncer, [turn("s", n=4)])  # fresh enough: from the cache; its own sync then fails
    clock.t = 1.2
    run_turns(backend, syncer, [turn("s", n=5)])  # over two periods since the last good sync: the directory
    assert len(fake.called("route")) == 2 and syncer.cache.totals["hits"] == 1
    fake.errors.pop("sync")
    asyncio.run(syncer.sync_once())
    pin = state.pin_of("s")
    assert pin is not None and pin.turns == 3  # the failed sync's touch arrived with the next one


def plan_from(incarnation: str, seq: int, decoder: str = "d0") -> TurnPlan:
    return TurnPlan(decoder, remote_prefill=False, reason="new", incarnation=incarnation, pin_seq=seq)


def test_a_route_answer_starts_the_cache_at_its_directory_and_a_sync_in_flight_does_not_undo_it() -> None:
    c = cache()
    asked = c.sync_args()  # a sync leaves before the first turn's route answer comes back
    c.remember("s", "ana", plan_from("dir-1", 4), 10)
    assert c.sync_args() == ("dir-1", 4)
    c.apply(synced(incarnation="dir-1", seq=3, reset=True), asked=asked)  # its answer to "never synced"
    assert c.sync_args() == ("dir-1", 4) and c.plan("s", "ana", 20) is not None  # kept; the view refreshed
    c.apply(synced(incarnation="dir-1", seq=6, changed=(PinUpdate("s", "d1", "ana", 2, 20),)), asked=c.sync_args())
    assert c.plan("s", "ana", 30) is None  # moved elsewhere after the answer: dropped


def test_a_restarted_directory_seen_first_in_a_route_answer_drops_the_old_entries() -> None:
    c = cache()
    c.apply(synced(incarnation="dir-1", seq=10))
    c.remember("old", "ana", plan_from("dir-1", 11), 10)
    asked = c.sync_args()
    c.remember("new", "ana", plan_from("dir-2", 2, "d1"), 10)  # the directory restarted
    c.apply(synced(incarnation="dir-1", seq=12), asked=asked)  # a late answer of the old one: ignored
    c.apply(synced(incarnation="dir-2", seq=3), asked=c.sync_args())
    assert c.plan("old", "ana", 20) is None and c.plan("new", "ana", 20) == TurnPlan("d1", remote_prefill=False, reason="pinned")
    assert c.sync_args() == ("dir-2", 3)
    c.check_integrity()


def test_the_directory_answers_its_incarnation_and_seq_with_every_plan() -> None:
    state = directory()
    plan = state.route("s", "ana", 100, 1.0, via="ing-a")
    reply = state.sync("ing-a", None, 0, [], 1.0)
    assert (plan.incarnation, plan.pin_seq) == (reply.incarnation, reply.seq)


def test_the_snapshot_reports_every_count_from_zero() -> None:
    snap = cache().snapshot()
    assert snap["hits"] == 0 and snap["sync_failures"] == 0 and snap["enabled"] and not snap["fresh"]


def test_a_turn_another_ingress_served_on_the_same_decoder_keeps_the_pin_and_its_count() -> None:
    c = cache()
    c.apply(synced(seq=1))
    c.remember("s", "ana", new_plan("d0"), 10)  # turn 0 here
    asked = c.sync_args()
    c.apply(synced(seq=4, changed=(PinUpdate("s", "d0", "ana", 3, 300),)), asked=asked)  # turns 1 and 2 at another ingress
    got = c.plan("s", "ana", 320)
    assert got is not None and got.turn_index == 3 and c.totals["updated"] == 1
    asked = c.sync_args()
    touches = c.take_touches()
    c.plan("s", "ana", 400)  # planned here while the sync is in flight
    c.apply(synced(seq=6, changed=(PinUpdate("s", "d0", "ana", 5, 350),)), asked=asked)  # its touch + one more elsewhere
    assert len(touches) == 1 and c.plan("s", "ana", 420).turn_index == 6  # type: ignore[union-attr]


def test_two_ingresses_over_one_directory_share_a_conversation_without_dropping_it() -> None:
    state = directory("colocated")
    a, b = cache("colocated"), cache("colocated")
    for name, cch in (("ing-a", a), ("ing-b", b)):
        cch.apply(state.sync(name, *cch.sync_args(), cch.take_touches(), 1.0), asked=None)
    first = state.route("s", "ana", 100, 1.0, via="ing-a")
    a.remember("s", "ana", first, 100)
    second = state.route("s", "ana", 150, 1.1, via="ing-b")  # b has no entry yet: asks
    b.remember("s", "ana", second, 150)
    indices = []
    for i, (name, cch) in enumerate([("ing-a", a), ("ing-b", b), ("ing-a", a), ("ing-b", b)]):
        cch.apply(state.sync(name, *cch.sync_args(), cch.take_touches(), 2.0 + i), asked=None)
        plan = cch.plan("s", "ana", 200 + 50 * i)
        assert plan is not None and plan.decode_replica == first.decode_replica
        indices.append(plan.turn_index)
        cch.apply(state.sync(name, *cch.sync_args(), cch.take_touches(), 2.5 + i), asked=None)
    assert indices == [2, 3, 4, 5]
    assert state.pin_of("s").turns == 6  # type: ignore[union-attr]
    state.check_integrity()


# ---- turns outside a conversation -----------------------------------------------------------------


def loaded(kv: dict[str, float], *, capacity: int = 1000, live: tuple[str, ...] | None = None) -> PinSync:
    loads = tuple(ReplicaLoad(d, kv_usage=u, kv_capacity_tokens=capacity) for d, u in kv.items())
    return PinSync("dir-1", 0, (), False, live if live is not None else tuple(kv), decoder_loads=loads, weights=LoadWeights(queue_weight=0.0))


def test_a_sessionless_turn_goes_to_the_least_loaded_decoder_of_the_view_and_counts_its_own_placements() -> None:
    clock = Clock(1.0)
    c = cache("colocated", clock=clock)
    assert c.plan_sessionless(100) is None  # never synced: no view of the loads
    c.apply(loaded({"d0": 0.5, "d1": 0.2}))
    first = c.plan_sessionless(400)
    assert first is not None and first.decode_replica == "d1" and not first.remote_prefill
    second = c.plan_sessionless(400)  # d1 now holds 0.2 + 0.4 of its pool by this ingress's own count
    assert second is not None and second.decode_replica == "d0"
    assert c.totals["sessionless_hits"] == 2 and c.totals["sessionless_misses"] == 1
    c.check_integrity()


def test_sessionless_placements_go_to_the_directory_once_and_count_until_its_answer() -> None:
    c = cache("colocated")
    c.apply(loaded({"d0": 0.0, "d1": 0.1}))
    assert c.plan_sessionless(300).decode_replica == "d0"  # type: ignore[union-attr]
    sent = c.take_placed()
    assert sent == [Placed("d0", 300)]
    assert c.plan_sessionless(1).decode_replica == "d1"  # type: ignore[union-attr]  # still counted while the sync is in flight
    assert c.take_placed() == [Placed("d0", 300), Placed("d1", 1)]  # a second sync before an answer carries both
    c.give_back([], [Placed("d0", 300), Placed("d1", 1)])  # that sync failed
    assert c.take_placed() == [Placed("d0", 300), Placed("d1", 1)]
    c.apply(loaded({"d0": 0.3, "d1": 0.1}))  # the answer has them in its loads: no longer added here
    assert c.take_placed() == []
    assert c.plan_sessionless(10).decode_replica == "d1"  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", ["per_turn_pd", "round_robin"])
def test_policies_the_cache_does_not_serve_send_sessionless_turns_to_the_directory(policy: str) -> None:
    c = cache(policy)
    c.apply(loaded({"d0": 0.0}))
    assert c.plan_sessionless(10) is None


def test_a_stale_view_or_a_dead_decoder_is_not_placed_on() -> None:
    clock = Clock(0.0)
    c = cache("colocated", period=0.5, clock=clock)
    c.apply(loaded({"d0": 0.0, "d1": 0.9}))
    c.forget_decoder("d0")  # a request failed on it here
    assert c.plan_sessionless(10).decode_replica == "d1"  # type: ignore[union-attr]
    c.apply(loaded({"d0": 0.0, "d1": 0.9}, live=("d1",)))  # the directory's loads of a decoder it no longer counts live
    assert c.plan_sessionless(10).decode_replica == "d1"  # type: ignore[union-attr]
    clock.t = 1.01  # more than two periods since the sync
    assert c.plan_sessionless(10) is None


def test_with_placed_adds_requests_and_their_prompts_kv_to_the_loads() -> None:
    base = [ReplicaLoad("d0", kv_usage=0.1, kv_capacity_tokens=1000, in_flight=1), ReplicaLoad("d1")]
    d0, d1 = with_placed(base, [Placed("d0", 100), Placed("d0", 50), Placed("d1", 10)])
    assert (d0.in_flight, d0.kv_usage, d0.kv_held) == (3, pytest.approx(0.25), pytest.approx(0.15))
    assert (d1.in_flight, d1.kv_usage) == (1, 0.0)  # capacity unknown: no KV term, as the directory counts it


def test_the_directory_counts_sessionless_placements_and_touches_as_load_until_the_decoder_reports() -> None:
    state = directory("colocated")
    for d in ("d0", "d1"):
        state.report(ReplicaReport(d, "decode", kv_capacity_tokens=1000), 0.0)
    start = state.sync("ing-a", None, 0, [], 1.0)
    assert {load.replica_id: load.kv_usage for load in start.decoder_loads} == {"d0": 0.0, "d1": 0.0}
    state.route("s", "ana", 100, 1.0, via="ing-a")
    pinned_on = state.pin_of("s").decoder  # type: ignore[union-attr]
    reply = state.sync("ing-a", start.incarnation, start.seq, [Touch("s", "ana", pinned_on, 200, 0.0)], 1.5,
                       placed=[Placed("d0", 300), Placed("gone", 5)])  # a decoder the directory never heard of carries nothing
    loads = {load.replica_id: load for load in reply.decoder_loads}
    on_d0 = 300 + (100 + 200 if pinned_on == "d0" else 0)
    assert loads["d0"].kv_usage == pytest.approx(on_d0 / 1000)
    assert state.totals["plan_sessionless_at_ingress"] == 2 and reply.weights == state.settings.weights
    # its report now shows them (the routed turn of "s" once the report lists that conversation)
    state.report(ReplicaReport("d0", "decode", kv_capacity_tokens=1000, conversations=(("s", 0.5),)), 2.0)
    assert {load.replica_id: load.in_flight for load in state.sync("ing-a", reply.incarnation, reply.seq, [], 2.0).decoder_loads}["d0"] == 0
    state.check_integrity()


def sessionless(n: int = 3) -> GenerationRequest:
    return GenerationRequest(request_id=f"r-none-{n}", prompt_token_ids=tuple(range(n)), sampling=SamplingSpec(max_tokens=2))


def test_the_backend_places_sessionless_turns_from_the_cache_without_a_prefill_pool_only() -> None:
    state = directory("colocated")
    decode = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(2, replica=req.target_replica)))
    backend, syncer, fake = backend_over(state, decode)
    run_turns(backend, syncer, [sessionless(3), sessionless(4), sessionless(5)])
    assert len(fake.called("route")) == 1  # before the first sync the cache has no view: the directory placed it
    assert all(r.target_replica in ("d0", "d1") for r in decode.sent)  # a target, so a lost decoder is re-placed
    assert syncer.cache.totals["sessionless_hits"] == 2 and state.totals["plan_sessionless_at_ingress"] == 2

    with_prefill = PoolBackend(decode, FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(1))), fake, pins=ShardedPins([syncer], fake))
    run_turns(with_prefill, syncer, [sessionless(6)])
    assert len(fake.called("route")) == 2  # a prefill pool: the directory decides on a remote prefill


def test_a_decoder_lost_before_the_first_token_of_a_sessionless_turn_is_replaced_away_from_it() -> None:
    state = directory("colocated")
    sent: list[str | None] = []

    def script(req: GenerationRequest) -> FakeResponseStream:
        sent.append(req.target_replica)
        if len(sent) == 2:  # the second turn (placed from the cache) meets a dead decoder
            return FakeResponseStream(scripted_deltas(2), error=rx.ActorDiedError(), error_after=0)
        return FakeResponseStream(scripted_deltas(2, replica=req.target_replica))

    backend, syncer, fake = backend_over(state, FakePoolHandle(script))
    run_turns(backend, syncer, [sessionless(3), sessionless(4)])
    assert fake.called("replica_failed") == [(sent[1],)] and sent[2] not in (None, sent[1])
