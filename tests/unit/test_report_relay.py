"""Reports relayed between directory shards (router/report_relay.py): a replica reports to its
home shard only, each shard passes what it got to the others in one call per period, a shard that
lacks a replica's complete list of conversations gets it through the home shard's answer, and a
replica whose home shard does not answer reaches the others directly. Real ConversationDirectory
objects (router/directory.py, no Ray: their metrics are inert) behind in-process handles."""
from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import replace
from typing import Any

import pytest

from deployments.replica_report import HeldConversations
from router.directory_shards import shard_of
from router.directory_state import DirectorySettings
from router.report import ReplicaReport
from router.report_relay import RelayAsks, ReportOutbox

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.directory_client import DirectoryShards
    from router.directory import ConversationDirectory

PERIOD_S = 0.01


class Handle:
    """A Serve handle over an object in this process: `.method.remote(...)` starts the call now."""

    def __init__(self, target: Any):
        self.target, self.down = target, False
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        handle = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
                handle.calls.append((name, args, kwargs))
                if handle.down:
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_exception(ConnectionError("shard down"))
                    return fut
                return asyncio.ensure_future(getattr(handle.target, name)(*args, **kwargs))

        return Method()

    def reports(self) -> list[tuple[ReplicaReport, dict[str, Any]]]:
        return [(args[0], kw) for name, args, kw in self.calls if name == "report"]


def two_shards() -> tuple[list[ConversationDirectory], list[Handle]]:
    shards = [ConversationDirectory(DirectorySettings(policy="colocated", shards=2, shard=i), relay_period_s=PERIOD_S) for i in range(2)]
    handles = [Handle(d) for d in shards]
    for i, d in enumerate(shards):
        d._peers = {1 - i: handles[1 - i]}  # what _peer_handles would look up by name in Serve
    return shards, handles


def decoders_homed_on_each_shard() -> list[str]:
    ids = [f"decode#{i}" for i in range(40)]
    home0 = [r for r in ids if shard_of(r, 2) == 0][:2]
    home1 = [r for r in ids if shard_of(r, 2) == 1][:2]
    return home0 + home1


def report_round(client: DirectoryShards, held: dict[str, HeldConversations], now: float) -> None:
    for rid, h in held.items():
        seq, served, dropped = h.delta(now)
        report = ReplicaReport(rid, "decode", kv_usage=0.1, kv_capacity_tokens=10_000, conversations=served,
                               conversations_complete=False, seq=seq, dropped=dropped)
        client.report(report, lambda h=h, report=report: replace(report, conversations=h.recent(now), conversations_complete=True,
                                                              dropped=(), seq=h.seq))


def run_rounds(client: DirectoryShards, held: dict[str, HeldConversations], rounds: int) -> None:
    """`rounds` report periods, each long enough for the shards to relay (3 relay periods)."""
    async def go() -> None:
        for k in range(rounds):
            report_round(client, held, float(k))
            await asyncio.sleep(3 * PERIOD_S)

    asyncio.run(go())


def test_the_outbox_and_the_asks_keep_what_they_are_given() -> None:
    box = ReportOutbox()
    reports = [ReplicaReport(f"d{i}", "decode") for i in range(3)]
    for r in reports:
        box.add(r)
    assert len(box) == 3 and box.take() == reports and box.take() == []
    asks = RelayAsks(0, 3)
    asks.add(1, ["d0", "d1"])
    asks.add(2, ["d0"])
    assert asks.take("d0") == (1, 2) and asks.take("d0") == () and asks.take("d1") == (1,)
    asks.check_integrity()
    with pytest.raises(ValueError, match="cannot ask"):
        asks.add(0, ["d0"])  # a shard does not ask itself through itself


def test_each_replica_calls_its_home_shard_only_and_every_shard_sees_every_replica() -> None:
    shards, handles = two_shards()
    client = DirectoryShards(handles, relay=True)
    rids = decoders_homed_on_each_shard()
    held = {rid: HeldConversations() for rid in rids}
    for n, rid in enumerate(rids):
        held[rid].served(f"conv-{n}", 0.0)

    run_rounds(client, held, 4)  # the first round's asks come back in the second round's answers
    for i, h in enumerate(handles):
        relayed = [r.replica_id for r, kw in h.reports() if kw.get("relay")]
        assert set(relayed) == {rid for rid in rids if shard_of(rid, 2) == i}  # home reports only
    now = time.monotonic()
    for d in shards:
        assert sorted(r.replica_id for r in d._state.live("decode", now)) == sorted(rids)
        assert all(d._state._held.exact(rid) for rid in rids)  # every copy complete: the asks went through the home shards
        d._state.check_integrity()
    # each fresh shard asked each replica (a relayed delta that overtakes the list it asked for asks once more: harmless)
    complete_sent = [(i, r.replica_id) for i, h in enumerate(handles) for r, _ in h.reports() if r.conversations_complete]
    assert set(complete_sent) == {(i, rid) for i in range(2) for rid in rids} and len(complete_sent) <= 2 * 2 * len(rids)
    assert sum(d._state.totals["complete_lists_asked"] for d in shards) >= 2 * len(rids)


def test_a_replica_whose_home_shard_is_down_reports_to_the_others_directly() -> None:
    shards, handles = two_shards()
    client = DirectoryShards(handles, relay=True)
    rid = next(r for r in decoders_homed_on_each_shard() if shard_of(r, 2) == 0)
    handles[0].down = True
    held = {rid: HeldConversations()}

    run_rounds(client, held, 3)
    direct = [r for r, kw in handles[1].reports() if not kw.get("relay")]
    assert len([r for r in direct if not r.conversations_complete]) == 3  # every report reached shard 1 anyway
    assert [r.replica_id for r in shards[1]._state.live("decode", time.monotonic())] == [rid]
    assert shards[1]._state._held.exact(rid)


def test_a_flush_that_fails_does_not_stop_the_relay() -> None:
    shards, handles = two_shards()
    peers = shards[0]._peers
    failures = []

    def flaky() -> dict[int, Any]:
        if not failures:
            failures.append(1)
            raise RuntimeError("the peer's handle could not be looked up yet")
        return peers

    shards[0]._peer_handles = flaky  # type: ignore[method-assign]
    client = DirectoryShards(handles, relay=True)
    rid = next(r for r in decoders_homed_on_each_shard() if shard_of(r, 2) == 0)
    held = {rid: HeldConversations()}

    run_rounds(client, held, 3)
    assert failures == [1] and shards[1]._state.totals["reports_relayed_in"] >= 1  # the flush after the failed one went through
    assert [r.replica_id for r in shards[1]._state.live("decode", time.monotonic())] == [rid]
