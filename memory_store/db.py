"""FactStore: every user's facts in one SQLite file, durable across restarts.

One connection (WAL, synchronous=FULL) guarded by a lock; every call blocks, so call it from a
worker thread, never from an event loop. Facts are scoped to a user on every read and write:
nothing here returns or deletes another user's fact, and a foreign id is reported exactly like
an id that never existed (FactNotFound).

Within (user, source) facts are numbered by `seq`, 0, 1, 2, ... in the order they were added;
`preceding(fact, w)` gives the w facts before it, the context its KV is encoded with.

Beside the facts, in the same transactions: idempotency keys of adds (memory_store/idempotency.py)
and the log of deleted ids that engine replicas purge their KV caches by (memory_store/deletions.py).

Schema and migrations: memory_store/schema.py (facts, meta, idempotency_keys, deletions).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

import numpy as np

from memory_store import deletions, idempotency
from memory_store.deletions import DeletionFeed
from memory_store.errors import FactNotFound, InvalidInput, StoreCorrupted
from memory_store.schema import SCHEMA_VERSION, migrate  # noqa: F401 - callers know SCHEMA_VERSION here
from memory_store.validation import (  # noqa: F401 - MAX_SOURCE_CHARS and USER_RE are known here
    MAX_SOURCE_CHARS,
    USER_RE,
    validate_source,
    validate_text,
    validate_user,
)

DEFAULT_DIM = 384
_NORM_TOL = 1e-3

@dataclass(frozen=True)
class Fact:
    id: str  # uuid4 hex
    user: str
    text: str
    source: str  # a conversation id, "api", "locomo:conv-26:events", ...
    seq: int  # order within (user, source), from 0
    created_at: float  # unix seconds
    embedding: np.ndarray = field(compare=False, repr=False)  # float32 [dim], L2-normalized, read-only


Facts = list[Fact]
Ids = list[str]


class FactStore:
    def __init__(self, path: str | Path, *, dim: int = DEFAULT_DIM, max_fact_chars: int = 2000,
                 max_facts_per_request: int = 256, clock: Callable[[], float] = time.time,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
                 idempotency_ttl_s: float = idempotency.DEFAULT_TTL_S) -> None:
        self.path = Path(path)
        self.dim = dim
        self.max_fact_chars = max_fact_chars
        self.max_facts_per_request = max_facts_per_request
        self._clock = clock
        self._new_id = new_id
        self.idempotency_ttl_s = idempotency_ttl_s
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    # ---- lifecycle -------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self._lock:
            migrate(self._db, self.dim, self.path)
            self.store_id = str(self._db.execute("SELECT value FROM meta WHERE key='store_id'").fetchone()[0])
            stored = int(self._db.execute("SELECT value FROM meta WHERE key='dim'").fetchone()[0])
            if stored != self.dim:
                raise InvalidInput(f"{self.path} holds {stored}-dim embeddings, not {self.dim}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- writes ----------------------------------------------------------------------------
    def add(self, user: str, texts: Sequence[str], source: str, embeddings: np.ndarray,
            idempotency_key: str | None = None) -> Facts:
        """Store texts as facts numbered after the source's last one. All or nothing. With an
        idempotency key already recorded for this user and request: add nothing and return the
        facts that request added (those still there); for another request: IdempotencyKeyReused."""
        validate_user(user)
        if idempotency_key is not None:
            idempotency.validate_key(idempotency_key)
        validate_source(source)
        if isinstance(texts, str):
            raise InvalidInput("texts must be a list of strings, not one string")
        texts = [validate_text(t, self.max_fact_chars) for t in texts]
        self._check_request_size(len(texts))
        vecs = self._normalized(embeddings, len(texts))
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if idempotency_key is not None:
                    digest = idempotency.request_hash(source, texts)
                    done = idempotency.lookup(self._db, user, idempotency_key, digest, now, self.idempotency_ttl_s)
                    if done is not None:
                        by_id = {f.id: f for f in self._select_ids(user, done)} if done else {}
                        self._db.execute("COMMIT")
                        return [by_id[i] for i in done if i in by_id]
                row = self._db.execute("SELECT MAX(seq) FROM facts WHERE user=? AND source=?",
                                       (user, source)).fetchone()
                first = 0 if row[0] is None else row[0] + 1
                facts = [Fact(self._new_id(), user, t, source, first + i, now, _readonly(v))
                         for i, (t, v) in enumerate(zip(texts, vecs, strict=True))]
                self._db.executemany(
                    "INSERT INTO facts (id, user, source, seq, text, created_at, embedding) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(f.id, user, source, f.seq, f.text, now, _to_blob(f.embedding)) for f in facts])
                if idempotency_key is not None:
                    idempotency.remember(self._db, user, idempotency_key, digest, [f.id for f in facts], now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return facts

    def delete(self, user: str, ids: Iterable[str], *, missing_ok: bool = True) -> int:
        """Delete the user's facts among `ids`; returns how many went. Other users' ids are
        untouched. With missing_ok=False, any id that is not the user's raises FactNotFound and
        nothing is deleted. Deleted ids go to the deletion log."""
        validate_user(user)
        wanted = self._unique_ids(ids)
        if not wanted:
            return 0
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if not missing_ok:
                    found = {f.id for f in self._select_ids(user, wanted)}
                    missing = [i for i in wanted if i not in found]
                    if missing:
                        raise FactNotFound(missing)
                gone = [i for i in wanted if self._db.execute("DELETE FROM facts WHERE user=? AND id=?", (user, i)).rowcount]
                deletions.record(self._db, gone, self._clock())
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return len(gone)

    def delete_all(self, user: str) -> int:
        """Delete every fact of the user (logged) and forget the user's idempotency keys."""
        validate_user(user)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = [r[0] for r in self._db.execute("SELECT id FROM facts WHERE user=? ORDER BY rowid", (user,))]
                self._db.execute("DELETE FROM facts WHERE user=?", (user,))
                deletions.record(self._db, gone, self._clock())
                idempotency.forget_user(self._db, user)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return len(gone)

    def deletions_since(self, store_id: str, cursor: int) -> DeletionFeed:
        """The deletion log after `cursor` of the store `store_id` (memory_store/deletions.py)."""
        with self._lock:
            return deletions.since(self._db, self.store_id, store_id, cursor)

    def deletion_mark(self) -> tuple[str, int]:
        """(store id, newest deletion epoch): a cursor that reaches it has seen every deletion so far."""
        with self._lock:
            return self.store_id, deletions.head(self._db)

    # ---- reads -----------------------------------------------------------------------------
    def get(self, user: str, ids: Iterable[str]) -> Facts:
        """The user's facts with these ids, in the order asked (duplicates once). Raises
        FactNotFound listing every id that is not the user's (unknown or foreign alike)."""
        validate_user(user)
        wanted = self._unique_ids(ids)
        if not wanted:
            return []
        with self._lock:
            by_id = {f.id: f for f in self._select_ids(user, wanted)}
        missing = [i for i in wanted if i not in by_id]
        if missing:
            raise FactNotFound(missing)
        return [by_id[i] for i in wanted]

    def list_facts(self, user: str, limit: int = 100, offset: int = 0) -> Facts:
        """The user's facts, oldest first (ties in insertion order)."""
        validate_user(user)
        if limit < 0 or offset < 0:
            raise InvalidInput("limit and offset must be >= 0")
        with self._lock:
            rows = self._db.execute(
                "SELECT id, user, text, source, seq, created_at, embedding FROM facts "
                "WHERE user=? ORDER BY created_at, rowid LIMIT ? OFFSET ?",
                (user, limit, offset)).fetchall()
        return [self._fact(r) for r in rows]

    def all_embeddings(self, user: str) -> tuple[Ids, np.ndarray]:
        """(ids, matrix [n, dim] float32, read-only) of the user's facts, oldest first."""
        validate_user(user)
        with self._lock:
            rows = self._db.execute("SELECT id, embedding FROM facts WHERE user=? "
                                    "ORDER BY created_at, rowid", (user,)).fetchall()
        ids = [r[0] for r in rows]
        if not rows:
            return ids, np.zeros((0, self.dim), dtype=np.float32)
        return ids, np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(len(rows), self.dim)

    def preceding(self, user: str, fact: Fact, w: int) -> Facts:
        """The w facts of the same user and source with the largest seq below fact.seq, in seq
        order (fewer at the start of a source; [] for w = 0)."""
        validate_user(user)
        if w < 0:
            raise InvalidInput("w must be >= 0")
        if fact.user != user or w == 0:
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT id, user, text, source, seq, created_at, embedding FROM facts "
                "WHERE user=? AND source=? AND seq<? ORDER BY seq DESC LIMIT ?",
                (user, fact.source, fact.seq, w)).fetchall()
        return [self._fact(r) for r in reversed(rows)]

    def count(self, user: str) -> int:
        validate_user(user)
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM facts WHERE user=?", (user,)).fetchone()[0])

    def check_integrity(self) -> None:
        """Raise StoreCorrupted unless SQLite's integrity_check passes and every embedding is a
        finite, unit-norm float32 vector of width dim."""
        with self._lock:
            result = [r[0] for r in self._db.execute("PRAGMA integrity_check").fetchall()]
            if result != ["ok"]:
                raise StoreCorrupted(f"sqlite integrity_check: {result[:5]}")
            bad = self._db.execute("SELECT COUNT(*) FROM facts WHERE length(embedding) != ?",
                                   (4 * self.dim,)).fetchone()[0]
            if bad:
                raise StoreCorrupted(f"{bad} embedding(s) are not {self.dim} float32 values")
            if self._db.execute("SELECT COUNT(*) FROM deletions JOIN facts ON facts.id = deletions.fact_id").fetchone()[0]:
                raise StoreCorrupted("a fact in the deletion log is still stored")
            for (fid, blob) in self._db.execute("SELECT id, embedding FROM facts"):
                norm = float(np.linalg.norm(np.frombuffer(blob, dtype="<f4")))
                if not abs(norm - 1.0) <= _NORM_TOL:
                    raise StoreCorrupted(f"fact {fid}: embedding norm {norm:.4f} is not 1")

    # ---- helpers ---------------------------------------------------------------------------
    def _check_request_size(self, n: int) -> None:
        if n == 0:
            raise InvalidInput("no facts given")
        if n > self.max_facts_per_request:
            raise InvalidInput(f"{n} facts in one request; the limit is {self.max_facts_per_request}")

    def _unique_ids(self, ids: Iterable[str]) -> Ids:
        if isinstance(ids, str):
            raise InvalidInput("ids must be a list of strings, not one string")
        wanted = list(dict.fromkeys(ids))
        if not all(isinstance(i, str) for i in wanted):
            raise InvalidInput("ids must be strings")
        if len(wanted) > self.max_facts_per_request:
            raise InvalidInput(f"{len(wanted)} ids in one request; the limit is {self.max_facts_per_request}")
        return wanted

    def _select_ids(self, user: str, ids: Sequence[str]) -> Facts:
        marks = ",".join("?" * len(ids))
        rows = self._db.execute(
            "SELECT id, user, text, source, seq, created_at, embedding FROM facts "
            f"WHERE user=? AND id IN ({marks})", (user, *ids)).fetchall()
        return [self._fact(r) for r in rows]

    def _fact(self, row: tuple[str, str, str, str, int, float, bytes]) -> Fact:
        fid, user, text, source, seq, created_at, blob = row
        return Fact(fid, user, text, source, seq, created_at,
                    _readonly(np.frombuffer(blob, dtype="<f4").astype(np.float32)))

    def _normalized(self, embeddings: np.ndarray, n: int) -> np.ndarray:
        vecs = np.asarray(embeddings, dtype=np.float32)
        if vecs.shape != (n, self.dim):
            raise InvalidInput(f"embeddings have shape {vecs.shape}; expected ({n}, {self.dim})")
        if not np.isfinite(vecs).all():
            raise InvalidInput("embeddings must be finite")
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        if (norms == 0).any():
            raise InvalidInput("an embedding is the zero vector")
        return (vecs / norms).astype(np.float32)

    list = list_facts  # the name callers know; defined last so it shadows no annotation above


def _to_blob(vec: np.ndarray) -> bytes:
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()


def _readonly(vec: np.ndarray) -> np.ndarray:
    out = np.array(vec, dtype=np.float32, copy=True)
    out.flags.writeable = False
    return out
