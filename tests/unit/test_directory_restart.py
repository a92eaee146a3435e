"""The directory across restarts (router/directory_state.py over router/ownership.py): ownership
is durable and outlives pins; a fresh directory rebuilds its pins from the decoders' reports, so a
returning conversation goes back to its decoder ("pinned", no second handoff); only the owner
ends a conversation. Every state is checked with check_integrity() when its test ends."""
from __future__ import annotations

from pathlib import Path

import pytest
from directory_fixtures import TTL, MakeState, make_state, rep, up

from router.directory_state import DirectorySettings, DirectoryState, ForeignConversation, PinsRebuilding
from router.ownership import Claim, KnownOwners, OwnershipStore
from router.policy import TurnPlan

__all__ = ["make_state"]  # the fixture, used by name


def restarted(path: Path, policy: str = "conversation", **settings: float) -> DirectoryState:
    """A directory as a (re)started replica builds it: a fresh state over the ownership file."""
    return DirectoryState(DirectorySettings(policy=policy, conversation_ttl_s=TTL, **settings),  # type: ignore[arg-type]
                          KnownOwners(OwnershipStore(path)))


# ---- ownership -------------------------------------------------------------------------------------------


def test_a_conversation_stays_its_owners_after_its_pin_expires(make_state: MakeState) -> None:
    state = make_state("colocated")
    up(state, 0.0, "d0", prefill=())
    state.route("conv", "ana", 10, now=0.0)
    assert state.expire(TTL + 1) == ["conv"] and state.pin_of("conv") is None
    up(state, TTL + 1, "d0", prefill=())
    with pytest.raises(ForeignConversation):
        state.route("conv", "bob", 10, now=TTL + 1)
    assert state.pin_of("conv") is None  # the refused turn pinned nothing
    assert state.route("conv", "ana", 10, now=TTL + 2).reason == "new"  # the owner goes on (a new pin)
    assert state.totals["foreign_session_refused"] == 1


