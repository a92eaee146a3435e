"""Per-owner byte quota of the segment cache (memory_store/segment_cache.py) and of MemoryService
(memory_store/store.py, with and without an arena): an owner over its quota loses its own LRU
segments first, shared ("") segments never count, accounting holds on every removal path."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kv_transfer.segments import KVSegment
from memory_store.arena import SegmentArena
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.segment_cache import PutResult, SegmentCache, SegmentKey
from memory_store.store import MemoryService

M = "m"
MiB = 1024 * 1024


@dataclass(frozen=True)
class Blob:
    nbytes: int
    tag: str = ""


def fk(fact_id: str, window: int = 0) -> SegmentKey:
    return SegmentKey.for_fact(fact_id, window, M)


def ak(name: str) -> SegmentKey:
    return SegmentKey.for_anchor(name, M)


def recording(capacity: int, quota: int | None) -> tuple[SegmentCache, list[SegmentKey]]:
    removed: list[SegmentKey] = []
    return SegmentCache(capacity, on_remove=lambda k, _v: removed.append(k), owner_quota_bytes=quota), removed


# ---- SegmentCache -------------------------------------------------------------------------------

def test_quota_evicts_the_owners_own_lru_first_and_spares_others() -> None:
    c, removed = recording(100, 40)
    c.put(fk("a1"), Blob(20), owner="alice")
    c.put(fk("b1"), Blob(20), owner="bob")
    c.put(fk("b2"), Blob(20), owner="bob")
    c.get(fk("b1"))  # b2 is now bob's least recent, though a1 is the cache's
    r = c.put(fk("b3"), Blob(10), owner="bob")
    assert r == PutResult(stored=True, evicted=(fk("b2"),))
    assert removed == [fk("b2")]
    assert (c.owner_bytes("alice"), c.owner_bytes("bob"), c.stats().bytes) == (20, 30, 50)
    s = c.stats()
    assert (s.evictions, s.quota_evictions, s.owners, s.items) == (1, 1, 2, 3)
    c.check_integrity()


def test_quota_eviction_comes_before_the_global_lru_rule() -> None:
    c, removed = recording(100, 50)
    c.put(ak("sys"), Blob(40))
    c.put(fk("a1"), Blob(30), owner="alice")
    c.put(fk("b1"), Blob(20), owner="bob")
    c.put(fk("b2"), Blob(10), owner="bob")  # full: 100 bytes
    # bob: 30 + 25 > 50, so b1 goes; then 80 + 25 > 100, so the global LRU (the shared anchor) goes
    r = c.put(fk("b3"), Blob(25), owner="bob")
    assert r.stored and r.evicted == (fk("b1"), ak("sys")) and removed == [fk("b1"), ak("sys")]
    assert (c.owner_bytes(""), c.owner_bytes("alice"), c.owner_bytes("bob")) == (0, 30, 35)
    assert (c.stats().evictions, c.stats().quota_evictions, c.stats().owners) == (2, 1, 2)
    c.check_integrity()


def test_an_item_over_the_quota_is_refused_without_change() -> None:
    c, removed = recording(100, 40)
    c.put(fk("b1"), Blob(30, "old"), owner="bob")
    assert c.put(fk("b2"), Blob(41), owner="bob") == PutResult(stored=False, reason="over_quota")
    assert c.put(fk("b1"), Blob(41), owner="bob").reason == "over_quota"  # a re-put too: the old value stays
    assert c.put(fk("b3"), Blob(101), owner="bob").reason == "too_large"  # capacity is checked first
    assert c.get(fk("b1")) == Blob(30, "old") and fk("b2") not in c and removed == []
    assert (c.owner_bytes("bob"), c.stats().bytes, c.stats().evictions) == (30, 30, 0)
    assert (c.fits(40, "bob"), c.fits(41, "bob"), c.fits(41), c.fits(101)) == (True, False, True, False)
    assert c.put(fk("b4"), Blob(40), owner="bob").evicted == (fk("b1"),)  # exactly the quota fits
    c.check_integrity()


def test_shared_items_have_no_quota() -> None:
    c, removed = recording(100, 30)
    for i in range(3):
        assert c.put(ak(f"s{i}"), Blob(30)) == PutResult(stored=True)
    assert c.put(fk("a1"), Blob(10), owner="alice") == PutResult(stored=True)
    assert (c.owner_bytes(""), c.owner_bytes("alice"), c.stats().evictions, removed) == (90, 10, 0, [])
    assert c.put(ak("s3"), Blob(30)).evicted == (ak("s0"),)  # only the global rule: shared ones are LRU here
    assert c.stats().quota_evictions == 0
    c.check_integrity()


def test_without_a_quota_an_owner_may_fill_the_cache() -> None:
    c = SegmentCache(100)
    c.put(fk("a1"), Blob(10), owner="alice")
    for i in range(9):
        assert c.put(fk(f"b{i}"), Blob(10), owner="bob").evicted == ()
    assert c.put(fk("b9"), Blob(10), owner="bob").evicted == (fk("a1"),)
    assert (c.owner_bytes("alice"), c.owner_bytes("bob"), c.stats().owners, c.stats().quota_evictions) == (0, 100, 1, 0)
    c.check_integrity()


def test_owner_bytes_hold_across_every_removal_path() -> None:
    c, removed = recording(100, 60)
    c.put(fk("a1"), Blob(10), owner="alice")
    c.put(fk("a2"), Blob(15), owner="alice", context=["a1"])
    c.put(fk("b1"), Blob(20), owner="bob", context=["a1"])
    c.put(ak("sys"), Blob(5))
    assert (c.owner_bytes("alice"), c.owner_bytes("bob"), c.owner_bytes("")) == (25, 20, 5)
    c.put(fk("a2"), Blob(30), owner="alice", context=["a1"])  # replacement
    assert c.owner_bytes("alice") == 40 and removed == [fk("a2")]
    c.check_integrity()
    assert c.evict(fk("b1")) and c.owner_bytes("bob") == 0 and c.stats().owners == 2  # bob left the index
    c.check_integrity()
    assert c.evict_lru() == fk("a1") and c.owner_bytes("alice") == 30
    c.check_integrity()
    c.put(fk("b2"), Blob(20), owner="bob", context=["a2"])
    assert c.drop_fact("a2") == 2 and (c.owner_bytes("alice"), c.owner_bytes("bob")) == (0, 0)
    assert c.stats().owners == 1  # only the shared anchor is left
    c.check_integrity()
    c.put(fk("a3"), Blob(50), owner="alice")
    assert c.put(fk("b3"), Blob(60), owner="bob").evicted == (ak("sys"), fk("a3"))  # global LRU
    assert (c.owner_bytes(""), c.owner_bytes("alice"), c.owner_bytes("bob")) == (0, 0, 60)
    c.check_integrity()
    assert c.clear() == 1 and c.owner_bytes("bob") == 0 and c.stats().owners == 0
    c.check_integrity()
    assert c.put(fk("b3"), Blob(60), owner="bob").stored and c.owner_bytes("bob") == 60
    c.check_integrity()


@pytest.mark.parametrize(("corrupt", "match"), [
    (lambda c: c._owner_bytes.__setitem__("bob", c._owner_bytes["bob"] + 1), "per-owner bytes"),
    (lambda c: c._owner_bytes.__setitem__("ghost", 0), "per-owner bytes"),
    (lambda c: c._owned.__setitem__("ghost", OrderedDict()), "owner index"),
    (lambda c: c._owned["bob"].pop(fk("b1")), "owner index"),
    (lambda c: c._owner.pop(fk("b1")), "no owner"),
    (lambda c: setattr(c, "owner_quota_bytes", 10), "over the quota"),
])
def test_check_integrity_detects_corrupted_owner_accounting(corrupt, match) -> None:
    c = SegmentCache(100, owner_quota_bytes=50)
    c.put(fk("b1"), Blob(20), owner="bob")
    c.put(ak("sys"), Blob(30))
    c.check_integrity()
    corrupt(c)
    with pytest.raises(AssertionError, match=match):
        c.check_integrity()


def test_quota_must_be_positive() -> None:
    with pytest.raises(ValueError, match="owner_quota_bytes"):
        SegmentCache(100, owner_quota_bytes=0)


# ---- config -------------------------------------------------------------------------------------

def test_config_quota_field() -> None:
    assert MemoryConfig().user_segment_quota_mb is None and MemoryConfig().user_segment_quota_bytes is None
    assert MemoryConfig(user_segment_quota_mb=3).user_segment_quota_bytes == 3 * MiB
    with pytest.raises(ValidationError, match="user_segment_quota_mb"):
        MemoryConfig(user_segment_quota_mb=0)
    with pytest.raises(ValidationError, match="user_segment_quota"):
        MemoryConfig(user_segment_quota=1)  # type: ignore[call-arg]


# ---- MemoryService ------------------------------------------------------------------------------

def make(path: Path, arena: SegmentArena | None = None, **cfg) -> MemoryService:
    ticks = itertools.count(1000)
    db = FactStore(path, clock=lambda: float(next(ticks)))
    return MemoryService(MemoryConfig(embedder="hashing", **cfg), db, HashingEmbedder(), arena)


def kv(tokens: int, seed: int) -> KVSegment:
    """[1, T, 2, 64]: fp32 keys + bf16 values, 768 bytes a token (512 tokens: 96 arena units)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn((1, tokens, 2, 64), generator=g)
    return KVSegment(tuple(range(tokens)), keys, torch.randn((1, tokens, 2, 64), generator=g).to(torch.bfloat16))


