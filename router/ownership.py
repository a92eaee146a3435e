"""Who owns each conversation, durably: a conversation belongs to the user who opened it, across
pin expiry, directory restarts and whole-cluster restarts.

Why SQLite (the same discipline as the memory facts, memory_store/db.py: one connection, WAL,
synchronous=FULL, one writer) and not Ray's internal KV: the internal KV lives in the GCS and
is lost with the cluster unless the GCS is backed by an external Redis, while a promise made to
a user ("nobody else can read or continue your conversation") must outlive a cluster restart.
The file sits where the directory runs (`routing.ownership_db_path`); on a multi-node cluster
put the directory on a node whose disk persists (its resources) or give it a shared path.

Schema (PRAGMA user_version = 1):
  conversations(session_id TEXT PRIMARY KEY, user TEXT NOT NULL, opened REAL NOT NULL)
`user` is "" for conversations opened without a user (keys off, no `user` field): such a
conversation is open to every caller that also names no user, as before.

Invariant: a session id is inserted once and its owner never changes until `forget` (the
explicit end of a conversation by its owner).

`KnownOwners` sits in front of the store in the directory: the owners of the conversations it
has seen since it started, so a turn of a known conversation costs no SQLite call and only the
first turn of each session id (per directory lifetime, or after it falls out of the bounded
cache) claims it in the file.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

SCHEMA_VERSION = 1
LOOKUP_CHUNK = 500  # session ids per SELECT … IN (…): under SQLite's bound-parameter limit


class Claim(Enum):
    OPENED = "opened"  # the session id was new: it now belongs to this user
    OWNED = "owned"  # it already belongs to this user
    FOREIGN = "foreign"  # it belongs to someone else (answered like an unknown conversation)


@dataclass(frozen=True)
class Write:
    """One ownership write of a group commit: claim `session_id` for `user`, or (end=True) forget it if `user` owns it."""

    session_id: str
    user: str | None
    end: bool = False


@dataclass(frozen=True)
class Lookup:
    """A read queued among the writes of a group commit: the owners of these session ids."""

    session_ids: tuple[str, ...]


@dataclass(frozen=True)
class Owner:
    session_id: str
    user: str
    opened: float


class OwnershipStore:
    """Thread-safe; every call blocks on SQLite (microseconds for a cached page)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time):
        self._path = str(path)
        if self._path != ":memory:":
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._clock = clock
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise RuntimeError(f"ownership db {self._path} has schema {version}, this code knows {SCHEMA_VERSION}")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS conversations (session_id TEXT PRIMARY KEY, user TEXT NOT NULL, opened REAL NOT NULL)"
            )
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def claim(self, session_id: str, user: str | None) -> Claim:
        """Open the conversation for `user` if nobody owns it, else say whose it is. Atomic."""
        if not session_id:
            raise ValueError("session id must be non-empty")
        with self._lock:
            return self._claim_row(session_id, user or "", self._clock())

    def write_many(self, writes: Sequence[Write | Lookup]) -> list[Claim | bool | dict[str, str]]:
        """Each write in order (a claim answers a Claim, an end as `forget` a bool, a Lookup the
        owners it found by session id) in ONE transaction: one write to disk (one fsync under
        synchronous=FULL) for the whole batch, which is what lets the directory commit them in
        groups (router/claim_batch.py). A later write sees the earlier ones: a session id claimed
        twice, the second sees the first's owner; ended then claimed, it opens anew; a Lookup sees
        every write before it. All or nothing: on an error none is committed."""
        if any(isinstance(w, Write) and not w.session_id for w in writes):
            raise ValueError("session id must be non-empty")
        out: list[Claim | bool | dict[str, str]] = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = self._clock()
                out = [self._owner_rows(w.session_ids) if isinstance(w, Lookup) else self._forget_row(w.session_id, w.user or "")
                       if w.end else self._claim_row(w.session_id, w.user or "", now) for w in writes]
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # a failed COMMIT may have ended it already
                    self._db.execute("ROLLBACK")
                raise
        return out

    def _claim_row(self, session_id: str, who: str, now: float) -> Claim:
        """One claim's statements; the caller holds the lock (and the transaction, if any)."""
        cur = self._db.execute("INSERT OR IGNORE INTO conversations (session_id, user, opened) VALUES (?, ?, ?)", (session_id, who, now))
        if cur.rowcount == 1:
            return Claim.OPENED
        (owner,) = self._db.execute("SELECT user FROM conversations WHERE session_id = ?", (session_id,)).fetchone()
        return Claim.OWNED if owner == who else Claim.FOREIGN

    def _owner_rows(self, session_ids: Sequence[str]) -> dict[str, str]:
        """The owners of those that have one, a few hundred ids per statement; the caller holds the lock."""
        found: dict[str, str] = {}
        for i in range(0, len(session_ids), LOOKUP_CHUNK):
            chunk = session_ids[i:i + LOOKUP_CHUNK]
            marks = ",".join("?" * len(chunk))
            found.update(self._db.execute(f"SELECT session_id, user FROM conversations WHERE session_id IN ({marks})", chunk).fetchall())
        return found

    def owner(self, session_id: str) -> Owner | None:
        with self._lock:
            row = self._db.execute("SELECT user, opened FROM conversations WHERE session_id = ?", (session_id,)).fetchone()
        return Owner(session_id, row[0], row[1]) if row else None

    def forget(self, session_id: str, user: str | None) -> bool:
        """End a conversation: only its owner may; True when it existed and was theirs."""
        with self._lock:
            return self._forget_row(session_id, user or "")

    def _forget_row(self, session_id: str, who: str) -> bool:
        """One end's statement; the caller holds the lock (and the transaction, if any)."""
        return self._db.execute("DELETE FROM conversations WHERE session_id = ? AND user = ?", (session_id, who)).rowcount == 1

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


