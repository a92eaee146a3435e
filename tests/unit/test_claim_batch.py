"""Group commit of ownership claims and ends (router/claim_batch.py, OwnershipStore.write_many):
one transaction per batch, answers as the one-by-one writes would give, in arrival order, the
directory's event loop free while a batch is written, a failed write failing only its own batch."""
from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest

from router.claim_batch import ClaimBatcher
from router.directory_state import DirectorySettings, ForeignConversation
from router.ownership import Claim, KnownOwners, Lookup, OwnershipStore, Write
from router.report import ReplicaReport

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from router.directory import ConversationDirectory


class CountingStore(OwnershipStore):
    """Counts transactions; `gate` (when set) holds each batch until the test opens it."""

    def __init__(self, path: str | Path, gate: threading.Event | None = None):
        super().__init__(path)
        self.batches: list[int] = []
        self.gate = gate
        self.entered = threading.Event()

    def write_many(self, writes: Sequence[Write]) -> list[Claim | bool]:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(5.0), "the test never opened the gate"
        self.batches.append(len(writes))
        return super().write_many(writes)


def claims(*items: tuple[str, str | None]) -> list[Write]:
    return [Write(sid, user) for sid, user in items]


def test_write_many_answers_as_claims_one_by_one_in_one_transaction(tmp_path: Path) -> None:
    s = OwnershipStore(tmp_path / "own.db")
    assert s.claim("old", "ana") is Claim.OPENED
    got = s.write_many(claims(("a", "ana"), ("a", "ana"), ("a", "bob"), ("old", "ana"), ("old", None), ("b", None)))
    assert got == [Claim.OPENED, Claim.OWNED, Claim.FOREIGN, Claim.OWNED, Claim.FOREIGN, Claim.OPENED]
    s.close()
    again = OwnershipStore(tmp_path / "own.db")  # committed: a restarted directory sees them
    assert again.count() == 3 and again.claim("a", "bob") is Claim.FOREIGN and again.claim("b", "") is Claim.OWNED


def test_a_failed_batch_commits_none_of_its_claims(tmp_path: Path) -> None:
    calls = {"n": 0}

    def clock() -> float:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("clock gone")
        return 1.0

    s = OwnershipStore(tmp_path / "own.db", clock=clock)
    assert s.claim("first", "ana") is Claim.OPENED  # clock call 1
    with pytest.raises(OSError):
        s.write_many([Write("first", "ana", end=True), Write("x", "ana")])  # clock call 2 fails inside the transaction
    assert s.count() == 1 and s.owner("x") is None and s.owner("first") is not None  # rolled back, the end too
    assert s.write_many(claims(("x", "bob"))) == [Claim.OPENED]  # and the connection still writes
    with pytest.raises(ValueError, match="non-empty"):
        s.write_many(claims(("z", "ana"), ("", "ana")))
    assert s.owner("z") is None


def test_write_many_applies_claims_and_ends_in_order(tmp_path: Path) -> None:
    s = OwnershipStore(tmp_path / "own.db")
    assert s.claim("a", "ana") is Claim.OPENED
    got = s.write_many([Write("a", "bob", end=True), Write("a", "ana", end=True), Write("a", "bob"), Write("a", "ana"),
                        Write("gone", None, end=True), Write("b", None), Write("b", None, end=True)])
    assert got == [False, True, Claim.OPENED, Claim.FOREIGN, False, Claim.OPENED, True]  # a stranger cannot end it; its owner can
    s.close()
    again = OwnershipStore(tmp_path / "own.db")
    assert again.count() == 1 and again.owner("a").user == "bob" and again.owner("b") is None  # type: ignore[union-attr]


def test_concurrent_claims_share_transactions_and_get_the_right_answers(tmp_path: Path) -> None:
    gate = threading.Event()
    store = CountingStore(tmp_path / "own.db", gate)
    owners = KnownOwners(store)
    batcher = ClaimBatcher(owners)

    async def go() -> list[Claim]:
        first = asyncio.ensure_future(batcher.claim("c0", "ana"))  # starts the first flush, held at the gate
        await asyncio.to_thread(store.entered.wait, 5.0)
        rest = [asyncio.ensure_future(batcher.claim(f"c{i}", "ana")) for i in range(1, 40)]
        rest.append(asyncio.ensure_future(batcher.claim("c0", "bob")))  # a stranger, in the same next batch
        await asyncio.sleep(0)
        batcher.check_integrity()
        gate.set()
        return [await first] + list(await asyncio.gather(*rest))

    got = asyncio.run(go())
    assert got[:40] == [Claim.OPENED] * 40 and got[40] is Claim.FOREIGN
    assert store.batches == [1, 40]  # the claims that came during the first write went in one more
    st = batcher.stats()
    assert (st.flushes, st.claims_committed, st.ends_committed, st.largest_batch, st.flush_errors) == (2, 41, 0, 40, 0)
    assert asyncio.run(batcher.claim("c7", "ana")) is Claim.OWNED  # now from the cache: no third write
    assert store.batches == [1, 40] and batcher.stats().claims_cached == 1
    assert owners.cached("c7") == "ana" and owners.cached("c0") == "ana"
    batcher.check_integrity()


