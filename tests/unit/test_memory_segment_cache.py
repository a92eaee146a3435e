"""SegmentCache: LRU by bytes, refusal as a value, drop_fact through context, stats."""

from dataclasses import dataclass

import pytest

from memory_store.segment_cache import PutResult, SegmentCache, SegmentKey

M = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Blob:
    nbytes: int
    tag: str = ""


def fk(fact_id, window=2):
    return SegmentKey.for_fact(fact_id, window, M)


def test_get_put_hits_misses():
    c = SegmentCache(100)
    assert c.get(fk("a")) is None
    assert c.put(fk("a"), Blob(30, "a")) == PutResult(stored=True)
    assert c.get(fk("a")) == Blob(30, "a")
    assert c.get(fk("a", window=0)) is None  # another window is another segment
    assert c.get(SegmentKey.for_fact("a", 2, "other-model")) is None
    s = c.stats()
    assert (s.hits, s.misses, s.items, s.bytes, s.evictions) == (1, 3, 1, 30, 0)
    c.check_integrity()


def test_lru_eviction_order_follows_use():
    c = SegmentCache(100)
    for name in "abc":
        c.put(fk(name), Blob(30))
    c.get(fk("a"))  # a is now most recent; b is least
    r = c.put(fk("d"), Blob(30))
    assert r.stored and r.evicted == (fk("b"),)
    r = c.put(fk("e"), Blob(60))
    assert r.evicted == (fk("c"), fk("a"))
    assert fk("d") in c and fk("e") in c and len(c) == 2
    assert c.stats().evictions == 3 and c.stats().bytes == 90
    c.check_integrity()


def test_too_large_is_refused_without_change():
    c = SegmentCache(100)
    c.put(fk("a"), Blob(50))
    r = c.put(fk("big"), Blob(101))
    assert r == PutResult(stored=False, reason="too_large")
    assert fk("a") in c and fk("big") not in c and c.stats().bytes == 50
    assert c.put(fk("exact"), Blob(100)).evicted == (fk("a"),)
    c.check_integrity()


def test_replace_updates_bytes():
    c = SegmentCache(100)
    c.put(fk("a"), Blob(40))
    c.put(fk("a"), Blob(70, "new"))
    assert c.stats().bytes == 70 and len(c) == 1 and c.get(fk("a")).tag == "new"
    c.check_integrity()


def test_evict_and_drop_fact_with_context():
    c = SegmentCache(1000)
    c.put(fk("a", 0), Blob(10))
    c.put(fk("a", 2), Blob(10))
    c.put(fk("b", 2), Blob(10), context=["a"])  # b encoded after a
    c.put(fk("c", 0), Blob(10))
    anchor = SegmentKey.for_anchor("sys-hash", M)
    c.put(anchor, Blob(10))
    assert c.evict(fk("c", 0)) and not c.evict(fk("c", 0))
    assert c.drop_fact("a") == 3
    assert len(c) == 1 and anchor in c and c.stats().bytes == 10
    assert c.drop_fact("a") == 0
    c.check_integrity()


def test_evicted_context_segments_leave_no_index_entries():
    c = SegmentCache(20)
    c.put(fk("b"), Blob(10), context=["a"])
    c.put(fk("c"), Blob(10), context=["a", "b"])
    c.put(fk("d"), Blob(10))  # evicts b
    assert c.drop_fact("a") == 1 and len(c) == 1  # only c was still there
    c.check_integrity()


def test_check_integrity_detects_drift():
    c = SegmentCache(100)
    c.put(fk("a"), Blob(10))
    c._bytes += 1
    with pytest.raises(AssertionError, match="bytes"):
        c.check_integrity()


@pytest.mark.parametrize("kwargs", [
    {"kind": "fact", "model": M}, {"kind": "fact", "model": M, "fact_id": "a", "anchor": "h"},
    {"kind": "fact", "model": M, "fact_id": "a", "window": -1}, {"kind": "anchor", "model": M},
    {"kind": "anchor", "model": M, "anchor": "h", "fact_id": "a"}, {"kind": "fact", "model": "", "fact_id": "a"},
    {"kind": "other", "model": M, "fact_id": "a"},
])
def test_bad_keys(kwargs):
    with pytest.raises(ValueError):
        SegmentKey(**kwargs)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        SegmentCache(0)


def test_clear_empties_the_cache_and_its_context_index():
    c = SegmentCache(100)
    c.put(fk("a"), Blob(10))
    c.put(fk("b"), Blob(10), context=["a"])
    assert c.clear() == 2 and len(c) == 0 and c.stats().bytes == 0 and c.stats().evictions == 0
    c.check_integrity()
    assert c.drop_fact("a") == 0
    assert c.put(fk("b"), Blob(10), context=["a"]).stored and c.drop_fact("a") == 1
    c.check_integrity()
