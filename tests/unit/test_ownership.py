"""router/ownership.py: conversation ownership survives restarts (a reopened file), and only the
owner may continue or end a conversation."""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from router.ownership import Claim, OwnershipStore


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