def test_the_loop_serves_other_calls_while_a_batch_is_written(tmp_path: Path) -> None:
    gate = threading.Event()
    store = CountingStore(tmp_path / "own.db")
    owners = KnownOwners(store)
    batcher = ClaimBatcher(owners)
    assert asyncio.run(batcher.claim("known", "ana")) is Claim.OPENED
    store.gate = gate

    async def go() -> tuple[Claim, bool, Claim]:
        new = asyncio.ensure_future(batcher.claim("new", "ana"))
        await asyncio.to_thread(store.entered.wait, 5.0)
        store.entered.clear()
        cached = await batcher.claim("known", "ana")  # answered while the write still waits at the gate
        waiting = not new.done()
        gate.set()
        return cached, waiting, await new

    cached, waiting, new = asyncio.run(go())
    assert cached is Claim.OWNED and waiting and new is Claim.OPENED


def test_a_failed_write_fails_its_batch_only(tmp_path: Path) -> None:
    class FailOnce(CountingStore):
        failed = False

        def write_many(self, writes: Sequence[Write]) -> list[Claim | bool]:
            if not self.failed:
                self.failed = True
                raise OSError("disk full")
            return super().write_many(writes)

    store = FailOnce(tmp_path / "own.db")
    batcher = ClaimBatcher(KnownOwners(store))

    async def go() -> tuple[BaseException | Claim, Claim]:
        bad = await asyncio.gather(batcher.claim("a", "ana"), return_exceptions=True)
        return bad[0], await batcher.claim("b", "ana")

    bad, good = asyncio.run(go())
    assert isinstance(bad, OSError) and good is Claim.OPENED
    assert store.owner("a") is None and batcher.stats().flush_errors == 1
    with pytest.raises(ValueError, match="non-empty"):
        asyncio.run(batcher.claim("", "ana"))
    batcher.check_integrity()


def test_the_directory_places_a_burst_of_new_conversations_with_few_writes(tmp_path: Path) -> None:
    d = ConversationDirectory(DirectorySettings(policy="colocated"), ownership_db_path=str(tmp_path / "own.db"))

    async def go() -> list[str]:
        for i in range(2):
            await d.report(ReplicaReport(f"decode#{i}", "decode", kv_usage=0.1, kv_capacity_tokens=10_000))
        plans = await asyncio.gather(*(d.route(f"conv-{i}", "ana", 100) for i in range(64)))
        with pytest.raises(ForeignConversation):
            await d.route("conv-3", "bob", 100)
        again = await d.route("conv-3", "ana", 120)  # the pinned next turn: same decoder, no write
        assert again.decode_replica == plans[3].decode_replica
        return [p.decode_replica for p in plans]

    decoders = asyncio.run(go())
    assert set(decoders) == {"decode#0", "decode#1"}
    claims = asyncio.run(d.snapshot())["ownership_claims"]
    assert claims["claims_committed"] == 64 and claims["flushes"] < 64 and claims["flush_errors"] == 0
    assert OwnershipStore(tmp_path / "own.db").count() == 64  # each conversation on disk
    d._state.check_integrity()
    d._claims.check_integrity()


