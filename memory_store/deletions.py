"""The deletion log: every deleted fact's id, numbered by an epoch that only grows.

Engine replicas keep encoded KV of facts in their own LRU (memory_store/resolver.py); this log is
how each of them learns what to purge, whenever it next gets through to the store -- so a replica
that was down or unreachable when a fact was deleted still purges it. FactStore appends to the log
in the same transaction as the delete, and the epoch is SQLite's AUTOINCREMENT rowid: it survives
restarts and is never reused.

A replica holds a cursor (the store's id, the last epoch it applied) and asks what came after
(`since`). Bounded: the log keeps the newest MAX_ENTRIES ids (meta 'deletions_pruned_through' is the
last epoch pruned). A cursor from another store (a new database file), ahead of the log or older than
what it keeps gets reset=True: drop everything cached -- the one answer that is always correct --
with the newest deletions listed, so requests in flight across the reset do not cache them again.

Schema (memory_store/db.py applies it as version 2): deletions, below.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

MAX_ENTRIES = 100_000
PAGE = 4096

SCHEMA = """
CREATE TABLE deletions (
    epoch INTEGER PRIMARY KEY AUTOINCREMENT,
    fact_id TEXT NOT NULL,
    deleted_at REAL NOT NULL
)
"""


@dataclass(frozen=True)
class DeletionFeed:
    """What a replica must purge to catch up with the store's deletions."""

    store_id: str
    cursor: int  # the epoch the replica has applied once it has applied this feed
    fact_ids: tuple[str, ...] = ()  # deleted after the old cursor (with reset: the newest deletions)
    reset: bool = False  # the cursor cannot be continued: drop every cached segment
    more: bool = False  # a page only: ask again from `cursor`

    def __post_init__(self) -> None:
        if self.reset and self.more:
            raise ValueError("a reset feed is whole")
        if self.cursor < 0 or not self.store_id:
            raise ValueError("a feed names its store and a cursor >= 0")


def record(db: sqlite3.Connection, fact_ids: Sequence[str], now: float, keep: int = MAX_ENTRIES) -> None:
    """Append deleted ids and prune the log to its newest `keep` entries. Call inside the
    transaction that deletes the facts."""
    if not fact_ids:
        return
    db.executemany("INSERT INTO deletions (fact_id, deleted_at) VALUES (?, ?)", [(i, now) for i in fact_ids])
    cut = head(db) - keep
    if cut > pruned_through(db):
        db.execute("DELETE FROM deletions WHERE epoch <= ?", (cut,))
        db.execute("INSERT OR REPLACE INTO meta VALUES ('deletions_pruned_through', ?)", (str(cut),))


def head(db: sqlite3.Connection) -> int:
    """The newest epoch (0 before the first deletion)."""
    row = db.execute("SELECT MAX(epoch) FROM deletions").fetchone()
    return max(row[0] or 0, pruned_through(db))


def pruned_through(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM meta WHERE key='deletions_pruned_through'").fetchone()
    return int(row[0]) if row else 0


def since(db: sqlite3.Connection, store_id: str, asked_store: str, cursor: int, page: int = PAGE) -> DeletionFeed:
    """The deletions after `cursor` of the store `asked_store`, a page at a time."""
    top = head(db)
    if asked_store != store_id or not pruned_through(db) <= cursor <= top:
        newest = db.execute("SELECT fact_id FROM deletions ORDER BY epoch DESC LIMIT ?", (page,)).fetchall()
        return DeletionFeed(store_id, top, tuple(r[0] for r in reversed(newest)), reset=True)
    rows = db.execute("SELECT epoch, fact_id FROM deletions WHERE epoch > ? ORDER BY epoch LIMIT ?",
                      (cursor, page + 1)).fetchall()
    if len(rows) > page:
        return DeletionFeed(store_id, rows[page - 1][0], tuple(r[1] for r in rows[:page]), more=True)
    return DeletionFeed(store_id, top, tuple(r[1] for r in rows))
