"""The memory-store actor: MemoryService (memory_store/store.py) behind one Serve replica.

One replica (a Ray actor) owns the SQLite file and the segment cache; every ingress and engine
replica talks to it through a handle. The cache's bytes live in a NIXL-registered arena
(memory_store/arena.py; GPU memory when the actor has a GPU), which engine replicas read from
directly (`get_segments(by_ref=True)` answers SegmentRefs; `arena_peer` is what a reader needs to
connect). Blocking work (SQLite, embeddings) runs in a worker
thread so the actor keeps answering. Restarting it loses only cached KV: facts are on disk and
engine replicas re-encode segments on demand.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from ray import serve
from ray.serve import metrics

from memory_store.arena import SegmentArena
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.deletions import DeletionFeed
from memory_store.embedder import make_embedder
from memory_store.segment_cache import SegmentKey
from memory_store.store import FactView, MemoryService, Recall

logger = logging.getLogger("ray.serve")


class MemoryStore:
    def __init__(self, cfg: MemoryConfig, db_path: str):
        db = FactStore(db_path, max_fact_chars=cfg.max_fact_chars, max_facts_per_request=cfg.max_facts_per_request,
                       idempotency_ttl_s=cfg.idempotency_ttl_h * 3600.0)
        self._svc = MemoryService(cfg, db, make_embedder(cfg.embedder), _arena(cfg))
        self._bytes = metrics.Gauge("baton_memory_segment_bytes", "bytes of encoded memory KV held by the memory store")
        self._hits = metrics.Counter("baton_memory_segment_lookups", "segment lookups by the engines", tag_keys=("result",))
        logger.info("memory store on %s", db_path)

    async def add(self, user: str, texts: Sequence[str], source: str = "api",
                  idempotency_key: str | None = None) -> list[FactView]:
        return await asyncio.to_thread(self._svc.add, user, texts, source, idempotency_key)

    async def list(self, user: str, limit: int = 100, offset: int = 0) -> list[FactView]:
        return await asyncio.to_thread(self._svc.list, user, limit, offset)

    async def get(self, user: str, ids: Sequence[str]) -> list[FactView]:
        return await asyncio.to_thread(self._svc.get, user, ids)

    async def delete(self, user: str, ids: Sequence[str]) -> int:
        return await asyncio.to_thread(self._svc.delete, user, ids)

    async def delete_all(self, user: str) -> int:
        return await asyncio.to_thread(self._svc.delete_all, user)

    async def recall(self, user: str, query: str, k: int, window: int, ids: Sequence[str] = ()) -> Recall:
        return await asyncio.to_thread(self._svc.recall, user, query, k, window, ids)

    async def deletions_since(self, store_id: str, cursor: int) -> DeletionFeed:
        """Engine replicas' purge feed (memory_store/resolver.py: each stats tick, and before a request)."""
        return await asyncio.to_thread(self._svc.deletions_since, store_id, cursor)

    async def get_segments(self, user: str, keys: Sequence[SegmentKey], by_ref: bool = False) -> dict[SegmentKey, Any]:
        found = await asyncio.to_thread(self._svc.get_segments, user, keys, by_ref)
        for result, n in (("hit", len(found)), ("miss", len(keys) - len(found))):
            if n:  # a Ray counter refuses an increment of 0: an all-hit lookup raised and the engine re-encoded
                self._hits.inc(n, tags={"result": result})
        return found

    async def put_segments(self, user: str, items: Sequence[tuple[SegmentKey, Any, Sequence[str]]]) -> int:
        n = await asyncio.to_thread(self._svc.put_segments, user, items)
        self._bytes.set(self._svc.stats().bytes)
        return n

    async def arena_peer(self) -> bytes | None:
        """The arena's NIXL agent metadata (a reader adds it as a peer once); None: no NIXL."""
        return self._svc.arena_peer()

    async def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self._svc.stats())

    async def check_integrity(self) -> None:
        """Full check (SQLite integrity_check + cache invariants); tests call it, not health checks."""
        await asyncio.to_thread(self._svc.check_integrity)


def _arena(cfg: MemoryConfig) -> SegmentArena:
    import torch

    device = "cuda" if cfg.store_gpus > 0 and torch.cuda.is_available() else "cpu"
    if cfg.store_gpus > 0 and device == "cpu":
        logger.warning("memory.store_gpus is %s but this actor sees no GPU: the arena is in host memory", cfg.store_gpus)
    return SegmentArena(cfg.segment_capacity_bytes, device=device, register=cfg.segment_transport == "nixl")


MemoryStoreDeployment = serve.deployment(MemoryStore, name="memory_store", num_replicas=1, max_ongoing_requests=256,
                                         ray_actor_options={"num_cpus": 0})
