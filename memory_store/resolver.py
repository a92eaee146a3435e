"""The engine replica's side of memory injection: turn a MemoryInjection into KV segments.

Lookup order, per segment (the anchor, then each fact):
1. this replica's own LRU (no copy across processes),
2. the memory-store actor's cache,
3. encode it here, on this replica's engine, with the serving model's own weights and numerics:
   the anchor is computed alone at position 0 (exact); a fact is computed after the anchor and
   its context (the w preceding facts of its source) and only the fact's tokens are kept, keys
   with RoPE removed. New segments go back to the memory store for other replicas.
Any failure raises MemoryUnavailable; the replica then computes the prompt from its text (the
facts are in the prompt's tokens either way), so the request still succeeds.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kv_transfer.injection import MemoryFact, MemoryInjection
from kv_transfer.segments import KVSegment
from memory_store.layout import token_hash
from memory_store.segment_cache import SegmentCache, SegmentKey

logger = logging.getLogger("baton.memory")


@dataclass(frozen=True)
class _Held:
    """A segment in this replica's cache, with the context facts it was encoded after: a fact's
    predecessors change only when one is deleted, and then the held segment is stale."""

    segment: KVSegment
    context: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.segment.nbytes


class MemoryUnavailable(RuntimeError):
    """The segments for a request could not be found or encoded (the request recomputes)."""


class Capturer(Protocol):
    async def capture(self, request_id: str, prompt_token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
                      cache_salt: str | None = None) -> tuple[KVSegment, ...]: ...


def anchor_key(anchor: Sequence[int], model: str) -> SegmentKey:
    return SegmentKey.for_anchor(token_hash(anchor), model)


def fact_key(fact: MemoryFact, window: int, model: str) -> SegmentKey:
    return SegmentKey.for_fact(fact.fact_id, window, model)


class SegmentResolver:
    def __init__(self, engine: Capturer, store: Any | None, local_capacity_bytes: int):
        self._engine = engine
        self._store = store  # a handle to memory_store.deployment.MemoryStore, or None
        self._local = SegmentCache(local_capacity_bytes)
        self.encoded_tokens = 0  # tokens of memory KV this replica has encoded (metric)

    async def resolve(self, prompt: Sequence[int], m: MemoryInjection) -> tuple[KVSegment, ...]:
        """Segments covering prompt positions [0, m.end): anchor first, then each fact."""
        anchor = tuple(prompt[: m.anchor_len])
        keys = [anchor_key(anchor, m.model)] + [fact_key(f, m.window, m.model) for f in m.facts]
        context = {fact_key(f, m.window, m.model): f.context_fact_ids for f in m.facts}
        found: dict[SegmentKey, KVSegment] = {}
        for k in keys:
            held = self._local.get(k)
            if held is None:
                continue
            if held.context != context.get(k, ()):
                self._local.evict(k)  # a predecessor was deleted since it was encoded
                continue
            found[k] = held.segment
        missing = [k for k in keys if k not in found]
        if missing and self._store is not None:
            try:
                fetched = await self._store.get_segments.remote(m.user, missing)
            except Exception as e:  # noqa: BLE001 - the store is a cache here; encode instead
                logger.warning("memory store lookup failed (%s); encoding locally", type(e).__name__)
                fetched = {}
            for k, v in fetched.items():  # the store drops segments whose context was deleted
                found[k] = v
                self._local.put(k, _Held(v, context.get(k, ())))
        by_key = {fact_key(f, m.window, m.model): f for f in m.facts}
        todo = [k for k in keys if k not in found]
        if todo:
            encoded = await self.encode(anchor, [by_key[k] for k in todo if k.kind == "fact"], m,
                                        with_anchor=any(k.kind == "anchor" for k in todo))
            found.update(encoded)
        segs = tuple(found[k] for k in keys)
        for seg, (a, b) in zip(segs, _spans(m), strict=True):
            if seg.token_ids != tuple(prompt[a:b]):
                raise MemoryUnavailable(f"segment tokens differ from prompt positions [{a}, {b})")
        return segs

    async def encode(self, anchor: tuple[int, ...], facts: Sequence[MemoryFact], m: MemoryInjection,
                     with_anchor: bool = True) -> dict[SegmentKey, KVSegment]:
        """Encode the anchor (if asked) and `facts` on this replica's engine, concurrently; cache
        them here and offer them to the memory store."""
        jobs: list[tuple[SegmentKey, tuple[int, ...], tuple[int, int], tuple[str, ...]]] = []
        if with_anchor:
            jobs.append((anchor_key(anchor, m.model), anchor, (0, len(anchor)), ()))
        for f in facts:
            prompt = anchor + f.context_ids + f.token_ids
            jobs.append((fact_key(f, m.window, m.model), prompt, (len(prompt) - len(f.token_ids), len(prompt)), f.context_fact_ids))
        try:
            results = await asyncio.gather(*(
                self._engine.capture(f"mem-enc-{uuid.uuid4().hex}", prompt, (span,)) for _, prompt, span, _ in jobs
            ))
        except Exception as e:
            raise MemoryUnavailable(f"encoding memory KV failed: {e}") from e
        out: dict[SegmentKey, KVSegment] = {}
        items = []
        for (key, _, (a, b), ctx), segs in zip(jobs, results, strict=True):
            out[key] = segs[0]
            self._local.put(key, _Held(segs[0], tuple(ctx)))
            self.encoded_tokens += b - a
            items.append((key, segs[0], ctx))
        if self._store is not None and items:
            self._store.put_segments.remote(m.user, items)  # fire and forget: the store is a cache
        return out

    def local_stats(self) -> Any:
        return self._local.stats()


def _spans(m: MemoryInjection) -> list[tuple[int, int]]:
    return [(0, m.anchor_len)] + [(f.start, f.start + len(f.token_ids)) for f in m.facts]