@pytest.mark.parametrize(("quota_mb", "alice_kept"), [(1, 2), (None, 0)])
def test_service_quota_keeps_alices_segments_when_bob_floods(tmp_path: Path, quota_mb, alice_kept) -> None:
    svc = make(tmp_path / "m.sqlite3", segment_capacity_mb=4, user_segment_quota_mb=quota_mb)
    alice = [f.id for f in svc.add("alice", ["a one", "a two"])]
    bob = [f.id for f in svc.add("bob", [f"b {i}" for i in range(10)])]
    part = 400 * 1024  # 2 fit the 1 MiB quota, 3 do not; 10 fill the 4 MiB cache
    assert svc.put_segments("alice", [(fk(f), Blob(part), ()) for f in alice]) == 2
    assert svc.put_segments("alice", [(ak("sys"), Blob(part), ())]) == 1  # shared: no one's quota
    assert svc.put_segments("bob", [(fk(f), Blob(part), ()) for f in bob]) == 10
    assert len(svc.get_segments("alice", [fk(f) for f in alice])) == alice_kept
    cache = svc._segments
    assert cache.owner_bytes("alice") == alice_kept * part and cache.owner_bytes("") == (part if quota_mb else 0)
    if quota_mb:
        assert set(svc.get_segments("bob", [fk(f) for f in bob])) == {fk(bob[8]), fk(bob[9])}
        assert (svc.stats().quota_evictions, svc.stats().evictions) == (8, 8)
    svc.check_integrity()


