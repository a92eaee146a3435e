"""The engine replica's side of memory injection: turn a MemoryInjection into KV segments.

Lookup order, per segment (the anchor, then each fact):
1. this replica's own LRU (no copy across processes),
2. the memory-store actor's cache: read over NIXL from the store's arena by address when this
   process has a puller (kv_transfer/segment_pull.py), else copies through Ray; a failed read
   counts as a miss,
3. encode it here, on this replica's engine, with the serving model's own weights and numerics:
   the anchor is computed alone at position 0 (exact); a fact is computed after the anchor and
   its context (the w preceding facts of its source) and only the fact's tokens are kept, keys
   with RoPE removed. New segments go back to the memory store for other replicas.
Any failure raises MemoryUnavailable; the replica then computes the prompt from its text (the
facts are in the prompt's tokens either way), so the request still succeeds.

Purge: deleting a fact must also remove its KV (user data) from every replica's LRU. Each replica
pulls the store's deletion log (memory_store/deletions.py) from its cursor and drops the deleted
facts' segments and those encoded after them (`sync`): on every stats tick (`sync_soon`, so an idle
replica purges within a tick), and before a request whenever the request's recall saw deletions
this replica has not applied -- so a replica that was unreachable at delete time purges on its next
contact and never serves from a cache that is behind (if it cannot catch up, the request
recomputes). Segments of facts deleted while a request was in flight are not cached here
afterwards (tombstones of the recent deletions, which a reset feed lists too; a resolve that
spans a reset caches nothing).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kv_transfer.injection import MemoryFact, MemoryInjection
from kv_transfer.segment_pull import PullFailed, SegmentPuller
from kv_transfer.segment_refs import SegmentRef
from kv_transfer.segments import KVSegment
from memory_store.layout import encode_salt, token_hash
from memory_store.segment_cache import SegmentCache, SegmentKey

logger = logging.getLogger("baton.memory")

SYNC_TIMEOUT_S = 5.0
SYNC_MAX_PAGES = 64  # pages of the deletion log one sync applies (the rest: next time)
TOMBSTONES = 65536  # recently deleted ids whose segments in-flight requests must not cache


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
    def __init__(self, engine: Capturer, store: Any | None, local_capacity_bytes: int,
                 puller: SegmentPuller | None = None):
        self._engine = engine
        self._store = store  # a handle to memory_store.deployment.MemoryStore, or None
        self._puller = puller  # reads the store's arena over NIXL; None: copies through Ray
        self._local = SegmentCache(local_capacity_bytes)
        self.pulled_segments = 0  # segments read from the store's arena over NIXL (metric)
        self.pulled_bytes = 0
        self.pull_failures = 0  # reads that failed, timed out or outlived their lease (encoded instead)
        self.encoded_tokens = 0  # tokens of memory KV this replica has encoded (metric)
        self.purged_segments = 0  # segments dropped because their facts were deleted (metric)
        self._cursor: tuple[str, int] = ("", 0)  # (store id, epoch) of the deletion log applied here
        self._sync_lock = asyncio.Lock()
        self._sync_task: asyncio.Task[bool] | None = None
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._resets = 0  # cache resets so far: a resolve that saw fewer caches nothing

    # ---- purge -------------------------------------------------------------------------------
    async def sync(self) -> bool:
        """Catch up with the store's deletion log: drop every cached segment of a deleted fact (and
        those encoded after one); a reset feed empties the cache. False if the store did not answer
        (nothing changed; the next contact retries)."""
        if self._store is None:
            return True
        async with self._sync_lock:
            for _ in range(SYNC_MAX_PAGES):
                try:
                    feed = await asyncio.wait_for(self._store.deletions_since.remote(*self._cursor), SYNC_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001 - the store is down or slow: retried on the next contact
                    logger.warning("memory deletion log unavailable (%s); purging on the next contact", type(e).__name__)
                    return False
                self._apply(feed)
                if not feed.more:
                    break
        return True

    def sync_soon(self) -> asyncio.Task[bool] | None:
        """Start a sync in the background unless one is running (the engine replica's stats tick);
        returns the running sync (None without a store)."""
        if self._store is not None and (self._sync_task is None or self._sync_task.done()):
            self._sync_task = asyncio.get_running_loop().create_task(self.sync())
        return self._sync_task

    def behind(self, mark: tuple[str, int]) -> bool:
        """Whether a recall's deletion mark names deletions not applied here."""
        return bool(mark[0]) and (mark[0] != self._cursor[0] or mark[1] > self._cursor[1])

    def _apply(self, feed: Any) -> None:  # a memory_store.deletions.DeletionFeed
        if feed.reset:
            self.purged_segments += self._local.clear()
            self._resets += 1
        for fid in feed.fact_ids:
            self.purged_segments += self._local.drop_fact(fid)
            self._tombstones[fid] = None
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        self._cursor = (feed.store_id, feed.cursor)

    def _keep(self, key: SegmentKey, held: _Held, resets: int) -> None:
        """Cache a segment here, unless its fact or a context fact was deleted meanwhile."""
        if resets == self._resets and not any(f in self._tombstones for f in (key.fact_id, *held.context)):
            self._local.put(key, held, context=held.context)

    async def resolve(self, prompt: Sequence[int], m: MemoryInjection) -> tuple[KVSegment, ...]:
        """Segments covering prompt positions [0, m.end): anchor first, then each fact."""
        if self._store is not None and self.behind(m.deletions):
            if not await self.sync() or self.behind(m.deletions):
                raise MemoryUnavailable("this replica could not apply the memory store's deletions")
        resets = self._resets
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
            fetched = await self._fetch(m.user, missing)
            for k, v in fetched.items():  # the store drops segments whose context was deleted
                found[k] = v
                self._keep(k, _Held(v, context.get(k, ())), resets)
        by_key = {fact_key(f, m.window, m.model): f for f in m.facts}
        todo = [k for k in keys if k not in found]
        if todo:
            encoded = await self.encode(anchor, [by_key[k] for k in todo if k.kind == "fact"], m,
                                        with_anchor=any(k.kind == "anchor" for k in todo), resets=resets)
            found.update(encoded)
        segs = tuple(found[k] for k in keys)
        for seg, (a, b) in zip(segs, _spans(m), strict=True):
            if seg.token_ids != tuple(prompt[a:b]):
                raise MemoryUnavailable(f"segment tokens differ from prompt positions [{a}, {b})")
        return segs

    async def _fetch(self, user: str, keys: list[SegmentKey]) -> dict[SegmentKey, KVSegment]:
        """The store's segments among `keys`: read over NIXL when it answers refs; {} on failure."""
        asked_at = time.monotonic()  # before asking: the store's lease runs from its answer
        try:
            if self._puller is None:
                return dict(await self._store.get_segments.remote(user, keys))
            fetched = dict(await self._store.get_segments.remote(user, keys, True))  # by_ref
        except Exception as e:  # noqa: BLE001 - the store is a cache here; encode instead
            logger.warning("memory store lookup failed (%s); encoding locally", type(e).__name__)
            return {}
        refs = {k: v for k, v in fetched.items() if isinstance(v, SegmentRef)}
        if refs:
            pulled = await self._pull(list(refs.values()), asked_at)
            for k in refs:
                del fetched[k]
            if pulled is not None:
                fetched.update(zip(refs, pulled, strict=True))
        return fetched

    async def _pull(self, refs: list[SegmentRef], asked_at: float) -> tuple[KVSegment, ...] | None:
        """Read refs out of the store's arena in a worker thread; None if that failed."""
        assert self._puller is not None
        try:
            if not self._puller.knows(refs[0].agent):
                metadata = await self._store.arena_peer.remote()
                if metadata is None:
                    raise PullFailed("the memory store's arena has no NIXL agent")
                self._puller.add_peer(metadata)
            result = await asyncio.to_thread(self._puller.read, refs, asked_at)
        except Exception as e:  # noqa: BLE001 - a failed read is a miss: the segments are encoded
            self.pull_failures += 1
            logger.warning("memory segments not read from the store (%s: %s); encoding locally", type(e).__name__, e)
            return None
        self.pulled_segments += len(result.segments)
        self.pulled_bytes += result.nbytes
        return result.segments

    async def encode(self, anchor: tuple[int, ...], facts: Sequence[MemoryFact], m: MemoryInjection,
                     with_anchor: bool = True, resets: int | None = None) -> dict[SegmentKey, KVSegment]:
        """Encode the anchor (if asked) and `facts` on this replica's engine, concurrently; cache
        them here and offer them to the memory store."""
        jobs: list[tuple[SegmentKey, tuple[int, ...], tuple[int, int], tuple[str, ...]]] = []
        if with_anchor:
            jobs.append((anchor_key(anchor, m.model), anchor, (0, len(anchor)), ()))
        for f in facts:
            prompt = anchor + f.context_ids + f.token_ids
            jobs.append((fact_key(f, m.window, m.model), prompt, (len(prompt) - len(f.token_ids), len(prompt)), f.context_fact_ids))
        salt = encode_salt(m.user)  # captures compute the user's facts: never hit by another user
        try:
            results = await asyncio.gather(*(
                self._engine.capture(f"mem-enc-{uuid.uuid4().hex}", prompt, (span,), cache_salt=salt) for _, prompt, span, _ in jobs
            ))
        except Exception as e:
            raise MemoryUnavailable(f"encoding memory KV failed: {e}") from e
        out: dict[SegmentKey, KVSegment] = {}
        items = []
        for (key, _, (a, b), ctx), segs in zip(jobs, results, strict=True):
            out[key] = segs[0]
            self._keep(key, _Held(segs[0], tuple(ctx)), self._resets if resets is None else resets)
            self.encoded_tokens += b - a
            items.append((key, segs[0], ctx))
        if self._store is not None and items:
            self._store.put_segments.remote(m.user, items)  # fire and forget: the store is a cache
        return out

    def local_stats(self) -> Any:
        return self._local.stats()

    def holds(self, key: SegmentKey) -> bool:
        """Whether this replica's cache holds `key` (no effect on recency or stats)."""
        return key in self._local


def _spans(m: MemoryInjection) -> list[tuple[int, int]]:
    return [(0, m.anchor_len)] + [(f.start, f.start + len(f.token_ids)) for f in m.facts]