def test_a_restarted_directory_still_refuses_another_user(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    first = restarted(path)
    up(first, 0.0, "d0")
    first.route("conv", "ana", 10, now=0.0)
    first.route("anon", None, 10, now=0.0)
    second = restarted(path)  # the directory died: nothing in memory survives, the file does
    up(second, 1.0, "d0")
    for sid, stranger in (("conv", "bob"), ("conv", None), ("anon", "bob")):
        with pytest.raises(ForeignConversation):
            second.route(sid, stranger, 10, now=1.0)
    assert second.route("conv", "ana", 10, now=1.0).decode_replica == "d0"
    assert second.route("anon", None, 10, now=1.0).decode_replica == "d0"
    second.check_integrity()


class CountingStore(OwnershipStore):
    def __init__(self) -> None:
        super().__init__(":memory:")
        self.claimed: list[str] = []

    def claim(self, session_id: str, user: str | None) -> Claim:
        self.claimed.append(session_id)
        return super().claim(session_id, user)


def test_known_owners_are_not_claimed_in_the_file_again() -> None:
    store = CountingStore()
    state = DirectoryState(DirectorySettings(policy="colocated"), KnownOwners(store))
    up(state, 0.0, "d0", prefill=())
    for i in range(5):
        state.route("conv", "ana", 10, now=float(i))
    state.route("other", "ana", 10, now=6.0)
    assert store.claimed == ["conv", "other"]  # one claim per conversation, not one per turn
    state.check_integrity()


def test_only_the_owner_ends_a_conversation_and_its_id_is_free_again(make_state: MakeState) -> None:
    state = make_state("colocated")
    up(state, 0.0, "d0", prefill=())
    state.route("conv", "ana", 10, now=0.0)
    assert not state.end_conversation("conv", "bob") and state.pin_of("conv") is not None
    assert not state.end_conversation("nobody's", "ana")
    assert state.end_conversation("conv", "ana") and state.pin_of("conv") is None
    assert not state.end_conversation("conv", "ana")  # already ended
    assert state.route("conv", "bob", 10, now=1.0).reason == "new"  # bob may open it now
    with pytest.raises(ForeignConversation):
        state.route("conv", "ana", 10, now=2.0)
    assert state.totals["ended"] == 1


# ---- pins rebuilt from the decoders' reports ---------------------------------------------------------------


def test_a_returning_conversation_goes_back_to_its_decoder_after_a_restart(tmp_path: Path) -> None:
    """conversation policy, two decoders: turn 1 handed off to some decoder; the directory restarts;
    the decoders report what they hold; turn 2 is pinned there, prefilled locally (no 2nd handoff)."""
    path = tmp_path / "conversations.sqlite3"
    first = restarted(path)
    up(first, 0.0, "d0", "d1")
    plans = {sid: first.route(sid, "ana", 100, now=0.0) for sid in ("a", "b", "c")}
    assert all(p.remote_prefill for p in plans.values())
    held = {d: tuple((sid, 5.0) for sid, p in plans.items() if p.decode_replica == d) for d in ("d0", "d1")}
    second = restarted(path)
    for d in ("d0", "d1"):
        second.report(rep(d, "decode", conversations=held[d]), 10.0)
    second.report(rep("p0", "prefill"), 10.0)
    for sid, before in plans.items():
        plan = second.route(sid, "ana", 150, now=11.0)
        assert plan == TurnPlan(before.decode_replica, remote_prefill=False, reason="pinned")
    assert second.totals["pins_adopted"] == 3 and second.totals["planned_handoffs"] == 0
    pin = second.pin_of("a")
    assert pin is not None and (pin.user, pin.created, pin.adopted) == ("ana", 5.0, False)
    second.check_integrity()


def test_a_live_pin_is_never_overridden_by_a_report(make_state: MakeState) -> None:
    state = make_state("colocated")
    up(state, 0.0, "d0", "d1", prefill=())
    decoder = state.route("conv", "ana", 10, now=1.0).decode_replica
    other = "d1" if decoder == "d0" else "d0"
    state.report(rep(other, "decode", conversations=(("conv", 0.0),)), 5.0)  # even a more recent claim
    pin = state.pin_of("conv")
    assert pin is not None and pin.decoder == decoder and state.totals["pins_adopted"] == 0


def test_of_two_decoders_claiming_a_conversation_the_one_that_served_it_last_wins(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    first = restarted(path, "colocated")
    up(first, 0.0, "d0", prefill=())
    first.route("conv", "ana", 10, now=0.0)
    fresh = restarted(path, "colocated")
    fresh.report(rep("d0", "decode", conversations=(("conv", 30.0),)), 100.0)
    fresh.report(rep("d1", "decode", conversations=(("conv", 10.0),)), 100.0)  # served it later: wins
    fresh.report(rep("d0", "decode", conversations=(("conv", 31.0),)), 101.0)  # older again: ignored
    pin = fresh.pin_of("conv")
    assert pin is not None and (pin.decoder, pin.last_seen, pin.adopted) == ("d1", 90.0, True)
    assert fresh.route("conv", "ana", 10, now=102.0) == TurnPlan("d1", remote_prefill=False, reason="pinned")
    fresh.check_integrity()


def test_reports_adopt_only_owned_recent_conversations_of_decoders(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    first = restarted(path)
    up(first, 0.0, "d0")
    for sid in ("recent", "stale", "ended", "on-prefill"):
        first.route(sid, "ana", 10, now=0.0)
    assert first.end_conversation("ended", "ana")
    second = restarted(path)
    second.report(rep("d0", "decode", conversations=(("recent", 1.0), ("stale", TTL + 1), ("ended", 1.0), ("never-opened", 1.0))), 5000.0)
    second.report(rep("p0", "prefill", conversations=(("on-prefill", 1.0),)), 5000.0)
    assert [sid for sid in ("recent", "stale", "ended", "never-opened", "on-prefill") if second.pin_of(sid)] == ["recent"]
    # an adopted pin expires from when its decoder last served it (5000 - 1), not from the report
    assert second.expire(4999.0 + TTL) == []
    assert second.expire(4999.0 + TTL + 0.1) == ["recent"]
    second.check_integrity()


def test_a_full_directory_adopts_nothing(make_state: MakeState) -> None:
    state = make_state("colocated", max_conversations=1)
    up(state, 0.0, "d0", prefill=())
    state.route("a", None, 10, now=0.0)
    state.route("b", None, 10, now=1.0)  # evicts a
    state.report(rep("d0", "decode", conversations=(("a", 0.0),)), 2.0)
    assert state.pin_of("a") is None and state.pin_of("b") is not None


def test_server_made_realtime_sessions_are_pinned_but_never_written_to_the_store(tmp_path: Path) -> None:
    store = OwnershipStore(tmp_path / "own.db")
    state = DirectoryState(DirectorySettings(policy="colocated", conversation_ttl_s=TTL), KnownOwners(store))
    up(state, 0.0, "d0", prefill=())
    first = state.route("rt-1", None, 10, now=0.0, owned=False)
    assert state.route("rt-1", None, 10, now=1.0, owned=False) == TurnPlan(first.decode_replica, remote_prefill=False, reason="pinned")
    assert store.count() == 0
    state.check_integrity()


def test_a_returning_conversation_waits_for_its_decoders_report_instead_of_moving(tmp_path: Path) -> None:
    """Right after a restart one decoder has reported and the other has not: a conversation whose
    decoder is the silent one is refused (503 + Retry-After upstream) until the report restores
    its pin, instead of being placed anew (a second handoff). New conversations are not held."""
    path = tmp_path / "conversations.sqlite3"
    first = restarted(path)
    up(first, 0.0, "d0", "d1")
    plans = {sid: first.route(sid, "ana", 100, now=0.0) for sid in ("a", "b", "c", "d")}
    on_d1 = [sid for sid, p in plans.items() if p.decode_replica == "d1"]
    assert on_d1, plans
    held = {d: tuple((sid, 1.0) for sid, p in plans.items() if p.decode_replica == d) for d in ("d0", "d1")}

    second = DirectoryState(DirectorySettings(policy="conversation", conversation_ttl_s=TTL, rebuild_grace_s=2.0),
                            KnownOwners(OwnershipStore(path)))
    second.report(rep("d0", "decode", conversations=held["d0"]), 10.0)  # d1 has not reported yet
    second.report(rep("p0", "prefill"), 10.0)
    with pytest.raises(PinsRebuilding):
        second.route(on_d1[0], "ana", 150, now=10.5)
    assert second.route("brand-new", "ana", 150, now=10.5).reason == "new"  # nothing to wait for
    with pytest.raises(ForeignConversation):  # ownership is still checked first
        second.route(on_d1[0], "bob", 150, now=10.5)
    second.report(rep("d1", "decode", conversations=held["d1"]), 11.0)
    assert second.route(on_d1[0], "ana", 150, now=11.2) == TurnPlan("d1", remote_prefill=False, reason="pinned")
    assert second.totals["rebuild_wait_refused"] == 1
    second.check_integrity()


def test_after_the_grace_a_conversation_nobody_reported_is_placed_anew(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    first = restarted(path)
    up(first, 0.0, "d0")
    first.route("gone", "ana", 100, now=0.0)
    second = DirectoryState(DirectorySettings(policy="colocated", conversation_ttl_s=TTL, rebuild_grace_s=2.0),
                            KnownOwners(OwnershipStore(path)))
    up(second, 10.0, "d1", prefill=())  # the decoder that held it is gone
    with pytest.raises(PinsRebuilding):
        second.route("gone", "ana", 100, now=11.0)
    assert second.route("gone", "ana", 100, now=12.5) == TurnPlan("d1", remote_prefill=False, reason="new")


def test_a_long_list_is_adopted_in_parts_with_owners_read_beforehand(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    first = restarted(path)
    up(first, 0.0, "d0", "d1")
    for i in range(6):
        first.route(f"c{i}", "ana", 10, now=0.0)
    second = restarted(path)
    held = tuple((f"c{i}", 1.0) for i in range(6)) + (("nobody", 1.0),)
    report = rep("d0", "decode", conversations=held)
    candidates = second.adoption_candidates(report, 2.0)
    assert candidates == [sid for sid, _ in held]  # nothing pinned yet: every one is asked
    owners = {f"c{i}": "ana" for i in range(6)}  # as a Lookup answered them ("nobody" has no owner)
    second.report(report, 2.0, {sid: owners[sid] for sid in ("c0", "c1")})  # stored, the first part adopted
    assert [second.pin_of(f"c{i}") is not None for i in range(6)] == [True, True] + [False] * 4
    assert second.adoption_candidates(report, 2.0) == ["c2", "c3", "c4", "c5", "nobody"]  # what is adopted is not asked again
    assert second.adopt(rep("d0", "decode", conversations=held[2:4]), 2.0, owners) == 2
    second.replica_failed("d0", 2.5)  # the decoder failed between two parts: the rest is not adopted onto it
    assert second.adopt(rep("d0", "decode", conversations=held[4:]), 3.0, owners) == 0
    assert second.adopt(rep("d9", "decode", conversations=held[4:]), 3.0, owners) == 0  # a replica never stored
    assert second.totals["pins_adopted"] == 4 and second.pin_of("nobody") is None
    second.check_integrity()
