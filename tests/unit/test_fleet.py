"""The directory's view of its replicas (router/fleet.py): the live lists and decoder loads it keeps
between changes must equal what a fresh computation gives, whatever happens in between: reports,
failures, staleness, turns routed and pins changing. No Ray."""
from __future__ import annotations

import random

import pytest
from directory_fixtures import rep

from router.directory_loads import decoder_loads
from router.directory_state import DirectorySettings, DirectoryState
from router.fleet import Fleet
from router.pin_cache import Touch
from router.pin_table import PinTable


def ids(reports: list) -> list[str]:
    return [r.replica_id for r in reports]


def test_the_live_list_follows_reports_failures_and_staleness() -> None:
    fleet = Fleet(stale_after_s=10.0, pins=None)
    fleet.store(rep("d0", "decode"), 0.0)
    fleet.store(rep("d1", "decode"), 5.0)
    fleet.store(rep("p0", "prefill"), 5.0)
    assert ids(fleet.live("decode", 6.0)) == ["d0", "d1"] and ids(fleet.live("prefill", 6.0)) == ["p0"]
    assert ids(fleet.live("decode", 10.0)) == ["d0", "d1"]  # d0 is 10 s old: still live
    assert ids(fleet.live("decode", 10.5)) == ["d1"]  # and stale past it, without any report in between
    assert ids(fleet.live("decode", 6.0)) == ["d0", "d1"]  # asked for an earlier time: computed for that time
    fleet.fail("d1", 11.0)
    assert fleet.live("decode", 11.0) == []
    assert fleet.store(rep("d1", "decode"), 12.0) is False  # sent before the failure: ignored
    assert fleet.store(rep("d1", "decode"), 21.5) is True and ids(fleet.live("decode", 21.5)) == ["d1"]
    fleet.check_integrity()


def test_a_decoder_s_load_follows_its_report_its_unreported_turns_and_its_pins() -> None:
    from router.directory_types import Pin

    pins = PinTable()
    fleet = Fleet(stale_after_s=10.0, pins=pins)
    fleet.store(rep("d0", "decode", kv=0.1), 0.0)
    fleet.store(rep("d1", "decode", kv=0.2), 0.0)

    def fresh() -> list:
        return decoder_loads(fleet.live("decode", 1.0), fleet.unreported, pins.counts(), pins.held())

    assert fleet.decoder_loads(fleet.live("decode", 1.0)) == fresh()
    fleet.count("d0", 300, 1.0)
    pins.put("c1", Pin("d1", "ana", 1.0, 1.0, prompt_tokens=500))
    loads = fleet.decoder_loads(fleet.live("decode", 1.0))
    assert loads == fresh() and (loads[0].in_flight, loads[1].pinned) == (1, 1)
    pins.hold("c1", 900)
    pins.move("c1", "d0")
    fleet.store(rep("d1", "decode", kv=0.7), 1.0)
    assert fleet.decoder_loads(fleet.live("decode", 1.0)) == fresh()
    fleet.check_integrity()


@pytest.mark.parametrize("policy", ["conversation", "colocated", "per_turn_pd", "conditional_pd"])
@pytest.mark.parametrize("seed", range(3))
def test_under_random_traffic_every_kept_view_equals_a_fresh_one(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    state = DirectoryState(DirectorySettings(policy=policy, stale_after_s=3.0, conversation_ttl_s=20.0))  # type: ignore[arg-type]
    decoders, now = [f"d{i}" for i in range(5)], 0.0
    for d in decoders:
        state.report(rep(d, "decode", kv=rng.random() * 0.5), now)
    state.report(rep("p0", "prefill"), now)
    sids = [f"c{i}" for i in range(30)]
    for _ in range(600):
        now += rng.random() * 0.2
        op = rng.random()
        if op < 0.15:
            state.report(rep(rng.choice(decoders), "decode", kv=rng.random() * 0.8, in_flight=rng.randrange(4)), now)
        elif op < 0.18:
            state.report(rep("p0", "prefill", pending_prefill_tokens=rng.randrange(5000)), now)
        elif op < 0.2:
            state.replica_failed(rng.choice(decoders), now)
        elif op < 0.3:
            sid = rng.choice(sids)
            pin = state.pin_of(sid)
            if pin is not None:
                state.sync("ingress", None, 0, [Touch(sid, "ana", pin.decoder, rng.randrange(100, 3000), now)], now)
        elif op < 0.35:
            state.served(rng.choice(sids), rng.choice(decoders), now)
        elif op < 0.37:
            state.expire(now)
        elif op < 0.39:
            state.end_conversation(rng.choice(sids), "ana")
        else:
            try:
                state.route(rng.choice(sids), "ana", rng.randrange(50, 4000), now)
            except RuntimeError:  # no live decoder right now (all failed or stale)
                pass
        state.check_integrity()  # the fleet's kept views against fresh ones, among the rest
    t = state.totals
    assert t["turns"] > 300 and t["replica_failures"] > 0 and t["pin_syncs"] > 0  # the traffic did reach every path
