"""Idempotency keys for adding facts: a retried POST /v1/memories never adds its facts twice.

A key belongs to its user: (user, key) -> the ids of the facts that request created and a hash of
what it asked (its source and texts; never the text itself). FactStore.add looks the key up and
records it in the same transaction as the facts, so a retry -- after a timeout, a dropped
connection, a restarted store -- finds either the facts together with their key, or neither:
  same user, key and request  -> the facts that request created, nothing added (a replay)
  same user and key, another request -> IdempotencyKeyReused (HTTP 422 idempotency_key_reused)
  another user, same key      -> unrelated (keys are per user)
  a key older than the TTL    -> forgotten: the request is new
Deleting some of a request's facts keeps its key (a replay answers the facts that are left and
never re-adds the deleted ones); deleting all of a user's facts forgets the user's keys.

Schema (memory_store/db.py applies it as version 2): idempotency_keys, below.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Sequence

from memory_store.errors import IdempotencyKeyReused, InvalidInput

DEFAULT_TTL_S = 24 * 3600.0
KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")  # visible ASCII, as a header value carries it

SCHEMA = """
CREATE TABLE idempotency_keys (
    user TEXT NOT NULL,
    key TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    fact_ids TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (user, key)
);
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at)
"""


def validate_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidInput("an Idempotency-Key is 1-255 visible ASCII characters")
    return key


def request_hash(source: str, texts: Sequence[str]) -> str:
    """What a request asks for, as the store sees it: the same source and texts hash the same."""
    return hashlib.sha256(json.dumps([source, list(texts)], ensure_ascii=False).encode()).hexdigest()


def lookup(db: sqlite3.Connection, user: str, key: str, digest: str, now: float, ttl_s: float) -> list[str] | None:
    """The fact ids recorded under (user, key), or None if the key is new (or expired). Raises
    IdempotencyKeyReused if the key was recorded for another request. Call inside a write
    transaction: it forgets every expired key first."""
    db.execute("DELETE FROM idempotency_keys WHERE created_at <= ?", (now - ttl_s,))
    row = db.execute("SELECT request_hash, fact_ids FROM idempotency_keys WHERE user=? AND key=?",
                     (user, key)).fetchone()
    if row is None:
        return None
    if row[0] != digest:
        raise IdempotencyKeyReused(key)
    return list(json.loads(row[1]))


def remember(db: sqlite3.Connection, user: str, key: str, digest: str, fact_ids: Sequence[str], now: float) -> None:
    db.execute("INSERT INTO idempotency_keys (user, key, request_hash, fact_ids, created_at) VALUES (?, ?, ?, ?, ?)",
               (user, key, digest, json.dumps(list(fact_ids)), now))


def forget_user(db: sqlite3.Connection, user: str) -> None:
    db.execute("DELETE FROM idempotency_keys WHERE user=?", (user,))
