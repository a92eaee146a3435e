"""SegmentCache: an engine-free LRU of encoded KV segments with a byte budget.

Keys say what a segment encodes: a fact's tokens encoded after its w predecessors
(kind "fact": fact_id, window, model), or a shared anchor such as a system-prompt prefix
(kind "anchor": a hash of its token ids, model). Values are opaque; they only expose `nbytes`.
A fact segment may be put with the ids of its context facts, so deleting any of them
(drop_fact) also drops the segments whose encoding saw it.

Each segment has an owner: the user a fact segment belongs to, or "" (shared, e.g. anchors). With
`owner_quota_bytes`, no owner but "" holds more than that: a put that would take its owner over
evicts that owner's own least recently used segments first, so one tenant with many facts cannot
push every other tenant's segments out (the global LRU rule applies only after that).

Invariant (check_integrity): bytes == sum(v.nbytes for v in items) <= capacity_bytes, the
context index only names cached keys, owner_bytes(o) == sum of o's items' nbytes (<= the quota
for o != ""), and an owner is indexed exactly while it holds at least one segment. Not
thread-safe: the memory-store actor serializes calls. "No room" is a value: put() returns
PutResult(stored=False, reason=...).
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
    evicted: tuple[SegmentKey, ...] = ()  # LRU victims pushed out to make room (the owner's own first)
    reason: Literal["", "too_large", "over_quota"] = ""


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int  # LRU evictions only (not evict()/drop_fact()), quota evictions included
    bytes: int
    items: int
    capacity_bytes: int
    quota_evictions: int = 0  # of `evictions`, those that made room within the owner's quota
    owners: int = 0  # owners holding at least one segment ("" counts when shared ones are cached)


class SegmentCache:
    def __init__(self, capacity_bytes: int, on_remove: Callable[[SegmentKey, Segment], None] | None = None,
                 owner_quota_bytes: int | None = None) -> None:
        """on_remove(key, value): called for every value that leaves the cache, however it leaves
        (LRU, quota, replaced, evict, drop_fact, clear): the memory store's arena frees its extent there.
        owner_quota_bytes: most bytes any one owner but "" may hold (None: no quota)."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        if owner_quota_bytes is not None and owner_quota_bytes <= 0:
            raise ValueError("owner_quota_bytes must be > 0 (or None)")
        self.capacity_bytes = capacity_bytes
        self.owner_quota_bytes = owner_quota_bytes
        self._on_remove = on_remove
        self._items: OrderedDict[SegmentKey, Segment] = OrderedDict()  # LRU first, MRU last
        self._deps: dict[str, set[SegmentKey]] = {}  # fact id -> keys whose encoding used it
        self._uses: dict[SegmentKey, frozenset[str]] = {}  # key -> fact ids it is indexed under
        self._owner: dict[SegmentKey, str] = {}  # key -> its owner
        self._owned: dict[str, OrderedDict[SegmentKey, None]] = {}  # owner -> its keys, LRU first
        self._owner_bytes: dict[str, int] = {}  # owner -> bytes of its keys
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._quota_evictions = 0

    def __contains__(self, key: SegmentKey) -> bool:  # no effect on recency or stats
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[Segment]:  # no effect on recency or stats
        return list(self._items.values())

    def fits(self, nbytes: int, owner: str = "") -> bool:
        """Whether an item of this size can ever be stored for `owner` (after evicting everything
        else): within the capacity and, for an owner other than "", within the quota."""
        return 0 <= nbytes <= self.capacity_bytes and not self._over_quota(nbytes, owner)

    def owner_bytes(self, owner: str) -> int:
        """Bytes of the segments `owner` holds ("" : the shared ones); 0 for an unknown owner."""
        return self._owner_bytes.get(owner, 0)

    def get(self, key: SegmentKey) -> Segment | None:
        value = self._items.get(key)
        if value is None:
            self._misses += 1
            return None
        self._hits += 1
        self._items.move_to_end(key)
        self._owned[self._owner[key]].move_to_end(key)
        return value

    def put(self, key: SegmentKey, value: Segment, *, context: Iterable[str] = (), owner: str = "") -> PutResult:
        """Store value under key for `owner` (replacing any old value). First, while the owner
        would exceed its quota, its own least recently used items are evicted; then least recently
        used items of anyone, until it fits the capacity. `context`: ids of the facts the segment
        was encoded after. An item larger than the capacity ("too_large") or than the quota
        ("over_quota") is refused and the cache is left unchanged."""
        size = int(value.nbytes)
        if not 0 <= size <= self.capacity_bytes:
            return PutResult(stored=False, reason="too_large")
        if self._over_quota(size, owner):
            return PutResult(stored=False, reason="over_quota")
        self._remove(key)
        evicted = self.make_room_in_quota(owner, size)
        while self._bytes + size > self.capacity_bytes:
            victim = next(iter(self._items))
            self._remove(victim)
            self._evictions += 1
            evicted.append(victim)
        self._items[key] = value
        self._bytes += size
        self._owner[key] = owner
        self._owned.setdefault(owner, OrderedDict())[key] = None
        self._owner_bytes[owner] = self.owner_bytes(owner) + size
        uses = frozenset({key.fact_id, *context} - {""})
        self._uses[key] = uses
        for fid in uses:
            self._deps.setdefault(fid, set()).add(key)
        return PutResult(stored=True, evicted=tuple(evicted))

    def make_room_in_quota(self, owner: str, nbytes: int) -> list[SegmentKey]:
        """Evict the owner's own least recently used items until `nbytes` more fit its quota
        (counted as quota evictions); returns them. The caller has checked that nbytes alone
        fits the quota (`fits`). The arena's put calls this before it evicts anyone else's
        items for a contiguous extent."""
        evicted = []
        while self._owned.get(owner) and self._over_quota(self.owner_bytes(owner) + nbytes, owner):
            victim = next(iter(self._owned[owner]))
            self._remove(victim)
            self._evictions += 1
            self._quota_evictions += 1
            evicted.append(victim)
        return evicted

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
        self._owner.clear()
        self._owned.clear()
        self._owner_bytes.clear()
        self._bytes = 0
        if self._on_remove is not None:
            for key, value in items:
                self._on_remove(key, value)
        return len(items)

    def stats(self) -> CacheStats:
        return CacheStats(self._hits, self._misses, self._evictions, self._bytes,
                          len(self._items), self.capacity_bytes, self._quota_evictions, len(self._owned))

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
        owned: dict[str, set[SegmentKey]] = {}
        held: dict[str, int] = {}
        for key, value in self._items.items():
            owner = self._owner.get(key)
            if owner is None:
                raise AssertionError(f"cached key {key} has no owner")
            owned.setdefault(owner, set()).add(key)
            held[owner] = held.get(owner, 0) + int(value.nbytes)
        if self._owner.keys() != self._items.keys() or {o: set(ks) for o, ks in self._owned.items()} != owned:
            raise AssertionError("owner index and cached keys differ (or an owner without segments is indexed)")
        if self._owner_bytes != held:
            raise AssertionError(f"per-owner bytes {self._owner_bytes} but owners hold {held}")
        if over := sorted(o for o, n in held.items() if self._over_quota(n, o)):
            raise AssertionError(f"owner(s) {over} over the quota of {self.owner_quota_bytes} bytes")

    def _over_quota(self, nbytes: int, owner: str) -> bool:
        return bool(owner) and self.owner_quota_bytes is not None and nbytes > self.owner_quota_bytes

    def _remove(self, key: SegmentKey) -> bool:
        value = self._items.pop(key, None)
        if value is None:
            return False
        size = int(value.nbytes)
        self._bytes -= size
        owner = self._owner.pop(key)
        self._owner_bytes[owner] -= size
        del self._owned[owner][key]
        if not self._owned[owner]:  # an owner without segments leaves the index
            del self._owned[owner], self._owner_bytes[owner]
        for fid in self._uses.pop(key):
            self._deps[fid].discard(key)
            if not self._deps[fid]:
                del self._deps[fid]
        if self._on_remove is not None:
            self._on_remove(key, value)
        return True
