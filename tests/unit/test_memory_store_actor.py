"""The memory-store actor's class (memory_store/deployment.py) outside Serve: its segment lookups and
their metrics. A Ray counter refuses an increment of 0, so a lookup that found every segment (or
none) used to raise, and the engine replica re-encoded what the store held."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from memory_store.config import MemoryConfig
from memory_store.deployment import MemoryStore
from memory_store.segment_cache import SegmentKey


@dataclass(frozen=True)
class _Seg:
    nbytes: int = 64


def _store(tmp_path) -> tuple[MemoryStore, list[SegmentKey]]:
    store = MemoryStore(MemoryConfig(embedder="hashing"), str(tmp_path / "facts.sqlite3"))
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