def test_service_arena_quota_keeps_alices_segments_when_bob_floods(tmp_path: Path) -> None:
    arena = SegmentArena(4 * MiB, register=False)
    svc = make(tmp_path / "m.sqlite3", arena, user_segment_quota_mb=1)
    alice = [f.id for f in svc.add("alice", ["a one", "a two"])]
    bob = [f.id for f in svc.add("bob", [f"b {i}" for i in range(10)])]
    extent = arena.extent_bytes(kv(512, 0).nbytes)
    assert extent == 96 * 4096  # 2 fit the quota, 3 do not
    assert svc.put_segments("alice", [(fk(f), kv(512, i), ()) for i, f in enumerate(alice)]) == 2
    assert svc.put_segments("bob", [(fk(f), kv(512, 10 + i), ()) for i, f in enumerate(bob)]) == 10
    got = svc.get_segments("alice", [fk(f) for f in alice])
    assert set(got) == {fk(f) for f in alice} and torch.equal(got[fk(alice[1])].keys, kv(512, 1).keys)
    assert set(svc.get_segments("bob", [fk(f) for f in bob])) == {fk(bob[8]), fk(bob[9])}
    assert (svc._segments.owner_bytes("alice"), svc._segments.owner_bytes("bob")) == (2 * extent, 2 * extent)
    assert len(arena.live_offsets()) == 4 and arena._alloc.used_bytes == 4 * extent  # bob's old extents freed
    assert svc.stats().quota_evictions == 8
    svc.check_integrity()