def test_ends_and_claims_share_a_batch_in_arrival_order_and_keep_the_cache_true(tmp_path: Path) -> None:
    gate = threading.Event()
    store = CountingStore(tmp_path / "own.db")
    owners = KnownOwners(store)
    batcher = ClaimBatcher(owners)
    assert asyncio.run(batcher.claim("a", "ana")) is Claim.OPENED and owners.cached("a") == "ana"
    store.gate = gate
    store.entered.clear()

    async def go() -> list[Claim | bool]:
        first = asyncio.ensure_future(batcher.claim("held", "ana"))  # the first flush, held at the gate
        await asyncio.to_thread(store.entered.wait, 5.0)
        rest: list[asyncio.Future[Claim | bool]] = [
            asyncio.ensure_future(batcher.end("a", "bob")),  # a stranger cannot end it
            asyncio.ensure_future(batcher.end("a", "ana")),
            asyncio.ensure_future(batcher.claim("a", "ana")),  # from the cache: ana still owns it until the end commits
            asyncio.ensure_future(batcher.claim("b", "bob")),
            asyncio.ensure_future(batcher.end("b", "bob")),  # opened and ended in the same batch
        ]
        await asyncio.sleep(0)
        batcher.check_integrity()
        gate.set()
        return [await first] + list(await asyncio.gather(*rest))

    got = asyncio.run(go())
    assert got == [Claim.OPENED, False, True, Claim.OWNED, Claim.OPENED, True]
    assert store.batches == [1, 1, 4]  # the cached claim wrote nothing; the ends and the new claim went in one write
    assert owners.cached("a") is None and owners.cached("b") is None  # ended ones leave the cache
    assert asyncio.run(batcher.claim("a", "bob")) is Claim.OPENED  # the id is free again, read from the file
    assert asyncio.run(batcher.end("", "ana")) is False
    st = batcher.stats()
    assert (st.claims_committed, st.ends_committed, st.claims_cached, st.flushes) == (4, 3, 1, 4)
    batcher.check_integrity()


def test_the_directory_ends_conversations_in_group_commits_and_drops_their_pins(tmp_path: Path) -> None:
    gate = threading.Event()
    d = ConversationDirectory(DirectorySettings(policy="colocated"), ownership_db_path=str(tmp_path / "own.db"))
    store = CountingStore(tmp_path / "own.db")
    d._claims.owners.store = store  # the same file, counted (the state and the batcher share one KnownOwners)

    async def go() -> tuple[list[bool], bool, list[int]]:
        await d.report(ReplicaReport("decode#0", "decode", kv_usage=0.1, kv_capacity_tokens=10_000))
        for i in range(20):
            await d.route(f"conv-{i}", "ana", 100)
        store.gate = gate
        store.entered.clear()
        before = len(store.batches)
        ends = [asyncio.ensure_future(d.end_conversation(f"conv-{i}", "ana" if i else "bob")) for i in range(20)]
        await asyncio.to_thread(store.entered.wait, 5.0)
        gone = asyncio.ensure_future(d.end_conversation("conv-0", "ana"))
        await asyncio.sleep(0)
        gone.cancel()  # its caller went away mid-write: the end still lands, the pin still drops
        gate.set()
        answers = list(await asyncio.gather(*ends))
        with pytest.raises(asyncio.CancelledError):
            await gone
        for _ in range(50):
            await asyncio.sleep(0.01)
            if d._state._pins.get("conv-0") is None:
                break
        return answers, d._state._pins.get("conv-0") is None, store.batches[before:]

    answers, dropped, batches = asyncio.run(go())
    assert answers == [False] + [True] * 19 and dropped
    assert batches == [20, 1] and store.count() == 0  # 21 ends in two writes; every conversation gone from disk
    assert asyncio.run(d.snapshot())["ownership_claims"]["ends_committed"] == 21
    d._state.check_integrity()
    d._claims.check_integrity()


def test_a_lookup_reads_the_owners_as_of_the_writes_before_it(tmp_path: Path) -> None:
    s = OwnershipStore(tmp_path / "own.db")
    s.write_many(claims(*((f"s{i}", "ana" if i % 2 else None) for i in range(1200))))
    got = s.write_many([Write("new", "bob"), Lookup(("new", "s1", "s2", "nobody")), Write("s1", "ana", end=True), Lookup(("s1",))])
    assert got == [Claim.OPENED, {"new": "bob", "s1": "ana", "s2": ""}, True, {}]
    many = s.write_many([Lookup(tuple(f"s{i}" for i in range(1200)) + ("nobody",))])[0]
    assert isinstance(many, dict) and len(many) == 1199 and many["s3"] == "ana" and many["s4"] == ""  # over several IN chunks


