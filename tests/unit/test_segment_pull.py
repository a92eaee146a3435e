"""Replicas read memory segments out of the memory store's NIXL-registered arena
(memory_store/arena.py, kv_transfer/segment_pull.py, the pull path of memory_store/resolver.py).

Real NIXL: the arena's agent (with a progress thread, as in the store actor) and a puller's agent
live in this one process and move bytes over UCX exactly as between two processes. The resolver
tests run it behind a store handle over a real MemoryService (SQLite in tmp_path) and check what
was read, what was encoded instead, and that a failed or late read is never used."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_memory_purge import Engine, StoreHandle, chat_injection

from kv_transfer.nixl_agents import NixlUnavailable, make_agent
from kv_transfer.segment_pull import LEASE_MARGIN, PullFailed, SegmentPuller
from kv_transfer.segment_refs import SegmentRef
from kv_transfer.segments import KVSegment
from memory_store.arena import SegmentArena
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.resolver import SegmentResolver, anchor_key, fact_key
from memory_store.store import MemoryService

try:
    make_agent("baton-probe", progress_thread=False)
except NixlUnavailable as e:  # the project installs nixl: a missing one is a broken set-up, but say so
    pytest.skip(f"NIXL cannot run here: {e}", allow_module_level=True)


def seg(n: int, seed: int, value_dtype: torch.dtype = torch.bfloat16) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    return KVSegment(tuple(range(seed, seed + n)), torch.randn(3, n, 2, 16, generator=g),
                     torch.randn(3, n, 2, 16, generator=g).to(value_dtype))


@pytest.fixture(scope="module")
def arena() -> SegmentArena:
    a = SegmentArena(8 << 20)
    assert a.serves_refs, "the arena's NIXL agent did not start"
    return a


@pytest.fixture(scope="module")
def puller(arena: SegmentArena) -> SegmentPuller:
    p = SegmentPuller.create()
    assert p.add_peer(arena.agent_metadata()) == arena.agent_name
    return p


def same(a: KVSegment, b: KVSegment) -> bool:
    return (a.token_ids == b.token_ids and a.keys.dtype == b.keys.dtype and a.values.dtype == b.values.dtype
            and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values))


def test_a_read_moves_each_extent_bit_for_bit(arena: SegmentArena, puller: SegmentPuller) -> None:
    originals = [seg(7, 1), seg(40, 2, torch.float32), seg(1, 3, torch.float16)]
    entries = [arena.put(s) for s in originals]
    refs = [arena.lease(e) for e in entries if e is not None]
    assert len(refs) == 3 and all(isinstance(r, SegmentRef) for r in refs)
    result = puller.read(refs, asked_at=__import__("time").monotonic())
    assert all(same(a, b) for a, b in zip(result.segments, originals, strict=True))
    assert result.nbytes == sum(s.nbytes for s in originals)
    ptrs = {s.keys.data_ptr() for s in result.segments}
    assert len(ptrs) == 3 and arena._buf.data_ptr() not in ptrs  # each lands in its own tensor, not a view of the arena
    for e in entries:
        arena.release(e)
    arena.check_integrity()


def test_a_read_past_its_lease_is_discarded(arena: SegmentArena, puller: SegmentPuller) -> None:
    import time

    e = arena.put(seg(5, 4))
    ref = arena.lease(e)
    with pytest.raises(PullFailed, match="lease"):
        puller.read([ref], asked_at=time.monotonic() - LEASE_MARGIN * ref.lease_s)
    arena.release(e)


def test_refs_of_an_unknown_peer_or_of_two_peers_are_refused(arena: SegmentArena, puller: SegmentPuller) -> None:
    import dataclasses
    import time

    e = arena.put(seg(5, 5))
    ref = arena.lease(e)
    stranger = dataclasses.replace(ref, agent="baton-memory-unknown")
    for refs in ([stranger], [ref, stranger]):
        with pytest.raises(PullFailed, match="peer"):
            puller.read(refs, asked_at=time.monotonic())
    assert puller.read([], asked_at=time.monotonic()).segments == ()
    arena.release(e)


# ---- the resolver's pull path --------------------------------------------------------------------


def service_with_arena(path: Path, register: bool = True) -> MemoryService:
    cfg = MemoryConfig(embedder="hashing", segment_capacity_mb=4)
    return MemoryService(cfg, FactStore(path), HashingEmbedder(), SegmentArena(cfg.segment_capacity_bytes, register=register))


def fill(svc: MemoryService) -> tuple[tuple[int, ...], Any, Engine]:
    """Alice's facts, encoded once by a first replica (which offers them to the store)."""
    svc.add("alice", ["Alice adopted a dog named Rex", "Alice moved to Lyon", "Alice plays the violin"])
    prompt, m = chat_injection(svc, "alice")
    first = Engine()
    segs = asyncio.run(SegmentResolver(first, StoreHandle(svc), 1 << 20).resolve(prompt, m))
    keys = [anchor_key(prompt[: m.anchor_len], m.model)] + [fact_key(f, m.window, m.model) for f in m.facts]
    svc.put_segments("alice", [(k, s, f.context_fact_ids if k.kind == "fact" else ())
                               for k, s, f in zip(keys, segs, (None, *m.facts), strict=True)])  # the fire-and-forget put, made sure
    return prompt, m, first


def test_a_second_replica_reads_what_the_first_encoded(tmp_path: Path) -> None:
    svc = service_with_arena(tmp_path / "m.sqlite3")
    prompt, m, first = fill(svc)
    second = Engine()
    r = SegmentResolver(second, StoreHandle(svc), 1 << 20, puller=SegmentPuller.create())
    segs = asyncio.run(r.resolve(prompt, m))
    assert second.encoded == []  # nothing recomputed: every segment came out of the arena
    assert r.pulled_segments == len(segs) == len(m.facts) + 1 and r.pull_failures == 0
    assert r.pulled_bytes == sum(s.nbytes for s in segs)
    assert tuple(t for s in segs for t in s.token_ids) == tuple(prompt[: m.end])
    svc.check_integrity()


def test_a_failed_read_is_a_miss_and_the_replica_encodes(tmp_path: Path) -> None:
    svc = service_with_arena(tmp_path / "m.sqlite3")
    prompt, m, _ = fill(svc)

    class Broken(SegmentPuller):
        def read(self, refs, asked_at):  # type: ignore[no-untyped-def]
            raise PullFailed("injected")

    engine = Engine()
    r = SegmentResolver(engine, StoreHandle(svc), 1 << 20, puller=Broken(make_agent("baton-broken", progress_thread=False)))
    segs = asyncio.run(r.resolve(prompt, m))
    assert r.pull_failures == 1 and r.pulled_segments == 0
    assert len(engine.encoded) == len(m.facts) + 1  # all of them computed here instead
    assert tuple(t for s in segs for t in s.token_ids) == tuple(prompt[: m.end])


def test_a_store_without_nixl_answers_copies(tmp_path: Path) -> None:
    svc = service_with_arena(tmp_path / "m.sqlite3", register=False)
    prompt, m, _ = fill(svc)
    engine = Engine()
    r = SegmentResolver(engine, StoreHandle(svc), 1 << 20, puller=SegmentPuller.create())
    segs = asyncio.run(r.resolve(prompt, m))
    assert engine.encoded == [] and r.pulled_segments == 0 and r.pull_failures == 0  # came through the handle
    assert len(segs) == len(m.facts) + 1
