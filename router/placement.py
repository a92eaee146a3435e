"""Pure placement policy for engine replicas: load scores and conversation affinity.

Everything here works on plain values, so it is testable without Ray.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router can observe about one replica right now."""

    replica_id: str
    kv_usage: float = 0.0  # fraction of the KV pool in use (engine-reported)
    queue_len: int = 0  # requests the replica is working on or holding (router/engine view, whichever is larger)


@dataclass(frozen=True)
class LoadWeights:
    kv_weight: float = 1.0
    queue_weight: float = 0.05


@dataclass(frozen=True)
class RouteDecision:
    """Ranked replicas for one request, and why the first rank was chosen."""

    ranks: tuple[tuple[str, ...], ...]
    reason: Literal["pinned", "new", "repinned", "no_session"]


def load_score(load: ReplicaLoad, w: LoadWeights) -> float:
    return w.kv_weight * load.kv_usage + w.queue_weight * load.queue_len


def rank_by_load(loads: list[ReplicaLoad], w: LoadWeights) -> tuple[tuple[str, ...], ...]:
    """Replicas grouped into ranks of equal score, least loaded first."""
    ranks: list[list[str]] = []
    last: float | None = None
    scored = sorted((round(load_score(x, w), 9), x.replica_id) for x in loads)
    for score, replica_id in scored:
        if last is None or score != last:
            ranks.append([])
            last = score
        ranks[-1].append(replica_id)
    return tuple(tuple(r) for r in ranks)


def route_with_affinity(session_id: str | None, pinned: str | None, loads: list[ReplicaLoad], w: LoadWeights) -> RouteDecision:
    """A session stays on its pinned replica while that replica is a candidate (its KV/prefix cache
    lives there); otherwise the least-loaded replica gets it. Other replicas follow as fallbacks
    so an overloaded pin can spill rather than stall."""
    ranked = rank_by_load(loads, w)
    if session_id is None or not ranked:
        return RouteDecision(ranks=ranked, reason="no_session")
    ids = {l.replica_id for l in loads}
    if pinned is not None and pinned in ids:
        rest = tuple(tuple(r for r in rank if r != pinned) for rank in ranked)
        return RouteDecision(ranks=((pinned,),) + tuple(r for r in rest if r), reason="pinned")
    # a new pin goes to exactly one replica (the first of the least-loaded rank), so the pin the
    # router records is the replica Serve sends to; the others stay as ordered fallbacks
    first, *others = [r for rank in ranked for r in rank]
    return RouteDecision(ranks=((first,),) + tuple((r,) for r in others), reason="repinned" if pinned is not None else "new")


class PinTable:
    """session -> replica, bounded LRU. Owned by one router instance (per calling process).

    Invariant: len(self) <= capacity; a replica removed with `drop_replica` owns no pin.
    """

    def __init__(self, capacity: int = 100_000):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._pins: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, session_id: str) -> str | None:
        replica = self._pins.get(session_id)
        if replica is not None:
            self._pins.move_to_end(session_id)
        return replica

    def pin(self, session_id: str, replica_id: str) -> None:
        self._pins[session_id] = replica_id
        self._pins.move_to_end(session_id)
        while len(self._pins) > self._capacity:
            self._pins.popitem(last=False)

    def drop_replica(self, replica_id: str) -> int:
        gone = [s for s, r in self._pins.items() if r == replica_id]
        for s in gone:
            del self._pins[s]
        return len(gone)

    def check_integrity(self) -> None:
        if len(self._pins) > self._capacity:
            raise AssertionError(f"pin table over capacity: {len(self._pins)} > {self._capacity}")
