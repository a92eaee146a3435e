"""The fact store's SQLite schema and its migrations (PRAGMA user_version).

Each version's statements run once, in order, all in one transaction with the version bump, so a
file is always at exactly one version: a crash mid-migration leaves the old one.
  1 facts(id TEXT PK, user, source, seq, text, created_at REAL, embedding BLOB float32 LE)
    UNIQUE(user, source, seq);  meta(key PK, value)  -- meta['dim'] = embedding width
  2 idempotency_keys (memory_store/idempotency.py), deletions (memory_store/deletions.py);
    meta['store_id'] = this database's random id (a replica's deletion cursor names it)
"""

from __future__ import annotations

import sqlite3
import uuid

from memory_store import deletions, idempotency
from memory_store.errors import SchemaVersionError

SCHEMA_VERSION = 2

_V1 = """
CREATE TABLE facts (
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    source TEXT NOT NULL,
    seq INTEGER NOT NULL,
    text TEXT NOT NULL,
    created_at REAL NOT NULL,
    embedding BLOB NOT NULL,
    UNIQUE (user, source, seq)
);
CREATE INDEX facts_by_user ON facts (user, created_at);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)
"""
MIGRATIONS = {1: _V1, 2: idempotency.SCHEMA + ";" + deletions.SCHEMA}  # version -> statements that reach it


def migrate(db: sqlite3.Connection, dim: int, where: object = "database") -> None:
    """Bring an autocommit connection's database to SCHEMA_VERSION (a new file: create it with
    embeddings of width `dim`). Raises SchemaVersionError for a file newer than this code."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(f"{where} has schema version {version}; this code knows up to {SCHEMA_VERSION}")
    if version == SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated it
        for v in range(version + 1, SCHEMA_VERSION + 1):
            for stmt in filter(str.strip, MIGRATIONS[v].split(";")):
                db.execute(stmt)
            if v == 1:
                db.execute("INSERT INTO meta VALUES ('dim', ?)", (str(dim),))
            if v == 2:
                db.execute("INSERT INTO meta VALUES ('store_id', ?)", (uuid.uuid4().hex,))
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