def test_owners_of_answers_cached_owners_and_reads_the_rest_once_behind_queued_writes(tmp_path: Path) -> None:
    gate = threading.Event()
    store = CountingStore(tmp_path / "own.db")
    for sid in ("cold", "ended"):
        store.claim(sid, "ana")  # on disk, not in this directory's cache (as after a restart)
    owners = KnownOwners(store)
    batcher = ClaimBatcher(owners)
    assert asyncio.run(batcher.claim("warm", "bob")) is Claim.OPENED
    store.gate = gate
    store.entered.clear()

    async def go() -> dict[str, str]:
        first = asyncio.ensure_future(batcher.claim("held", "ana"))  # a flush held at the gate
        await asyncio.to_thread(store.entered.wait, 5.0)
        end = asyncio.ensure_future(batcher.end("ended", "ana"))  # queued before the read: the read must not see its owner
        read = asyncio.ensure_future(batcher.owners_of(["warm", "cold", "ended", "nobody"]))
        await asyncio.sleep(0)
        gate.set()
        assert await first is Claim.OPENED and await end is True
        return await read

    assert asyncio.run(go()) == {"warm": "bob", "cold": "ana"}
    assert store.batches[-1] == 2  # the end and the lookup in one transaction
    assert owners.cached("cold") == "ana" and owners.cached("ended") is None  # what the file said is cached
    assert asyncio.run(batcher.owners_of(["warm", "cold"])) == {"warm": "bob", "cold": "ana"}  # both cached now: no read
    assert batcher.stats().lookups == 1 and len(store.batches) == 3
    batcher.check_integrity()


def test_a_restarted_directory_adopts_a_decoders_pins_with_one_read_off_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "own.db"
    seed = OwnershipStore(path)
    seed.write_many(claims(*((f"conv-{i}", "ana") for i in range(300))))
    seed.close()
    d = ConversationDirectory(DirectorySettings(policy="conversation"), ownership_db_path=str(path))  # restarted: nothing cached

    class NoLoopReads(CountingStore):
        def owner(self, session_id: str) -> None:  # type: ignore[override]
            raise AssertionError("an owner read one by one on the event loop")

    d._claims.owners.store = NoLoopReads(path)
    held = tuple((f"conv-{i}", 1.0) for i in range(300)) + (("never-owned", 1.0),)

    async def go() -> None:
        await d.report(ReplicaReport("prefill#0", "prefill", kv_usage=0.1, kv_capacity_tokens=10_000))
        await d.report(ReplicaReport("decode#0", "decode", kv_usage=0.1, kv_capacity_tokens=10_000, conversations=held))
        plan = await d.route("conv-7", "ana", 100)  # a returning conversation: back to its decoder, no handoff
        assert plan.decode_replica == "decode#0" and not plan.remote_prefill
        with pytest.raises(ForeignConversation):
            await d.route("conv-8", "bob", 100)

    asyncio.run(go())
    assert d._state.totals["pins_adopted"] == 300 and d._state.pin_of("never-owned") is None
    assert d._claims.stats().lookups == 1  # all 301 in one read
    d._state.check_integrity()
    d._claims.check_integrity()


def test_describing_a_conversation_reads_an_uncached_owner_off_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "own.db"
    seed = OwnershipStore(path)
    seed.write_many(claims(("conv", "ana"), ("idle", "ana")))
    seed.close()
    d = ConversationDirectory(DirectorySettings(policy="conversation"), ownership_db_path=str(path))

    class NoLoopReads(CountingStore):
        def owner(self, session_id: str) -> None:  # type: ignore[override]
            raise AssertionError("an owner read on the event loop")

    d._claims.owners.store = NoLoopReads(path)
    conversations = (("conv", 1.0),)

    async def go() -> list[dict[str, object] | None]:
        await d.report(ReplicaReport("prefill#0", "prefill", kv_usage=0.1, kv_capacity_tokens=10_000))
        await d.report(ReplicaReport("decode#0", "decode", kv_usage=0.1, kv_capacity_tokens=10_000, conversations=conversations))
        d._claims.owners._owners.clear()  # the cache lost them (a bounded LRU): the file must be asked again
        return [await d.describe_conversation(sid, user) for sid, user in
                (("conv", "ana"), ("conv", "bob"), ("idle", "ana"), ("nobody", "ana"), ("", "ana"))]

    mine, strangers, unpinned, unknown, empty = asyncio.run(go())
    assert mine is not None and mine["decoder"] == "decode#0"  # type: ignore[index]
    assert strangers is None and unpinned is None and unknown is None and empty is None
    assert d._claims.stats().lookups == 4  # the adoption's, then conv's, idle's and nobody's (bob's answer came from the cache)
