"""router/ownership.py: conversation ownership survives restarts (a reopened file), and only the
owner may continue or end a conversation."""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from router.ownership import Claim, KnownOwners, OwnershipStore


def test_first_claim_opens_and_later_claims_tell_owner_from_stranger(tmp_path: Path) -> None:
    s = OwnershipStore(tmp_path / "own.db", clock=lambda: 5.0)
    assert s.claim("conv-1", "ana") is Claim.OPENED
    assert s.claim("conv-1", "ana") is Claim.OWNED
    assert s.claim("conv-1", "bob") is Claim.FOREIGN
    assert s.claim("conv-1", None) is Claim.FOREIGN
    owner = s.owner("conv-1")
    assert owner is not None and (owner.user, owner.opened) == ("ana", 5.0)


def test_ownership_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "own.db"
    a = OwnershipStore(path)
    a.claim("conv-1", "ana")
    a.close()
    b = OwnershipStore(path)  # a new directory replica on the same file
    assert b.claim("conv-1", "bob") is Claim.FOREIGN
    assert b.claim("conv-1", "ana") is Claim.OWNED
    assert b.count() == 1


def test_anonymous_conversations_stay_anonymous(tmp_path: Path) -> None:
    s = OwnershipStore(tmp_path / "own.db")
    assert s.claim("c", None) is Claim.OPENED
    assert s.claim("c", "") is Claim.OWNED
    assert s.claim("c", "ana") is Claim.FOREIGN


def test_only_the_owner_can_forget(tmp_path: Path) -> None:
    s = OwnershipStore(tmp_path / "own.db")
    s.claim("c", "ana")
    assert not s.forget("c", "bob") and s.owner("c") is not None
    assert s.forget("c", "ana") and s.owner("c") is None
    assert not s.forget("c", "ana")
    assert s.claim("c", "bob") is Claim.OPENED  # an ended conversation's id is free again


def test_concurrent_claims_have_exactly_one_winner(tmp_path: Path) -> None:
    s = OwnershipStore(tmp_path / "own.db")
    results: list[Claim] = []
    barrier = threading.Barrier(8)

    def claim(user: str) -> None:
        barrier.wait()
        results.append(s.claim("hot", user))

    threads = [threading.Thread(target=claim, args=(f"u{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.value for r in results).count("opened") == 1
    assert results.count(Claim.FOREIGN) == 7


def test_empty_session_id_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        OwnershipStore(tmp_path / "own.db").claim("", "ana")


def test_an_unknown_schema_refuses_to_open(tmp_path: Path) -> None:
    path = tmp_path / "own.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 7")
    db.close()
    with pytest.raises(RuntimeError, match="schema 7"):
        OwnershipStore(path)


# ---- KnownOwners: the directory's cache in front of the file ----------------------------------------------


class FileCalls(OwnershipStore):
    """An in-memory store that counts the calls that reach it."""

    def __init__(self) -> None:
        super().__init__(":memory:")
        self.calls: list[tuple[str, str]] = []

    def claim(self, session_id: str, user: str | None) -> Claim:
        self.calls.append(("claim", session_id))
        return super().claim(session_id, user)

    def owner(self, session_id: str):  # type: ignore[no-untyped-def]
        self.calls.append(("owner", session_id))
        return super().owner(session_id)


def test_known_owners_answer_from_memory_after_the_first_claim() -> None:
    store = FileCalls()
    owners = KnownOwners(store)
    assert owners.claim("c", "ana") is Claim.OPENED
    assert [owners.claim("c", who) for who in ("ana", "bob", None)] == [Claim.OWNED, Claim.FOREIGN, Claim.FOREIGN]
    assert owners.owner("c") == "ana"
    assert store.calls == [("claim", "c")]


def test_known_owners_read_the_file_for_conversations_opened_before_they_started() -> None:
    store = FileCalls()
    store.claim("old", "ana")
    owners = KnownOwners(store)  # a restarted directory: its cache is empty, the file is not
    assert owners.claim("old", "bob") is Claim.FOREIGN  # a stranger's attempt is not cached ...
    assert owners.claim("old", "ana") is Claim.OWNED  # ... the owner's is
    assert owners.claim("old", "ana") is Claim.OWNED
    assert owners.owner("nobody's") is None
    assert store.calls == [("claim", "old"), ("claim", "old"), ("claim", "old"), ("owner", "nobody's")]


def test_known_owners_are_a_bounded_lru_and_forgetting_drops_the_entry() -> None:
    store = FileCalls()
    owners = KnownOwners(store, capacity=2)
    for sid in ("a", "b"):
        owners.claim(sid, "ana")
    owners.claim("a", "ana")  # a is now the most recent
    owners.claim("c", "ana")  # evicts b
    assert len(owners) == 2 and owners.cached("b") is None and owners.cached("a") == "ana"
    assert owners.claim("b", "bob") is Claim.FOREIGN  # evicted from memory, still owned in the file
    assert not owners.forget("a", "bob") and owners.cached("a") == "ana"
    assert owners.forget("a", "ana") and owners.cached("a") is None and store.owner("a") is None
    assert owners.claim("a", "bob") is Claim.OPENED
    with pytest.raises(ValueError):
        KnownOwners(store, capacity=0)
