"""MemoryService: one user's facts in, recalled facts and their encoded KV out.

The logic of the memory-store actor, free of Serve (memory_store/deployment.py wraps it), so it
is testable in milliseconds with a fake embedder. It owns three things:
- the durable facts (memory_store/db.py, SQLite): the truth, never lost;
- the embedder (memory_store/embedder.py) for retrieval by cosine similarity;
- the encoded KV segments (memory_store/segment_cache.py, LRU by bytes): a cache only. An
  evicted or lost segment is encoded again by an engine replica when next needed. With an arena
  (memory_store/arena.py) their bytes live in one NIXL-registered buffer, and a lookup that asks
  `by_ref` gets SegmentRefs to read them by instead of copies. A fact's segments are owned by its
  user, anchors by no one (""): with `user_segment_quota_mb` a user past its quota loses its own
  least recently used segments, not other users'.
Every call names the user, and every fact it touches must be that user's (FactNotFound
otherwise, the same answer for a foreign id as for an unknown one).

Deleting facts drops their segments here at once; engine replicas purge theirs from the deletion
log (`deletions_since`, memory_store/deletions.py), and every Recall carries the log's mark so a
replica purges up to it before it uses its own cache (memory_store/resolver.py).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_transfer.segments import KVSegment
from memory_store.arena import ArenaEntry, SegmentArena
from memory_store.config import MemoryConfig
from memory_store.db import Fact, FactStore
from memory_store.deletions import DeletionFeed
from memory_store.embedder import Embedder
from memory_store.errors import InvalidInput
from memory_store.layout import RecalledFact
from memory_store.retrieval import order_for_layout, top_k
from memory_store.segment_cache import CacheStats, SegmentCache, SegmentKey

logger = logging.getLogger("baton.memory")


@dataclass(frozen=True)
class FactView:
    """A fact as the API shows it (no embedding)."""

    id: str
    text: str
    source: str
    seq: int
    created_at: float

    @classmethod
    def of(cls, f: Fact) -> FactView:
        return cls(f.id, f.text, f.source, f.seq, f.created_at)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "memory", "text": self.text, "source": self.source, "seq": self.seq,
                "created_at": int(self.created_at)}


@dataclass(frozen=True)
class Recall:
    facts: tuple[RecalledFact, ...]
    scores: tuple[float, ...]  # cosine similarity per fact (1.0 for facts named explicitly)
    deletions: tuple[str, int] = ("", 0)  # the deletion log's mark (store id, epoch) once recalled


class MemoryService:
    def __init__(self, cfg: MemoryConfig, db: FactStore, embedder: Embedder, arena: SegmentArena | None = None):
        self._cfg = cfg
        self._db = db
        self._embedder = embedder
        self._arena = arena
        release = (lambda _k, entry: arena.release(entry)) if arena is not None else None
        capacity = arena.capacity_bytes if arena is not None else cfg.segment_capacity_bytes
        self._segments = SegmentCache(capacity, on_remove=release, owner_quota_bytes=cfg.user_segment_quota_bytes)
        self._seg_lock = threading.Lock()  # SegmentCache and the arena are not thread-safe

    # ---- facts ------------------------------------------------------------------------------
    def add(self, user: str, texts: Sequence[str], source: str = "api", idempotency_key: str | None = None) -> list[FactView]:
        """Store facts; with an idempotency key, a repeat of the same request adds nothing and
        returns what the first one added (memory_store/idempotency.py)."""
        if not texts:
            raise InvalidInput("no facts given")
        vecs = self._embedder.embed(list(texts))
        return [FactView.of(f) for f in self._db.add(user, list(texts), source, vecs, idempotency_key)]

    def list(self, user: str, limit: int = 100, offset: int = 0) -> list[FactView]:
        return [FactView.of(f) for f in self._db.list_facts(user, limit=limit, offset=offset)]

    def get(self, user: str, ids: Sequence[str]) -> list[FactView]:
        return [FactView.of(f) for f in self._db.get(user, list(ids))]

    def delete(self, user: str, ids: Sequence[str]) -> int:
        n = self._db.delete(user, list(ids), missing_ok=False)
        with self._seg_lock:
            for fid in ids:
                self._segments.drop_fact(fid)
        return n

    def delete_all(self, user: str) -> int:
        ids = [f.id for f in self._db.list_facts(user, limit=1 << 30)]
        n = self._db.delete_all(user)
        with self._seg_lock:
            for fid in ids:
                self._segments.drop_fact(fid)
        return n

    def recall(self, user: str, query: str, k: int, window: int, ids: Sequence[str] = ()) -> Recall:
        """The facts for one request: `ids` if given (all must be the user's), else the top k by
        cosine similarity to `query`; ordered by (source, seq) so neighbours sit together, each
        with the texts of its `window` predecessors (its encoding context)."""
        if not 0 <= window <= 64:
            raise InvalidInput("memory window must be in [0, 64]")
        if ids:
            facts = self._db.get(user, list(ids))
            scores = {f.id: 1.0 for f in facts}
        else:
            if not 1 <= k <= self._cfg.max_k:
                raise InvalidInput(f"memories.k must be in [1, {self._cfg.max_k}]")
            all_ids, matrix = self._db.all_embeddings(user)
            if not all_ids:
                return Recall((), (), self._db.deletion_mark())
            q = self._embedder.embed([query or " "])[0]
            best = top_k(q, all_ids, matrix, k)
            scores = {s.fact_id: s.score for s in best}
            facts = self._db.get(user, [s.fact_id for s in best])
        ordered = order_for_layout(facts)
        recalled = []
        for f in ordered:
            before = self._db.preceding(user, f, window) if window else []
            recalled.append(RecalledFact(f.id, f.text, tuple(p.text for p in before), tuple(p.id for p in before)))
        # the mark is read after the facts: it covers every deletion that committed before them
        return Recall(tuple(recalled), tuple(scores[f.id] for f in ordered), self._db.deletion_mark())

    def deletions_since(self, store_id: str, cursor: int) -> DeletionFeed:
        """What an engine replica must purge from its segment cache since its cursor."""
        return self._db.deletions_since(store_id, cursor)

    # ---- encoded KV --------------------------------------------------------------------------
    @property
    def arena(self) -> SegmentArena | None:
        return self._arena

    def arena_peer(self) -> bytes | None:
        """The arena's NIXL agent metadata (a reader adds it as a peer once); None: no NIXL."""
        a = self._arena
        return a.agent_metadata() if a is not None and a.serves_refs else None

    def get_segments(self, user: str, keys: Sequence[SegmentKey], by_ref: bool = False) -> dict[SegmentKey, Any]:
        """Cached segments among `keys` (misses are simply absent). Fact keys must be the user's.
        by_ref: answer SegmentRefs (leased extents of the NIXL-registered arena) where the arena
        serves them; otherwise KVSegments (copies)."""
        fact_ids = sorted({k.fact_id for k in keys if k.kind == "fact"})
        if fact_ids:
            self._db.get(user, fact_ids)  # raises FactNotFound for a foreign or deleted fact
        with self._seg_lock:
            found = {k: v for k in keys if (v := self._segments.get(k)) is not None}
            if self._arena is None:
                return found
            if by_ref and self._arena.serves_refs:
                return {k: self._arena.lease(v) for k, v in found.items()}
            return {k: self._arena.load(v) for k, v in found.items()}

    def put_segments(self, user: str, items: Sequence[tuple[SegmentKey, Any, Sequence[str]]]) -> int:
        """Store encoded segments (key, segment, ids of the context facts it was encoded after).
        Segments of facts deleted meanwhile are dropped; fact segments count against the user's
        quota, anchors against none. Returns how many were stored. Invariant: a segment the cache
        refuses leaves no extent in the arena."""
        fact_ids = {k.fact_id for k, _, _ in items if k.kind == "fact"}
        stored = 0
        with self._seg_lock:
            # read which facts are alive under the lock: a delete() drops segments under it
            # after its database delete, so a fact deleted between this read and the puts below
            # has its fresh segments dropped right after (read outside, they would outlive it)
            alive = {f.id for f in self._db.list_facts(user, limit=1 << 30)} if fact_ids else set()
            for key, seg, ctx in items:
                if key.kind == "fact" and (key.fact_id not in alive or not set(ctx) <= alive):
                    continue
                owner = user if key.kind == "fact" else ""
                value = seg if self._arena is None else self._into_arena(key, seg, owner)
                if value is None:
                    continue
                if self._segments.put(key, value, context=ctx, owner=owner).stored:
                    stored += 1
                elif self._arena is not None:  # refused after the copy: its extent must not outlive it
                    self._arena.release(value)
        return stored

    def _into_arena(self, key: SegmentKey, seg: KVSegment, owner: str) -> ArenaEntry | None:
        """Copy a segment into the arena, evicting least recently used segments until a free extent
        is large enough; None when it cannot fit (extents still leased, too large, or over the
        owner's quota: then nothing is evicted for it)."""
        assert self._arena is not None
        if not isinstance(seg, KVSegment) or not seg.num_tokens or not self._arena.fits(seg.nbytes):
            return None
        extent = self._arena.extent_bytes(seg.nbytes)
        if not self._segments.fits(extent, owner):
            return None
        self._segments.evict(key)  # a re-put replaces: its old extent is free space
        self._segments.make_room_in_quota(owner, extent)  # its own first
        try:
            while (entry := self._arena.put(seg)) is None:
                if self._segments.evict_lru() is None:
                    return None
        except (ValueError, RuntimeError) as e:  # a segment the arena's layout cannot hold: not cached
            logger.warning("memory segment not cached: %s", e)
            return None
        return entry

    def stats(self) -> CacheStats:
        with self._seg_lock:
            return self._segments.stats()

    def check_integrity(self) -> None:
        self._db.check_integrity()
        with self._seg_lock:
            self._segments.check_integrity()
            if self._arena is not None:
                self._arena.check_integrity()
                cached = {v.offset for v in self._segments.values()}
                if cached != self._arena.live_offsets():
                    raise AssertionError("the cache's segments and the arena's live extents differ")
