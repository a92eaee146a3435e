"""The memory-store actor's class (memory_store/deployment.py) outside Serve: its segment lookups and
their metrics. A Ray counter refuses an increment of 0, so a lookup that found every segment (or
none) used to raise, and the engine replica re-encoded what the store held."""
from __future__ import annotations

import asyncio

import torch

from kv_transfer.segment_refs import SegmentRef
from kv_transfer.segments import KVSegment
from memory_store.config import MemoryConfig
from memory_store.deployment import MemoryStore
from memory_store.segment_cache import SegmentKey


def _Seg(n: int = 3) -> KVSegment:
    return KVSegment(tuple(range(n)), torch.randn(2, n, 2, 8), torch.randn(2, n, 2, 8).to(torch.bfloat16))


def _store(tmp_path, transport: str = "ray") -> tuple[MemoryStore, list[SegmentKey]]:
    cfg = MemoryConfig(embedder="hashing", segment_capacity_mb=1, segment_transport=transport)
    store = MemoryStore(cfg, str(tmp_path / "facts.sqlite3"))
    facts = asyncio.run(store.add("u1", ["likes tea", "has a dog named Biscuit"]))
    keys = [SegmentKey.for_fact(f.id, 2, "m") for f in facts]
    return store, keys


def test_lookup_that_finds_every_segment_returns_them(tmp_path):
    store, keys = _store(tmp_path)
    assert asyncio.run(store.put_segments("u1", [(k, _Seg(), ()) for k in keys])) == 2
    found = asyncio.run(store.get_segments("u1", keys))
    assert set(found) == set(keys)


def test_lookup_that_finds_nothing_returns_empty(tmp_path):
    store, keys = _store(tmp_path)
    assert asyncio.run(store.get_segments("u1", keys)) == {}


def test_partial_lookup_returns_the_held_ones(tmp_path):
    store, keys = _store(tmp_path)
    asyncio.run(store.put_segments("u1", [(keys[0], _Seg(), ())]))
    assert set(asyncio.run(store.get_segments("u1", keys))) == {keys[0]}
    asyncio.run(store.check_integrity())


def test_lookup_copies_segments_out_of_the_arena(tmp_path):
    store, keys = _store(tmp_path)
    seg = _Seg()
    asyncio.run(store.put_segments("u1", [(keys[0], seg, ())]))
    got = asyncio.run(store.get_segments("u1", keys[:1], True))[keys[0]]  # by_ref, but no NIXL: a copy
    assert isinstance(got, KVSegment) and got.token_ids == seg.token_ids
    assert torch.equal(got.keys, seg.keys) and torch.equal(got.values, seg.values)
    assert asyncio.run(store.arena_peer()) is None


def test_lookup_by_ref_leases_arena_extents(tmp_path):
    store, keys = _store(tmp_path, "nixl")
    asyncio.run(store.put_segments("u1", [(keys[0], _Seg(), ())]))
    got = asyncio.run(store.get_segments("u1", keys[:1], True))[keys[0]]
    assert isinstance(got, SegmentRef) and got.nbytes == _Seg().nbytes
    assert isinstance(asyncio.run(store.arena_peer()), bytes)
    assert isinstance(asyncio.run(store.get_segments("u1", keys[:1]))[keys[0]], KVSegment)  # not by_ref: a copy
    asyncio.run(store.check_integrity())
