"""Pure load ranking of engine replicas (used by the Serve request router when a request has no
explicit target). The score itself is router/scoring.py's.

The prefill replica of a remote prefill is chosen by the conversation directory
(`choose_prefill`: fewest queued prefill tokens, as reported plus what it sent since) and
arrives as the prefill request's target; the Serve router ranks by load only when there is no
directory, or the target is gone."""
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


def choose_prefill(prefills: list[ReplicaLoad], *, decoder_idle: bool, limit_tokens: int) -> str | None:
    """The prefill replica with the fewest queued prefill tokens (`pending_prefill_tokens`; then
    fewer in flight, then replica id). None, meaning prefill on the decoder instead, when there
    is none, or when every one has more than `limit_tokens` queued while the decoder is idle:
    the prefill pool is the bottleneck and the decoder has room to prefill the turn itself."""
    if not prefills:
        return None
    best = min(prefills, key=lambda p: (p.pending_prefill_tokens, p.in_flight, p.replica_id))
    if decoder_idle and best.pending_prefill_tokens > limit_tokens:
        return None
    return best.replica_id


def decoder_idle(num_waiting: int, queued_prefill_tokens: int, small_prefill_tokens: int) -> bool:
    """A decoder that can take a prefill now: nothing waiting in its engine and at most a small
    prefill (`small_prefill_tokens`, what conditional_pd prefills locally) queued."""
    return num_waiting == 0 and queued_prefill_tokens <= small_prefill_tokens
