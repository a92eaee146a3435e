"""Pure load ranking of engine replicas (used by the Serve request router when a request has no
explicit target, e.g. choosing a prefill replica). The score itself is router/scoring.py's."""
from __future__ import annotations

from router.scoring import LoadWeights, ReplicaLoad, load_score


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
    if target is not None and any(load.replica_id == target for load in loads):
        return ((target,),)
    return rank_by_load(loads, w)