class KnownOwners:
    """The owner ("" = anonymous) of each conversation seen lately, in front of an OwnershipStore.

    Only what the store said is cached (an opened or owned claim, a looked-up owner), so the
    cache never disagrees with the file while this process is its only writer. Bounded LRU:
    a forgotten entry costs one more read of the file, never a wrong answer."""

    def __init__(self, store: OwnershipStore, capacity: int = 100_000):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.store = store
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def claim(self, session_id: str, user: str | None) -> Claim:
        """As OwnershipStore.claim, without touching the file for a conversation seen lately."""
        known = self.known(session_id, user)
        if known is not None:
            return known
        claim = self.store.claim(session_id, user)
        self.claimed(session_id, user, claim)
        return claim

    def known(self, session_id: str, user: str | None) -> Claim | None:
        """The claim's answer from the cache alone (OWNED or FOREIGN); None: the file must be asked."""
        known = self._owners.get(session_id)
        if known is None:
            return None
        self._owners.move_to_end(session_id)
        return Claim.OWNED if known == (user or "") else Claim.FOREIGN

    def claimed(self, session_id: str, user: str | None, claim: Claim) -> None:
        """Cache what the store answered to a claim (made here or by a group commit)."""
        if claim is not Claim.FOREIGN:  # a stranger's attempt is rare: it is not worth a second read
            self._remember(session_id, user or "")

    def owner(self, session_id: str) -> str | None:
        """The owner ("" = anonymous), or None when nobody owns the session id."""
        known = self._owners.get(session_id)
        if known is not None:
            self._owners.move_to_end(session_id)
            return known
        row = self.store.owner(session_id)
        if row is None:
            return None
        self._remember(session_id, row.user)
        return row.user

    def forget(self, session_id: str, user: str | None) -> bool:
        """End the conversation if `user` owns it (the store decides); True when it did."""
        if not self.store.forget(session_id, user):
            return False
        self.forgotten(session_id)
        return True

    def found(self, owners: dict[str, str]) -> None:
        """Cache owners the store answered to a Lookup (router/claim_batch.py)."""
        for sid, who in owners.items():
            self._remember(sid, who)

    def forgotten(self, session_id: str) -> None:
        """The store ended the conversation (here or in a group commit): drop its cached owner."""
        self._owners.pop(session_id, None)

    def cached(self, session_id: str) -> str | None:
        """The cached owner, without reading the file (for invariant checks)."""
        return self._owners.get(session_id)

    def __len__(self) -> int:
        return len(self._owners)

    def _remember(self, session_id: str, who: str) -> None:
        self._owners[session_id] = who
        self._owners.move_to_end(session_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)
