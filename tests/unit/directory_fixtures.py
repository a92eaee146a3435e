"""Shared by the directory-state tests (test_directory_state.py, test_directory_load.py): a
DirectoryState factory that checks every state's invariants when the test ends, and reports."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from router.directory_state import DirectorySettings, DirectoryState
from router.report import ReplicaReport

CAP = 10_000
STALE = 10.0
TTL = 1800.0

MakeState = Callable[..., DirectoryState]


@pytest.fixture
def make_state() -> Iterator[MakeState]:
    """DirectoryState factory; every state it made must pass check_integrity() at the end."""
    made: list[DirectoryState] = []

    def make(policy: str = "conversation", **settings: Any) -> DirectoryState:
        settings.setdefault("stale_after_s", STALE)
        settings.setdefault("conversation_ttl_s", TTL)
        state = DirectoryState(DirectorySettings(policy=policy, **settings))  # type: ignore[arg-type]
        made.append(state)
        return state

    yield make
    for state in made:
        state.check_integrity()


def rep(replica_id: str, pool: str, kv: float = 0.0, in_flight: int = 0, cap: int = CAP, **more: Any) -> ReplicaReport:
    return ReplicaReport(replica_id, pool, kv_usage=kv, kv_capacity_tokens=cap, in_flight=in_flight, **more)


def up(state: DirectoryState, now: float, *decoders: str, prefill: tuple[str, ...] = ("p0",), **decoder_stats: Any) -> None:
    """Decoders (and prefill replicas) report equal loads at `now`."""
    for d in decoders:
        state.report(rep(d, "decode", **decoder_stats), now)
    for p in prefill:
        state.report(rep(p, "prefill"), now)


def live_ids(state: DirectoryState, pool: str, now: float) -> list[str]:
    return sorted(r.replica_id for r in state.live(pool, now))
