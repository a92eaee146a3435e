"""Reports carry deltas of the conversations a decoder holds (deployments/replica_report.HeldConversations
.delta), the directory keeps a copy from them (router/held_mirror.py) and asks for the complete list
when its copy is not exact; the shards' client sends it (deployments/directory_client.py). No Ray."""
from __future__ import annotations

import asyncio
import random
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from directory_fixtures import rep, up
from fakes import FakeDirectoryHandle

from deployments.replica_report import HeldConversations
from router.directory_state import DirectorySettings, DirectoryState
from router.held_mirror import HeldMirror
from router.ownership import KnownOwners, OwnershipStore
from router.report import MAX_REPORTED_CONVERSATIONS, ReplicaReport

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.directory_client import DirectoryShards


def delta_report(held: HeldConversations, now: float, rid: str = "d0") -> ReplicaReport:
    seq, served, dropped = held.delta(now)
    return ReplicaReport(rid, "decode", conversations=served, conversations_complete=False, seq=seq, dropped=dropped)


def complete_report(held: HeldConversations, now: float, rid: str = "d0") -> ReplicaReport:
    return ReplicaReport(rid, "decode", conversations=held.recent(now), seq=held.seq)


def held_ids(held: HeldConversations) -> set[str]:
    return {sid for sid, _ in held.recent(0.0)}


# ---- the replica's side ------------------------------------------------------------------------------


def test_a_delta_lists_what_was_served_and_dropped_since_the_previous_one() -> None:
    held = HeldConversations(capacity=2)
    held.served("a", 1.0)
    held.served("b", 2.0)
    assert held.delta(3.0) == (1, (("b", 1.0), ("a", 2.0)), ())
    held.served("c", 4.0)  # "a" falls out of the LRU
    assert held.delta(5.0) == (2, (("c", 1.0),), ("a",))
    held.served("d", 6.0)  # "b" falls out ...
    held.served("b", 7.0)  # ... and is served again: held, so not dropped ("c" falls out instead)
    assert held.delta(8.0) == (3, (("b", 1.0), ("d", 2.0)), ("c",))
    assert held.delta(9.0) == (4, (), ())  # nothing changed: an empty delta, still numbered
    held.check_integrity()


def test_a_delta_report_must_be_numbered_and_drop_only_what_it_does_not_list() -> None:
    with pytest.raises(ValueError, match="seq"):
        ReplicaReport("d0", "decode", conversations_complete=False, seq=0)
    with pytest.raises(ValueError, match="dropped"):
        ReplicaReport("d0", "decode", conversations=(("a", 0.0),), conversations_complete=False, seq=1, dropped=("a",))
    with pytest.raises(ValueError, match="dropped"):
        ReplicaReport("d0", "decode", dropped=("a",))  # a complete list drops nothing
    assert "seq" not in rep("d0", "decode").figures() and "dropped" not in rep("d0", "decode").figures()


# ---- the directory's copy -----------------------------------------------------------------------------


def test_in_order_deltas_keep_the_copy_exact_without_asking() -> None:
    held, mirror = HeldConversations(capacity=3), HeldMirror()
    assert mirror.apply(complete_report(held, 0.0), 0.0) is False and mirror.exact("d0")
    for step, sid in enumerate(["a", "b", "c", "d", "a", "e"], start=1):
        held.served(sid, float(step))
        assert mirror.apply(delta_report(held, step + 0.5), step + 0.5) is False
        assert {s for s in "abcde" if mirror.holds("d0", s)} == held_ids(held)
    mirror.check_integrity()


def test_a_fresh_directory_asks_once_and_keeps_what_the_delta_said_meanwhile() -> None:
    held, mirror = HeldConversations(), HeldMirror()
    for sid in ("old-1", "old-2"):
        held.served(sid, 0.0)
    held.delta(0.5)  # the previous directory got this one
    held.served("new", 1.0)
    assert mirror.apply(delta_report(held, 1.5), 1.5) is True and not mirror.exact("d0")
    assert mirror.holds("d0", "new") and not mirror.holds("d0", "old-1")
    assert mirror.apply(complete_report(held, 1.6), 1.6) is False and mirror.exact("d0")
    assert all(mirror.holds("d0", s) for s in ("old-1", "old-2", "new"))
    held.served("next", 2.0)
    assert mirror.apply(delta_report(held, 2.5), 2.5) is False and mirror.holds("d0", "next")


def test_a_lost_delta_is_noticed_and_an_overtaken_one_ignored() -> None:
    held, mirror = HeldConversations(capacity=1), HeldMirror()
    mirror.apply(complete_report(held, 0.0), 0.0)
    held.served("a", 1.0)
    first = delta_report(held, 1.5)
    held.served("b", 2.0)  # drops "a"
    second = delta_report(held, 2.5)
    assert mirror.apply(second, 2.5) is True  # seq 2 after seq 0: the first is missing
    assert mirror.apply(complete_report(held, 2.6), 2.6) is False
    assert mirror.apply(first, 2.7) is False  # delivered late: older than what the copy has
    assert mirror.holds("d0", "b") and not mirror.holds("d0", "a")


