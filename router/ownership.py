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
"""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

SCHEMA_VERSION = 1


class Claim(Enum):
    OPENED = "opened"  # the session id was new: it now belongs to this user
    OWNED = "owned"  # it already belongs to this user
    FOREIGN = "foreign"  # it belongs to someone else (answered like an unknown conversation)


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
        who = user or ""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO conversations (session_id, user, opened) VALUES (?, ?, ?)", (session_id, who, self._clock())
            )
            if cur.rowcount == 1:
                return Claim.OPENED
            (owner,) = self._db.execute("SELECT user FROM conversations WHERE session_id = ?", (session_id,)).fetchone()
        return Claim.OWNED if owner == who else Claim.FOREIGN

    def owner(self, session_id: str) -> Owner | None:
        with self._lock:
            row = self._db.execute("SELECT user, opened FROM conversations WHERE session_id = ?", (session_id,)).fetchone()
        return Owner(session_id, row[0], row[1]) if row else None

    def forget(self, session_id: str, user: str | None) -> bool:
        """End a conversation: only its owner may; True when it existed and was theirs."""
        with self._lock:
            cur = self._db.execute("DELETE FROM conversations WHERE session_id = ? AND user = ?", (session_id, user or ""))
        return cur.rowcount == 1

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
