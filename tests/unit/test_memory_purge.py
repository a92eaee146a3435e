"""Deleting memory facts purges their KV from every engine replica's segment cache
(memory_store/deletions.py, SegmentResolver.sync / resolve in memory_store/resolver.py): the
deletion log's feed, two replicas' resolvers over one real MemoryService (SQLite in tmp_path), a
fake engine that "encodes" tiny tensors, and a store handle that can be made unreachable."""
from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import FakeTokenizer

from deployments.chat import PromptRenderer
from kv_transfer.injection import MemoryFact, MemoryInjection
from kv_transfer.segments import KVSegment
from memory_store import deletions
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.layout import memory_prompt
from memory_store.resolver import MemoryUnavailable, SegmentResolver, fact_key
from memory_store.schema import migrate
from memory_store.store import MemoryService

ALICE = ["Alice adopted a dog named Rex", "Alice moved to Lyon", "Alice plays the violin"]
W = 1  # each fact encoded after its predecessor


class Engine:
    """Captures the KV of the asked span: token ids and zeros, 16 bytes a token."""

    def __init__(self) -> None:
        self.encoded: list[tuple[int, ...]] = []

    async def capture(self, request_id: str, prompt: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
                      cache_salt: str | None = None) -> tuple[KVSegment, ...]:
        out = []
        for a, b in ranges:
            self.encoded.append(tuple(prompt[a:b]))
            out.append(KVSegment(tuple(prompt[a:b]), torch.zeros(1, b - a, 1, 2), torch.zeros(1, b - a, 1, 2)))
        return tuple(out)


class StoreHandle:
    """The memory-store actor's handle as an engine replica sees it. `down`: every call fails
    (the store or the network is out) except fire-and-forget puts, which vanish."""

    def __init__(self, svc: MemoryService) -> None:
        self.svc, self.down = svc, False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        handle = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> asyncio.Future[Any]:
                fut = asyncio.get_running_loop().create_future()
                if handle.down and name != "put_segments":
                    fut.set_exception(ConnectionError("memory store unreachable"))
                else:
                    try:
                        fut.set_result(0 if handle.down else getattr(handle.svc, name)(*args))
                    except Exception as e:  # noqa: BLE001 - the actor's error, as Ray raises it
                        fut.set_exception(e)
                return fut

        return Method


def service(path: Path) -> MemoryService:
    return MemoryService(MemoryConfig(embedder="hashing"), FactStore(path), HashingEmbedder())


def chat_injection(svc: MemoryService, user: str, k: int = 5) -> tuple[tuple[int, ...], MemoryInjection]:
    """What the ingress sends a replica for a chat with memories: recall, then the layout."""
    recall = svc.recall(user, "dog Lyon violin", k, W)
    p = memory_prompt(PromptRenderer(FakeTokenizer()), [{"role": "user", "content": "hi"}], recall.facts,
                      user=user, model="m", window=W, inject=True, deletions=recall.deletions)
    assert p.injection is not None
    return p.token_ids, p.injection


def replica(store: StoreHandle, engine: Engine | None = None) -> SegmentResolver:
    return SegmentResolver(engine or Engine(), store, 1 << 20)


def held(r: SegmentResolver, fact_id: str) -> bool:
    """Whether the replica caches the fact's segment (window W, model m)."""
    return r.holds(fact_key(MemoryFact(fact_id, 0, (1,)), W, "m"))


@pytest.fixture
def svc(tmp_path: Path) -> MemoryService:
    return service(tmp_path / "m.sqlite3")


# ---- the deletion log -----------------------------------------------------------------------------

def log_db() -> tuple[sqlite3.Connection, str]:
    con = sqlite3.connect(":memory:", isolation_level=None)
    migrate(con, 384)
    return con, con.execute("SELECT value FROM meta WHERE key='store_id'").fetchone()[0]


def test_feed_pages_through_the_log_in_order() -> None:
    con, sid = log_db()
    assert deletions.since(con, sid, sid, 0) == deletions.DeletionFeed(sid, 0)
    deletions.record(con, ["a", "b", "c"], 1.0)
    deletions.record(con, ["d", "e"], 2.0)
    page = deletions.since(con, sid, sid, 0, page=2)
    assert (page.fact_ids, page.cursor, page.more, page.reset) == (("a", "b"), 2, True, False)
    page = deletions.since(con, sid, sid, page.cursor, page=2)
    assert (page.fact_ids, page.cursor, page.more) == (("c", "d"), 4, True)
    page = deletions.since(con, sid, sid, page.cursor, page=2)
    assert (page.fact_ids, page.cursor, page.more) == (("e",), 5, False)
    assert deletions.since(con, sid, sid, 5).fact_ids == ()


def test_feed_resets_a_cursor_it_cannot_continue() -> None:
    con, sid = log_db()
    deletions.record(con, [f"f{i}" for i in range(10)], 1.0, keep=4)  # epochs 1..10, 7..10 kept
    assert deletions.head(con) == 10 and deletions.pruned_through(con) == 6
    assert deletions.since(con, sid, sid, 6).fact_ids == ("f6", "f7", "f8", "f9")
    for store, cursor in ((sid, 5), (sid, 11), ("another-store", 8), ("", 0)):  # pruned, ahead, foreign, fresh
        feed = deletions.since(con, sid, store, cursor, page=3)  # drop everything; the newest are tombstones
        assert (feed.reset, feed.fact_ids, feed.cursor, feed.store_id) == (True, ("f7", "f8", "f9"), 10, sid)
    with pytest.raises(ValueError):
        deletions.DeletionFeed(sid, 3, reset=True, more=True)


