"""SegmentArena (memory_store/arena.py) without NIXL (register=False) and a fake clock for leases,
and MemoryService (memory_store/store.py) holding its segments in one: LRU eviction until a free
extent fits, deletes freeing extents, copies out, integrity throughout."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kv_transfer.segment_refs import SegmentRef
from kv_transfer.segments import KVSegment
from memory_store.arena import SegmentArena
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.segment_cache import SegmentKey
from memory_store.store import MemoryService

M = "m"
U = 4096  # the arena's alignment: one extent unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def seg(tokens: int, seed: int = 0) -> KVSegment:
    """KV of `tokens` tokens: [1, T, 2, 64], fp32 keys + bf16 values = 768 bytes a token
    (5 tokens: 1 unit, 10: 2 units, 16: 3 units, 21: 4 units, 22: 5 units)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn((1, tokens, 2, 64), generator=g)
    values = torch.randn((1, tokens, 2, 64), generator=g).to(torch.bfloat16)
    return KVSegment(tuple(range(seed * 1000, seed * 1000 + tokens)), keys, values)


def same(a: KVSegment, b: KVSegment) -> bool:
    return (a.token_ids == b.token_ids and a.keys.dtype == b.keys.dtype and a.values.dtype == b.values.dtype
            and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values))


def fake_nixl(arena: SegmentArena) -> None:
    # lease() only checks that an agent exists and names it in the SegmentRef; it never calls the
    # agent. Tests must not start NIXL, so a placeholder object stands in for it.
    arena._agent = object()
    arena.agent_name = "fake"


# ---- SegmentArena ---------------------------------------------------------------------------------

def test_put_load_round_trip_and_load_is_a_copy() -> None:
    a = SegmentArena(4 * U, register=False)
    assert (a.capacity_bytes, a.serves_refs, a.agent_name, a.live_offsets(), a.waiting_bytes) == (4 * U, False, "", set(), 0)
    s = seg(10, seed=1)
    e = a.put(s)
    assert e is not None and (e.offset, e.nbytes, e.layout.nbytes) == (0, 2 * U, 7680)
    assert e.layout.token_ids == s.token_ids and e.layout.value_dtype == "bfloat16"
    assert a.live_offsets() == {0}
    a.check_integrity()
    got = a.load(e)
    assert same(got, s)
    got.keys.zero_()
    got.values.fill_(7)
    again = a.load(e)
    assert same(again, s)  # the arena was untouched by mutating the copy
    assert again.keys.data_ptr() != got.keys.data_ptr()
    with pytest.raises(RuntimeError, match="not registered"):
        a.lease(e)
    with pytest.raises(RuntimeError, match="not registered"):
        a.agent_metadata()
    a.check_integrity()


def test_put_returns_none_when_full_and_release_frees_space() -> None:
    a = SegmentArena(4 * U, register=False)
    e1 = a.put(seg(16, 1))  # 3 units
    assert e1 is not None and e1.nbytes == 3 * U
    e2 = a.put(seg(5, 2))  # 1 unit
    assert e2 is not None and e2.offset == 3 * U
    a.check_integrity()
    assert a.put(seg(5, 3)) is None
    assert a.live_offsets() == {0, 3 * U}
    a.check_integrity()
    a.release(e1)
    assert a.live_offsets() == {3 * U}
    a.check_integrity()
    e3 = a.put(seg(10, 3))  # 2 units fit where e1 was
    assert e3 is not None and e3.offset == 0
    assert same(a.load(e3), seg(10, 3)) and same(a.load(e2), seg(5, 2))
    a.check_integrity()
    a.release(e1)  # twice: a no-op
    a.release(e1)
    assert a.live_offsets() == {0, 3 * U}
    a.check_integrity()


def test_fits_says_whether_a_segment_could_ever_be_held() -> None:
    a = SegmentArena(4 * U + 100, register=False)
    assert a.capacity_bytes == 4 * U
    assert a.fits(4 * U) and a.fits(1) and not a.fits(4 * U + 1)
    assert a.put(seg(22)) is None  # 5 units: never
    assert a.put(seg(21)) is not None
    a.check_integrity()
    with pytest.raises(ValueError, match="lease_s"):
        SegmentArena(U, register=False, lease_s=0)


def test_released_entry_is_gone_even_when_its_offset_is_reused() -> None:
    a = SegmentArena(2 * U, register=False)
    fake_nixl(a)
    old = a.put(seg(5, 1))
    assert old is not None
    a.release(old)
    new = a.put(seg(5, 2))
    assert new is not None and new.offset == old.offset == 0
    for op in (a.load, a.lease):
        with pytest.raises(KeyError):
            op(old)
    assert same(a.load(new), seg(5, 2))
    a.release(old)  # a stale entry does not release the new one
    assert a.live_offsets() == {0}
    a.check_integrity()