def test_service_arena_over_quota_segment_evicts_nothing(tmp_path: Path) -> None:
    arena = SegmentArena(2 * MiB, register=False)
    svc = make(tmp_path / "m.sqlite3", arena, user_segment_quota_mb=1)
    (b,) = svc.add("bob", ["b one"])
    assert svc.put_segments("bob", [(ak(f"s{i}"), kv(512, i), ()) for i in range(5)]) == 5  # 480 of 512 units
    before = arena.live_offsets()
    huge = kv(1400, 9)  # 1400 * 768 bytes > 1 MiB, < the arena: it would need 3 anchors evicted
    assert arena.fits(huge.nbytes) and huge.nbytes > MiB
    assert svc.put_segments("bob", [(fk(b.id), huge, ())]) == 0
    assert arena.live_offsets() == before and svc.stats().evictions == 0 and len(svc._segments) == 5
    svc.check_integrity()


def test_service_arena_releases_the_extent_of_a_segment_the_cache_refuses(tmp_path: Path) -> None:
    arena = SegmentArena(2 * MiB, register=False)
    svc = make(tmp_path / "m.sqlite3", arena, user_segment_quota_mb=1)
    (b,) = svc.add("bob", ["b one"])
    assert svc.put_segments("bob", [(ak("s"), kv(512, 0), ())]) == 1
    svc._segments.fits = lambda *_a: True  # the pre-check passes: the arena copies, then put refuses
    assert svc.put_segments("bob", [(fk(b.id), kv(1400, 9), ())]) == 0
    assert len(arena.live_offsets()) == 1 and arena._alloc.used_bytes == 96 * 4096  # no orphan extent
    assert svc.get_segments("bob", [fk(b.id)]) == {}
    svc.check_integrity()


def test_service_anchors_count_against_no_user(tmp_path: Path) -> None:
    svc = make(tmp_path / "m.sqlite3", segment_capacity_mb=4, user_segment_quota_mb=1)
    (a,) = svc.add("alice", ["a one"])
    assert svc.put_segments("alice", [(ak("big"), Blob(2 * MiB), ()), (fk(a.id), Blob(MiB), ())]) == 2
    assert svc.put_segments("alice", [(fk(a.id, 1), Blob(MiB + 1), ())]) == 0  # over alice's quota
    cache = svc._segments
    assert (cache.owner_bytes(""), cache.owner_bytes("alice"), svc.stats().owners) == (2 * MiB, MiB, 2)
    svc.check_integrity()


def test_service_arena_full_an_owner_at_its_quota_evicts_its_own_first(tmp_path: Path) -> None:
    """The arena is full (alice 2, bob 2 at his quota, the rest shared anchors); bob's next segment
    must push out bob's own LRU, not alice's (nor an anchor) for a free extent."""
    arena = SegmentArena(5 * 96 * 4096, register=False)  # five 512-token extents
    svc = make(tmp_path / "m.sqlite3", arena, user_segment_quota_mb=1)
    alice = [f.id for f in svc.add("alice", ["a one", "a two"])]
    bob = [f.id for f in svc.add("bob", ["b one", "b two", "b three"])]
    assert svc.put_segments("alice", [(fk(f), kv(512, i), ()) for i, f in enumerate(alice)]) == 2
    assert svc.put_segments("bob", [(fk(f), kv(512, 10 + i), ()) for i, f in enumerate(bob[:2])]) == 2
    assert svc.put_segments("bob", [(ak("sys"), kv(512, 20), ())]) == 1
    assert arena._alloc.largest_free == 0  # full
    assert svc.put_segments("bob", [(fk(bob[2]), kv(512, 12), ())]) == 1
    assert set(svc.get_segments("alice", [fk(f) for f in alice])) == {fk(f) for f in alice}
    assert set(svc.get_segments("bob", [fk(f) for f in bob])) == {fk(bob[1]), fk(bob[2])}
    assert ak("sys") in svc._segments and svc.stats().quota_evictions == 1 and svc.stats().evictions == 1
    svc.check_integrity()