def test_the_log_survives_a_restart_and_epochs_never_repeat(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite3"
    s = service(path)
    ids = [f.id for f in s.add("alice", ALICE)]
    s.delete("alice", ids[:1])
    sid, epoch = s.recall("alice", "x", 1, 0).deletions
    assert epoch == 1
    s2 = service(path)  # the memory-store actor restarted
    assert s2.deletions_since(sid, 0).fact_ids == (ids[0],)
    assert s2.delete_all("alice") == 2
    feed = s2.deletions_since(sid, epoch)
    assert feed.fact_ids == tuple(ids[1:]) and feed.cursor == 3 and not feed.reset
    s2.check_integrity()


# ---- replicas ---------------------------------------------------------------------------------------

def test_delete_purges_the_fact_from_every_replica(svc: MemoryService) -> None:
    ids = [f.id for f in svc.add("alice", ALICE)]
    store = StoreHandle(svc)
    a, b = replica(store), replica(store)

    async def go() -> None:
        prompt, inj = chat_injection(svc, "alice")
        for r in (a, b):
            await r.resolve(prompt, inj)
            assert all(held(r, i) for i in ids)
        svc.delete("alice", [ids[0]])
        await asyncio.gather(a.sync_soon(), b.sync_soon())  # each replica's next stats tick
        for r in (a, b):
            assert not held(r, ids[0])
            assert not held(r, ids[1])  # encoded after the deleted fact (its context): gone too
            assert held(r, ids[2])
            assert r.purged_segments == 2

    asyncio.run(go())


def test_delete_all_purges_every_fact_of_the_user_only(svc: MemoryService) -> None:
    alice = [f.id for f in svc.add("alice", ALICE)]
    (bob,) = [f.id for f in svc.add("bob", ["Bob has a cat named Tom"])]
    r = replica(StoreHandle(svc))

    async def go() -> None:
        for user in ("alice", "bob"):
            await r.resolve(*chat_injection(svc, user))
        svc.delete_all("alice")
        assert await r.sync()
        assert not any(held(r, i) for i in alice) and held(r, bob)

    asyncio.run(go())


def test_a_replica_that_missed_the_purge_purges_on_its_next_contact(svc: MemoryService) -> None:
    ids = [f.id for f in svc.add("alice", ALICE)]
    up, cut_off, engine = StoreHandle(svc), StoreHandle(svc), Engine()
    a, b = replica(up), replica(cut_off, engine)

    async def go() -> None:
        prompt, inj = chat_injection(svc, "alice")
        await a.resolve(prompt, inj)
        await b.resolve(prompt, inj)
        cut_off.down = True
        svc.delete("alice", [ids[2]])
        assert await a.sync() and not await b.sync()  # b is unreachable when the fact goes
        assert not held(a, ids[2]) and held(b, ids[2])
        # a chat recalled after the delete reaches b while the store is still out of b's reach:
        # b cannot catch up, so it does not serve from its cache (the request computes from text)
        prompt2, inj2 = chat_injection(svc, "alice")
        with pytest.raises(MemoryUnavailable):
            await b.resolve(prompt2, inj2)
        cut_off.down = False
        encoded = len(engine.encoded)
        await b.resolve(prompt2, inj2)  # next contact: purges first, then serves
        assert not held(b, ids[2]) and held(b, ids[0]) and held(b, ids[1])
        assert len(engine.encoded) == encoded  # the remaining facts came from its cache

    asyncio.run(go())


def test_a_request_in_flight_across_a_delete_does_not_recache_the_fact(svc: MemoryService) -> None:
    ids = [f.id for f in svc.add("alice", ALICE)]
    r = replica(StoreHandle(svc))

    async def go() -> None:
        prompt, inj = chat_injection(svc, "alice")  # recalled before the delete
        svc.delete("alice", [ids[0]])
        assert await r.sync()
        await r.resolve(prompt, inj)  # the store no longer has it: encoded here for this request only
        assert not held(r, ids[0]) and not held(r, ids[1]) and held(r, ids[2])

    asyncio.run(go())


def test_a_new_store_resets_the_replica_cache(tmp_path: Path) -> None:
    old = service(tmp_path / "old.sqlite3")
    old.add("alice", ALICE)
    store = StoreHandle(old)
    r = replica(store)

    async def go() -> None:
        await r.resolve(*chat_injection(old, "alice"))
        assert r.local_stats().items == 4  # anchor + 3 facts
        store.svc = service(tmp_path / "new.sqlite3")  # the database file was replaced
        assert await r.sync()
        assert r.local_stats().items == 0 and r.purged_segments == 4

    asyncio.run(go())


def test_the_ingress_sends_the_recall_mark_with_the_injection(svc: MemoryService) -> None:
    from fakes import FakeMemoryStoreHandle

    from deployments.memory_api import MemoryFrontend
    from deployments.protocol import ChatCompletionRequest

    ids = [f.id for f in svc.add("alice", ALICE)]
    svc.delete("alice", [ids[0]])
    mem = MemoryFrontend(MemoryConfig(embedder="hashing", mode="kv", context_window=W), FakeMemoryStoreHandle(svc),
                         PromptRenderer(FakeTokenizer()), "m")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "dog"}], memories={"k": 2}, user="alice")
    p = asyncio.run(mem.chat_prompt(body, "alice"))
    assert p.injection is not None and p.injection.deletions == (svc.deletions_since("", 0).store_id, 1)