def test_leased_extent_is_not_reused_until_the_lease_ends() -> None:
    clock = Clock()
    a = SegmentArena(2 * U, register=False, lease_s=10.0, clock=clock)
    fake_nixl(a)
    e0 = a.put(seg(5, 1))
    e1 = a.put(seg(5, 2))
    assert e0 is not None and e1 is not None
    ref = a.lease(e0)
    assert isinstance(ref, SegmentRef)
    assert (ref.agent, ref.addr, ref.device_id, ref.mem_type, ref.lease_s) == ("fake", a._buf.data_ptr(), 0, "DRAM", 10.0)
    assert ref.layout == e0.layout and ref.nbytes == 3840
    assert a._leased_until == {0: 110.0}
    a.check_integrity()
    clock.t = 105.0
    a.release(e0)  # leased until 110: held, not freed
    assert a.live_offsets() == {U} and a.waiting_bytes == U
    assert a._alloc.used_bytes == 2 * U
    a.check_integrity()
    with pytest.raises(KeyError):
        a.load(e0)
    assert a.put(seg(5, 3)) is None  # its extent is still the reader's
    a.check_integrity()
    clock.t = 109.999
    assert a.put(seg(5, 3)) is None
    clock.t = 110.0
    e2 = a.put(seg(5, 3))  # the lease ran out: reaped, reused
    assert e2 is not None and e2.offset == 0
    assert a.waiting_bytes == 0 and a.live_offsets() == {0, U}
    assert a.load(e2).token_ids == seg(5, 3).token_ids
    a.check_integrity()


def test_a_later_lease_extends_and_an_expired_lease_frees_at_once() -> None:
    clock = Clock()
    a = SegmentArena(2 * U, register=False, lease_s=10.0, clock=clock)
    fake_nixl(a)
    e = a.put(seg(5))
    assert e is not None
    a.lease(e)
    clock.t = 104.0
    a.lease(e)
    assert a._leased_until == {0: 114.0}
    clock.t = 112.0
    a.release(e)
    assert a.waiting_bytes == U
    a.check_integrity()
    clock.t = 114.0
    e2 = a.put(seg(10))  # needs both units: only once the waiting extent is reaped
    assert e2 is not None and e2.offset == 0 and a.waiting_bytes == 0
    a.check_integrity()
    a.lease(e2)
    clock.t = 200.0  # long after the lease
    a.release(e2)
    assert a.waiting_bytes == 0 and a._alloc.used_bytes == 0 and a._leased_until == {}
    a.check_integrity()


def test_check_integrity_detects_disagreement() -> None:
    a = SegmentArena(2 * U, register=False)
    e = a.put(seg(5))
    assert e is not None
    a.check_integrity()
    del a._live[0]  # allocated, but neither live nor waiting
    with pytest.raises(AssertionError, match="disagree"):
        a.check_integrity()
    a._live[0] = e
    a._waiting[0] = 1.0
    with pytest.raises(AssertionError, match="both live and waiting"):
        a.check_integrity()


def test_put_that_pack_rejects_leaks_no_extent() -> None:
    a = SegmentArena(2 * U, register=False)
    empty = KVSegment((), torch.zeros(1, 0, 2, 64), torch.zeros(1, 0, 2, 64, dtype=torch.bfloat16))  # a valid KVSegment
    with pytest.raises(ValueError):
        a.put(empty)
    # keys whose bytes do not end on a value-dtype boundary: refused while packing, after the allocation
    odd = KVSegment((1,), torch.zeros(1, 1, 1, 1, dtype=torch.float16), torch.zeros(1, 1, 1, 1))
    with pytest.raises(RuntimeError):
        a.put(odd)
    assert a._alloc.used_bytes == 0 and a.live_offsets() == set()
    a.check_integrity()


# ---- MemoryService with an arena ------------------------------------------------------------------

@dataclass(frozen=True)
class Blob:
    nbytes: int


def make(path: Path, arena: SegmentArena) -> MemoryService:
    ticks = itertools.count(1000)
    db = FactStore(path, clock=lambda: float(next(ticks)))
    return MemoryService(MemoryConfig(embedder="hashing"), db, HashingEmbedder(), arena)


def ak(name: str) -> SegmentKey:
    return SegmentKey.for_anchor(name, M)


def fk(fid: str) -> SegmentKey:
    return SegmentKey.for_fact(fid, 0, M)