def test_the_copy_stays_bounded_when_drops_were_missed() -> None:
    mirror = HeldMirror()
    mirror.apply(rep("d0", "decode"), 0.0)
    many = tuple((f"s{i}", float(MAX_REPORTED_CONVERSATIONS + 10 - i)) for i in range(MAX_REPORTED_CONVERSATIONS + 10))
    first = ReplicaReport("d0", "decode", conversations=many[:MAX_REPORTED_CONVERSATIONS], conversations_complete=False, seq=1)
    assert mirror.apply(first, 10_000.0) is False
    rest = ReplicaReport("d0", "decode", conversations=many[MAX_REPORTED_CONVERSATIONS:], conversations_complete=False, seq=2)
    assert mirror.apply(rest, 10_000.0) is True  # more than a replica can hold: some drops never arrived
    assert mirror.held_count("d0") == MAX_REPORTED_CONVERSATIONS and mirror.holds("d0", many[-1][0]) and not mirror.holds("d0", "s0")
    mirror.check_integrity()


@pytest.mark.parametrize("seed", range(5))
def test_with_reports_lost_at_random_the_copy_is_exact_again_after_each_answered_ask(seed: int) -> None:
    rng = random.Random(seed)
    held, mirror = HeldConversations(capacity=20), HeldMirror()
    now, asks = 0.0, 0
    for _ in range(300):
        for _ in range(rng.randrange(4)):
            now += 0.01
            held.served(f"s{rng.randrange(60)}", now)
        now += 0.1
        report = delta_report(held, now)
        if rng.random() < 0.2:
            continue  # lost in flight
        if mirror.apply(report, now):
            asks += 1
            mirror.apply(complete_report(held, now), now)
        assert mirror.exact("d0") and {f"s{i}" for i in range(60) if mirror.holds("d0", f"s{i}")} == held_ids(held)
        held.check_integrity()
    assert asks > 10  # the losses were noticed, not only absorbed


# ---- the directory state and the shards' client -------------------------------------------------------


def test_a_restarted_directory_adopts_from_deltas_and_its_complete_lists_and_says_resident_from_its_copy(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    first = DirectoryState(DirectorySettings(policy="colocated"), KnownOwners(OwnershipStore(path)))
    up(first, 0.0, "d0", "d1", prefill=())
    on = {sid: first.route(sid, "ana", 10, 0.0).decode_replica for sid in ("old", "new")}
    held = {d: HeldConversations() for d in ("d0", "d1")}
    held[on["old"]].served("old", 0.5)
    for d in held:
        held[d].delta(0.6)  # delivered to the first directory
    held[on["new"]].served("new", 1.0)
    second = DirectoryState(DirectorySettings(policy="colocated"), KnownOwners(OwnershipStore(path)))
    asked = [second.report(delta_report(held[d], 2.0, d), 2.0) for d in ("d0", "d1")]
    assert asked == [True, True]  # neither decoder's complete list is known to the fresh directory
    assert second.pin_of("new").decoder == on["new"] and second.pin_of("old") is None  # type: ignore[union-attr]
    assert [second.report(complete_report(held[d], 2.1, d), 2.1) for d in ("d0", "d1")] == [False, False]
    assert second.pin_of("old").decoder == on["old"]  # type: ignore[union-attr]
    assert second.totals["pins_adopted"] == 2 and second.totals["complete_lists_asked"] == 2
    for sid in ("old", "new"):
        info = second.describe(sid, "ana", 2.2)
        assert info is not None and info.resident
    held[on["old"]].served("other", 3.0)
    for _ in range(MAX_REPORTED_CONVERSATIONS):  # "old" falls out of its decoder's LRU
        held[on["old"]].served(f"x{_}", 3.0)
    assert second.report(delta_report(held[on["old"]], 4.0, on["old"]), 4.0) is False
    info = second.describe("old", "ana", 4.0)
    assert info is not None and not info.resident
    second.check_integrity()


def test_a_shard_that_asks_gets_the_complete_list_and_the_others_do_not() -> None:
    fresh = DirectoryState(DirectorySettings(policy="colocated", shards=2, shard=0))
    known = DirectoryState(DirectorySettings(policy="colocated", shards=2, shard=1))
    held = HeldConversations()
    held.served("c1", 0.0)
    known.report(complete_report(held, 0.1), 0.1)
    handles = [FakeDirectoryHandle(state=fresh, clock=lambda: 1.0), FakeDirectoryHandle(state=known, clock=lambda: 1.0)]
    directory = DirectoryShards(handles)
    held.served("c2", 0.5)
    report = delta_report(held, 1.0)

    async def go() -> None:
        directory.report(report, lambda: replace(complete_report(held, 1.0), seq=held.seq))
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(go())
    sent = [[r for (r,) in h.called("report")] for h in handles]
    assert [r.conversations_complete for r in sent[0]] == [False, True] and sent[0][1].seq == report.seq
    assert [r.conversations_complete for r in sent[1]] == [False]
    assert fresh.totals["complete_lists_asked"] == 1 and known.totals.get("complete_lists_asked", 0) == 0
