"""SegmentCache: an engine-free LRU of encoded KV segments with a byte budget.

Keys say what a segment encodes: a fact's tokens encoded after its w predecessors
(kind "fact": fact_id, window, model), or a shared anchor such as a system-prompt prefix
(kind "anchor": a hash of its token ids, model). Values are opaque; they only expose `nbytes`.
A fact segment may be put with the ids of its context facts, so deleting any of them
(drop_fact) also drops the segments whose encoding saw it.

Invariant (check_integrity): bytes == sum(v.nbytes for v in items) <= capacity_bytes, and the
context index only names cached keys. Not thread-safe: its owner (the memory-store actor)
serializes calls. "No room" is a value: put() returns PutResult(stored=False, reason=...).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol


class Segment(Protocol):
    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class SegmentKey:
    kind: Literal["fact", "anchor"]
    model: str
    fact_id: str = ""
    window: int = 0
    anchor: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("SegmentKey needs a model")
        if self.kind == "fact":
            if not self.fact_id or self.anchor or self.window < 0:
                raise ValueError("a fact key needs fact_id, window >= 0 and no anchor")
        elif self.kind == "anchor":
            if not self.anchor or self.fact_id or self.window:
                raise ValueError("an anchor key needs anchor and no fact_id/window")
        else:
            raise ValueError(f"unknown segment kind {self.kind!r}")

    @classmethod
    def for_fact(cls, fact_id: str, window: int, model: str) -> SegmentKey:
        return cls("fact", model, fact_id=fact_id, window=window)

    @classmethod
    def for_anchor(cls, token_hash: str, model: str) -> SegmentKey:
        return cls("anchor", model, anchor=token_hash)


@dataclass(frozen=True)
class PutResult:
    stored: bool
    evicted: tuple[SegmentKey, ...] = ()  # LRU victims pushed out to make room
    reason: Literal["", "too_large"] = ""


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int  # LRU evictions only (not evict()/drop_fact())
    bytes: int
    items: int
    capacity_bytes: int


class SegmentCache:
    def __init__(self, capacity_bytes: int, on_remove: Callable[[SegmentKey, Segment], None] | None = None) -> None:
        """on_remove(key, value): called for every value that leaves the cache, however it leaves
        (LRU, replaced, evict, drop_fact, clear): the memory store's arena frees its extent there."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.capacity_bytes = capacity_bytes
        self._on_remove = on_remove
        self._items: OrderedDict[SegmentKey, Segment] = OrderedDict()  # LRU first, MRU last
        self._deps: dict[str, set[SegmentKey]] = {}  # fact id -> keys whose encoding used it
        self._uses: dict[SegmentKey, frozenset[str]] = {}  # key -> fact ids it is indexed under
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def __contains__(self, key: SegmentKey) -> bool:  # no effect on recency or stats
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[Segment]:  # no effect on recency or stats
        return list(self._items.values())

    def fits(self, nbytes: int) -> bool:
        """Whether an item of this size can ever be stored (after evicting everything else)."""
        return 0 <= nbytes <= self.capacity_bytes

    def get(self, key: SegmentKey) -> Segment | None:
        value = self._items.get(key)
        if value is None:
            self._misses += 1
            return None
        self._hits += 1
        self._items.move_to_end(key)
        return value

    def put(self, key: SegmentKey, value: Segment, *, context: Iterable[str] = ()) -> PutResult:
        """Store value under key (replacing any old value), evicting least recently used items
        until it fits. `context`: ids of the facts the segment was encoded after. An item larger
        than the capacity is refused and the cache is left unchanged."""
        size = int(value.nbytes)
        if not self.fits(size):
            return PutResult(stored=False, reason="too_large")
        self._remove(key)
        evicted = []
        while self._bytes + size > self.capacity_bytes:
            victim = next(iter(self._items))
            self._remove(victim)
            self._evictions += 1
            evicted.append(victim)
        self._items[key] = value
        self._bytes += size
        uses = frozenset({key.fact_id, *context} - {""})
        self._uses[key] = uses
        for fid in uses:
            self._deps.setdefault(fid, set()).add(key)
        return PutResult(stored=True, evicted=tuple(evicted))

    def evict(self, key: SegmentKey) -> bool:
        """Remove key; False if it was not cached."""
        return self._remove(key)

    def evict_lru(self) -> SegmentKey | None:
        """Remove the least recently used item (counted as an eviction); None when empty."""
        if not self._items:
            return None
        victim = next(iter(self._items))
        self._remove(victim)
        self._evictions += 1
        return victim

    def drop_fact(self, fact_id: str) -> int:
        """Remove every segment of this fact (all windows, all models) and every segment encoded
        with it as context. Returns how many went."""
        return sum(self._remove(k) for k in list(self._deps.get(fact_id, ())))

    def clear(self) -> int:
        """Remove everything (not counted as evictions). Returns how many went."""
        items = list(self._items.items())
        self._items.clear()
        self._deps.clear()
        self._uses.clear()
        self._bytes = 0
        if self._on_remove is not None:
            for key, value in items:
                self._on_remove(key, value)
        return len(items)

    def stats(self) -> CacheStats:
        return CacheStats(self._hits, self._misses, self._evictions, self._bytes,
                          len(self._items), self.capacity_bytes)

    def check_integrity(self) -> None:
        total = sum(int(v.nbytes) for v in self._items.values())
        if total != self._bytes:
            raise AssertionError(f"cache counts {self._bytes} bytes but holds {total}")
        if self._bytes > self.capacity_bytes:
            raise AssertionError(f"cache holds {self._bytes} bytes over capacity {self.capacity_bytes}")
        indexed = {k for keys in self._deps.values() for k in keys}
        stale = indexed - self._items.keys()
        if stale or self._uses.keys() != self._items.keys():
            raise AssertionError(f"context index names {len(stale)} uncached key(s)")
        if any(not keys for keys in self._deps.values()):
            raise AssertionError("context index holds an empty entry")

    def _remove(self, key: SegmentKey) -> bool:
        value = self._items.pop(key, None)
        if value is None:
            return False
        self._bytes -= int(value.nbytes)
        for fid in self._uses.pop(key):
            self._deps[fid].discard(key)
            if not self._deps[fid]:
                del self._deps[fid]
        if self._on_remove is not None:
            self._on_remove(key, value)
        return True