def test_service_stores_into_the_arena_and_answers_copies(tmp_path: Path) -> None:
    arena = SegmentArena(8 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    assert svc.arena is arena and svc.stats().capacity_bytes == 8 * U
    (f,) = svc.add("alice", ["Alice has a dog"])
    s1, s2 = seg(5, 1), seg(10, 2)
    assert svc.put_segments("alice", [(fk(f.id), s1, ()), (ak("sys"), s2, ())]) == 2
    assert arena.live_offsets() == {0, U}
    st = svc.stats()
    assert (st.items, st.bytes, st.evictions) == (2, 3 * U, 0)  # extents' lengths are what counts
    svc.check_integrity()
    got = svc.get_segments("alice", [fk(f.id), ak("sys"), ak("missing")])
    assert set(got) == {fk(f.id), ak("sys")}
    assert all(type(v) is KVSegment for v in got.values())
    assert same(got[fk(f.id)], s1) and same(got[ak("sys")], s2)
    got[ak("sys")].values.zero_()  # a copy: the arena keeps the original
    assert same(svc.get_segments("bob", [ak("sys")])[ak("sys")], s2)
    svc.check_integrity()


def test_service_by_ref_without_nixl_answers_copies(tmp_path: Path) -> None:
    arena = SegmentArena(4 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    s = seg(5, 3)
    assert svc.put_segments("alice", [(ak("a"), s, ())]) == 1
    got = svc.get_segments("alice", [ak("a")], by_ref=True)
    assert list(got) == [ak("a")] and type(got[ak("a")]) is KVSegment and same(got[ak("a")], s)
    svc.check_integrity()


def test_service_by_ref_leases_and_a_leased_victim_waits(tmp_path: Path) -> None:
    clock = Clock()
    arena = SegmentArena(2 * U, register=False, lease_s=10.0, clock=clock)
    fake_nixl(arena)
    svc = make(tmp_path / "m.sqlite3", arena)
    assert svc.put_segments("alice", [(ak("a"), seg(5, 1), ()), (ak("b"), seg(5, 2), ())]) == 2
    refs = svc.get_segments("alice", [ak("a")], by_ref=True)
    assert isinstance(refs[ak("a")], SegmentRef) and refs[ak("a")].addr == arena._buf.data_ptr()
    # a is the most recent now, b the LRU; the arena is full: b goes (free at once), then a fits
    assert svc.put_segments("alice", [(ak("c"), seg(5, 3), ())]) == 1
    assert (ak("b") in svc._segments, ak("a") in svc._segments) == (False, True)
    assert arena.live_offsets() == {0, U} and svc.stats().evictions == 1
    svc.check_integrity()
    # a 2-unit segment: evicting a (now the LRU) leaves its leased extent waiting, evicting c frees U:
    # no 2 contiguous units, and nothing left to evict
    assert svc.put_segments("alice", [(ak("d"), seg(10, 4), ())]) == 0
    assert len(svc._segments) == 0 and arena.waiting_bytes == U and svc.stats().evictions == 3
    svc.check_integrity()
    clock.t = 110.0
    assert svc.put_segments("alice", [(ak("d"), seg(10, 4), ())]) == 1
    assert arena.waiting_bytes == 0 and arena.live_offsets() == {0}
    svc.check_integrity()


def test_service_refuses_a_segment_larger_than_the_arena(tmp_path: Path) -> None:
    arena = SegmentArena(4 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    assert svc.put_segments("alice", [(ak("small"), seg(5, 1), ())]) == 1
    assert svc.put_segments("alice", [(ak("huge"), seg(22, 2), ())]) == 0  # 5 units > 4
    assert svc.get_segments("alice", [ak("huge")]) == {}
    assert ak("small") in svc._segments and svc.stats().evictions == 0  # nothing was evicted for it
    assert arena.live_offsets() == {0}
    svc.check_integrity()


def test_service_filling_the_arena_evicts_lru(tmp_path: Path) -> None:
    arena = SegmentArena(4 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    for i in range(4):
        assert svc.put_segments("alice", [(ak(f"k{i}"), seg(5, i), ())]) == 1
        svc.check_integrity()
    assert arena.live_offsets() == {0, U, 2 * U, 3 * U} and svc.stats().evictions == 0
    svc.get_segments("alice", [ak("k0")])  # k0 is now the most recent; k1 the oldest
    assert svc.put_segments("alice", [(ak("k4"), seg(5, 4), ())]) == 1
    st = svc.stats()
    assert (st.evictions, st.items, st.bytes) == (1, 4, 4 * U)
    got = svc.get_segments("alice", [ak(f"k{i}") for i in range(5)])
    assert set(got) == {ak("k0"), ak("k2"), ak("k3"), ak("k4")}
    assert same(got[ak("k4")], seg(5, 4)) and same(got[ak("k0")], seg(5, 0))
    svc.check_integrity()
    # extents: k0 at 0, k4 at U (k1's), k2 at 2U, k3 at 3U; recency k0 < k2 < k3 < k4 (just read in order).
    # A 3-unit segment: evicting k0, k2, k3 frees 3 units but k4 at U splits them, so k4 goes too
    assert svc.put_segments("alice", [(ak("big"), seg(16, 9), ())]) == 1
    assert svc.stats().evictions == 5 and arena.live_offsets() == {0}
    left = svc.get_segments("alice", [ak(f"k{i}") for i in range(5)] + [ak("big")])
    assert set(left) == {ak("big")} and same(left[ak("big")], seg(16, 9))
    svc.check_integrity()


def test_service_fragmentation_evicts_until_a_contiguous_extent_fits(tmp_path: Path) -> None:
    arena = SegmentArena(4 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    facts = svc.add("alice", ["fact a", "fact b", "fact c", "fact d"])
    fa, fb, fc, fd = (f.id for f in facts)
    assert svc.put_segments("alice", [(fk(fid), seg(5, i), ()) for i, fid in enumerate((fa, fb, fc, fd))]) == 4
    assert svc.delete("alice", [fb, fd]) == 2
    assert arena.live_offsets() == {0, 2 * U}  # a and c; free: [U, 2U) and [3U, 4U)
    assert arena._alloc.largest_free == U and arena.capacity_bytes - arena._alloc.used_bytes == 2 * U
    svc.check_integrity()
    # 2 free units in total, but not contiguous: a (the LRU) is evicted, then [0, 2U) fits
    assert svc.put_segments("alice", [(ak("wide"), seg(10, 7), ())]) == 1
    st = svc.stats()
    assert (st.evictions, st.items, st.bytes) == (1, 2, 3 * U)
    assert arena.live_offsets() == {0, 2 * U}
    got = svc.get_segments("alice", [fk(fa), fk(fc), ak("wide")])
    assert set(got) == {fk(fc), ak("wide")} and same(got[ak("wide")], seg(10, 7)) and same(got[fk(fc)], seg(5, 2))
    svc.check_integrity()


def test_service_delete_frees_extents_and_context_dependants(tmp_path: Path) -> None:
    arena = SegmentArena(8 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    f1, f2, f3 = svc.add("alice", ["one", "two", "three"])
    assert svc.put_segments("alice", [(fk(f1.id), seg(5, 1), ()), (fk(f2.id), seg(5, 2), (f1.id,)),
                                      (fk(f3.id), seg(10, 3), ())]) == 3
    assert arena.live_offsets() == {0, U, 2 * U}
    svc.check_integrity()
    assert svc.delete("alice", [f1.id]) == 1  # f2's segment was encoded after f1: it goes too
    assert arena.live_offsets() == {2 * U} and arena._alloc.used_bytes == 2 * U
    assert svc.stats().evictions == 0
    svc.check_integrity()
    assert svc.delete_all("alice") == 2
    assert arena.live_offsets() == set() and arena._alloc.used_bytes == 0 and svc.stats().bytes == 0
    svc.check_integrity()


def test_service_re_put_replaces_and_frees_the_old_extent(tmp_path: Path) -> None:
    arena = SegmentArena(3 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    assert svc.put_segments("alice", [(ak("a"), seg(10, 1), ()), (ak("b"), seg(5, 2), ())]) == 2
    assert svc.put_segments("alice", [(ak("a"), seg(10, 3), ())]) == 1  # needs 2 units: a's own are reused
    assert svc.stats().evictions == 0 and arena.live_offsets() == {0, 2 * U}
    got = svc.get_segments("alice", [ak("a"), ak("b")])
    assert same(got[ak("a")], seg(10, 3)) and same(got[ak("b")], seg(5, 2))
    svc.check_integrity()


def test_service_refuses_values_that_are_not_kv_segments(tmp_path: Path) -> None:
    arena = SegmentArena(4 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    assert svc.put_segments("alice", [(ak("real"), seg(5), ())]) == 1
    assert svc.put_segments("alice", [(ak("blob"), Blob(10), ()), (ak("str"), "kv", ())]) == 0  # type: ignore[list-item]
    assert svc.get_segments("alice", [ak("blob"), ak("str")]) == {}
    assert svc.stats().items == 1 and arena.live_offsets() == {0}
    svc.check_integrity()


def test_service_put_of_a_zero_token_segment_leaves_the_arena_consistent(tmp_path: Path) -> None:
    arena = SegmentArena(2 * U, register=False)
    svc = make(tmp_path / "m.sqlite3", arena)
    empty = KVSegment((), torch.zeros(1, 0, 2, 64), torch.zeros(1, 0, 2, 64, dtype=torch.bfloat16))
    odd = KVSegment((1,), torch.zeros(1, 1, 1, 1, dtype=torch.float16), torch.zeros(1, 1, 1, 1))
    assert svc.put_segments("alice", [(ak("empty"), empty, ()), (ak("odd"), odd, ())]) == 0  # not cached, no error
    assert arena.live_offsets() == set() and svc.stats().items == 0
    svc.check_integrity()
