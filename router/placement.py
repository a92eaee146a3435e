"""Pure load ranking of engine replicas (used by the Serve request router when a request has no
explicit target, e.g. choosing a prefill replica)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router can observe about one replica right now."""

    replica_id: str
    kv_usage: float = 0.0  # fraction of the KV pool in use (engine-reported)
    queue_len: int = 0  # requests in flight (router/engine view, whichever is larger)
    pending_prefill_tokens: int = 0  # prompt tokens queued or being prefilled (engine-reported)


@dataclass(frozen=True)
class LoadWeights:
    kv_weight: float = 1.0
    queue_weight: float = 0.05
    prefill_token_weight: float = 1.0 / 8192  # one full 8k-token prefill ~ one full KV pool


def load_score(load: ReplicaLoad, w: LoadWeights) -> float:
    return w.kv_weight * load.kv_usage + w.queue_weight * load.queue_len + w.prefill_token_weight * load.pending_prefill_tokens


def rank_by_load(loads: list[ReplicaLoad], w: LoadWeights) -> tuple[tuple[str, ...], ...]:
    """Replicas grouped into ranks of equal score, least loaded first (ties in replica-id order)."""
    ranks: list[list[str]] = []
    last: float | None = None
    scored = sorted((round(load_score(x, w), 9), x.replica_id) for x in loads)
    for score, replica_id in scored:
        if last is None or score != last:
            ranks.append([])
            last = score
        ranks[-1].append(replica_id)
    return tuple(tuple(r) for r in ranks)


def rank_with_target(target: str | None, loads: list[ReplicaLoad], w: LoadWeights) -> tuple[tuple[str, ...], ...]:
    """The target alone when it is a candidate (the directory chose it); otherwise by load."""
    if target is not None and any(l.replica_id == target for l in loads):
        return ((target,),)
    return rank_by_load(loads, w)
