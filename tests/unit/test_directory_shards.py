"""The directory split by conversation (router/directory_shards.py, deployments/directory_client.py,
deployments/pin_sync.ShardedPins): which shard owns a session id, that the hash is stable, even and
consistent, that each shard adopts and is asked about only its own conversations, that reports and
failures reach every shard, that owners hold across shards through the one ownership file, and
that the merged snapshot adds up. Real DirectoryStates behind fake handles; no Ray."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
from directory_fixtures import TTL, rep, up
from fakes import FakeDirectoryHandle, FakePoolHandle, FakeResponseStream, scripted_deltas

from baton.engine.types import GenerationRequest, SamplingSpec
from baton.paths import REPO_ROOT
from router.directory_shards import MAX_SHARDS, deployment_name, jump_hash, merge_snapshots, shard_of
from router.directory_state import DirectorySettings, DirectoryState, ForeignConversation
from router.ownership import KnownOwners, OwnershipStore
from router.pin_cache import PinCache

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.backend import PoolBackend
    from deployments.directory_client import DirectoryShards
    from deployments.pin_sync import ShardedPins

IDS = [f"conv-{i}" for i in range(20_000)]


# ---- the hash ------------------------------------------------------------------------------------------


def test_one_shard_and_turns_without_a_session_go_to_shard_zero() -> None:
    assert {shard_of(sid, 1) for sid in IDS[:100]} == {0}
    assert shard_of(None, 8) == 0 and shard_of("", 8) == 0


@pytest.mark.parametrize("shards", [0, -1, MAX_SHARDS + 1])
def test_a_shard_count_out_of_range_is_refused(shards: int) -> None:
    with pytest.raises(ValueError, match="shards must be"):
        shard_of("conv", shards)
    with pytest.raises(ValueError):
        jump_hash(1, min(shards, 0))


@pytest.mark.parametrize("shards", [2, 3, 4, 7])
def test_session_ids_spread_evenly_over_the_shards(shards: int) -> None:
    counts = Counter(shard_of(sid, shards) for sid in IDS)
    assert set(counts) == set(range(shards))
    expected = len(IDS) / shards
    assert all(abs(n - expected) / expected < 0.05 for n in counts.values()), counts


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_one_more_shard_moves_only_its_share_and_only_to_the_new_shard(shards: int) -> None:
    moved = [(shard_of(sid, shards), shard_of(sid, shards + 1)) for sid in IDS]
    changed = [(a, b) for a, b in moved if a != b]
    assert all(b == shards for _, b in changed)  # a conversation only ever moves to the new shard
    share = len(changed) / len(IDS)
    assert abs(share - 1 / (shards + 1)) < 0.02, share


def test_the_shard_of_a_session_is_the_same_in_another_process() -> None:
    """Ingresses and directories are separate processes: the hash must not depend on PYTHONHASHSEED."""
    code = "from router.directory_shards import shard_of; print([shard_of(f'conv-{i}', 5) for i in range(50)])"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
    assert out.strip() == str([shard_of(f"conv-{i}", 5) for i in range(50)])


def test_shard_deployments_keep_the_single_directory_s_name() -> None:
    assert deployment_name(0, 1) == "directory"
    assert [deployment_name(i, 3) for i in range(3)] == ["directory-0", "directory-1", "directory-2"]
    with pytest.raises(ValueError):
        deployment_name(3, 3)
    with pytest.raises(ValueError, match="out of range"):
        DirectorySettings(shard=2, shards=2)


# ---- each shard's own conversations ---------------------------------------------------------------------


def shard_states(shards: int, path: Path | str = ":memory:") -> list[DirectoryState]:
    return [DirectoryState(DirectorySettings(policy="colocated", conversation_ttl_s=TTL, shard=i, shards=shards),
                           KnownOwners(OwnershipStore(path))) for i in range(shards)]


def test_a_restarted_shard_adopts_only_its_own_conversations_from_a_report(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    before = shard_states(2, path)
    sids = IDS[:40]
    for st in before:
        up(st, 0.0, "d0", prefill=())
    for sid in sids:
        before[shard_of(sid, 2)].route(sid, "ana", 10, now=0.0)
    after = shard_states(2, path)  # both restarted; d0 reports every conversation it holds
    for st in after:
        st.report(rep("d0", "decode", conversations=tuple((sid, 1.0) for sid in sids)), 5.0)
    for i, st in enumerate(after):
        mine = {sid for sid in sids if shard_of(sid, 2) == i}
        assert {sid for sid in sids if st.pin_of(sid) is not None} == mine and mine
        assert st.totals["pins_adopted"] == len(mine)
        st.check_integrity()


def test_an_owner_holds_in_every_shard_through_the_one_ownership_file(tmp_path: Path) -> None:
    """Shards share the SQLite file, so changing the shard count never frees a session id."""
    path = tmp_path / "conversations.sqlite3"
    two = shard_states(2, path)
    sid = next(s for s in IDS if shard_of(s, 2) == 0 and shard_of(s, 3) == 2)  # a conversation that moves when K grows
    up(two[0], 0.0, "d0", prefill=())
    two[0].route(sid, "ana", 10, now=0.0)
    three = shard_states(3, path)
    up(three[2], 1.0, "d0", prefill=())
    with pytest.raises(ForeignConversation):
        three[2].route(sid, "bob", 10, now=1.0)
    assert three[2].route(sid, "ana", 10, now=1.0).reason == "new"  # its pin did not move with it, its owner did


# ---- the client side: calls, reports, failures, snapshot ---------------------------------------------------


def two_shard_directory() -> tuple[DirectoryShards, list[FakeDirectoryHandle], list[DirectoryState]]:
    states = shard_states(2)
    handles = [FakeDirectoryHandle(state=st, clock=lambda: 1.0) for st in states]
    for st in states:
        up(st, 0.0, "d0", "d1", prefill=())
    return DirectoryShards(handles), handles, states


def request(sid: str, n: int = 4) -> GenerationRequest:
    return GenerationRequest(request_id=f"r-{sid}-{n}", prompt_token_ids=list(range(n)), sampling=SamplingSpec(max_tokens=2),
                             session_id=sid, user="ana")


def serve_turns(backend: PoolBackend, pins: ShardedPins | None, requests: list[GenerationRequest]) -> None:
    async def go() -> None:
        for req in requests:
            async for _ in backend.generate(req):
                pass
            if pins is not None:
                await pins.flush()

    asyncio.run(go())


@pytest.mark.parametrize("cached", [False, True])
def test_each_conversation_is_routed_and_counted_by_its_own_shard_only(cached: bool) -> None:
    directory, handles, states = two_shard_directory()
    pins = ShardedPins.over(lambda: PinCache("colocated", 60.0), directory) if cached else None
    decode = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(2, replica=req.target_replica)))
    backend = PoolBackend(decode, None, directory, pins=pins)
    sids = IDS[:30]
    serve_turns(backend, pins, [request(sid, n) for n in (3, 5) for sid in sids])
    for i, (h, st) in enumerate(zip(handles, states, strict=True)):
        mine = {sid for sid in sids if shard_of(sid, 2) == i}
        assert {args[0] for args in h.called("route")} == mine and mine
        assert {sid for sid in sids if st.pin_of(sid) is not None} == mine
        assert all(st.pin_of(sid).turns == 2 for sid in mine)  # type: ignore[union-attr]  # cached turns reach the shard too
        st.check_integrity()
    routed = sum(len(h.called("route")) for h in handles)
    assert routed == (30 if cached else 60)  # with the caches the second turns asked nobody
    if pins is not None:
        snap = pins.snapshot()
        assert snap["shards"] == 2 and snap["hits"] == 30 and snap["entries"] == 30


def test_reports_and_failures_reach_every_shard_and_the_snapshot_adds_up() -> None:
    directory, handles, states = two_shard_directory()
    decode = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(2, replica=req.target_replica)))
    serve_turns(PoolBackend(decode, None, directory), None, [request(sid) for sid in IDS[:20]])

    async def go() -> tuple[int, dict]:
        directory.report(report)  # fire and forget: each shard's call starts, nobody awaits it
        await asyncio.sleep(0)
        held = await directory.replica_failed("d0")
        return held, await directory.snapshot()

    pinned_d0 = sum(1 for st in states for sid in IDS[:20] if st.pin_of(sid) is not None and st.pin_of(sid).decoder == "d0")  # type: ignore[union-attr]
    report = rep("d2", "decode", kv=0.1)
    held, snap = asyncio.run(go())
    assert all(h.called("report") == [(report,)] and h.called("replica_failed") == [("d0",)] for h in handles)
    assert held == pinned_d0 > 0
    assert snap["directory_shards"] == 2 and snap["conversations_total"] == 20
    assert [s["conversations_total"] for s in snap["shards"]] == [sum(shard_of(s, 2) == i for s in IDS[:20]) for i in range(2)]
    assert set(snap["replicas"]) == {"d0", "d1", "d2"} and not snap["replicas"]["d0"]["live"] and snap["replicas"]["d2"]["live"]
    assert snap["totals"]["turns"] == 20


def test_merged_snapshot_weighs_handoffs_and_keeps_each_replica_s_freshest_view() -> None:
    a = {"policy": "conversation", "live_pins": 3, "conversations_total": 3, "turns_total": 5, "handoffs_per_live_conversation": 1.0,
         "totals": {"turns": 5}, "replicas": {"d0": {"age_s": 0.4, "kv_usage": 0.2, "pinned": 3}}}
    b = {"policy": "conversation", "live_pins": 1, "conversations_total": 2, "turns_total": 2, "handoffs_per_live_conversation": 2.0,
         "totals": {"turns": 2, "expired": 1}, "replicas": {"d0": {"age_s": 0.1, "kv_usage": 0.3, "pinned": 1}}}
    m = merge_snapshots([a, b])
    assert (m["live_pins"], m["conversations_total"], m["turns_total"]) == (4, 5, 7)
    assert m["handoffs_per_live_conversation"] == pytest.approx((3 * 1.0 + 1 * 2.0) / 4)
    assert m["totals"] == {"turns": 7, "expired": 1}
    assert m["replicas"]["d0"] == {"age_s": 0.1, "kv_usage": 0.3, "pinned": 4}
    assert merge_snapshots([a]) == {**a, "directory_shards": 1}
    with pytest.raises(ValueError):
        merge_snapshots([])


def test_a_directory_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError):
        DirectoryShards([])
    directory, _, _ = two_shard_directory()
    with pytest.raises(ValueError, match="pin caches"):
        ShardedPins([], directory)
