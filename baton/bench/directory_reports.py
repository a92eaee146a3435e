"""`baton bench directory`'s report phase: what one decoder's report costs a directory shard, with
its conversations listed in full (every report, as before deltas) or as a delta (router/held_mirror.py).

Per call, what a shard does with a report minus Serve's transport: unpickle it (the argument as it
crosses Ray) and apply it (DirectoryState.report: store it, adopt pins, update the copy of the held
conversations). The decoder holds `held` conversations, all of them routed and pinned by the
shards they hash to (so adoption skips this shard's own pins and hashes every other shard's id);
a delta lists `DELTA_SERVED` conversations served since the previous report. Each figure is the
median of REPEATS timed batches, in microseconds per report, with its min-max.
"""
from __future__ import annotations

import pickle
import statistics
import time
from dataclasses import dataclass

from router.directory_shards import shard_of
from router.directory_state import DirectorySettings, DirectoryState
from router.report import MAX_REPORTED_CONVERSATIONS, ReplicaReport

DELTA_SERVED = 8
DECODERS = 8


@dataclass(frozen=True)
class ReportCost:
    shards: int
    held: int
    complete_us: tuple[float, float, float]  # median, min, max
    delta_us: tuple[float, float, float]
    complete_bytes: int
    delta_bytes: int


def _state(shards: int, held_ids: list[str]) -> DirectoryState:
    """Shard 0 of `shards`, decoders d0..d7 reported, the held ids of this shard pinned here."""
    state = DirectoryState(DirectorySettings(policy="colocated", shards=shards, shard=0))
    for i in range(DECODERS):
        state.report(ReplicaReport(f"d{i}", "decode", kv_usage=0.1, kv_capacity_tokens=1_000_000), 0.0)
    for sid in held_ids:
        if shard_of(sid, shards) == 0:
            state.route(sid, "user", 100, 1.0)
    return state


def _timed(blobs: list[bytes], state: DirectoryState, repeats: int, now: float) -> tuple[float, float, float]:
    """(median, min, max) µs per report over `repeats` consecutive batches of `blobs` (in order: deltas by seq)."""
    size = len(blobs) // repeats
    per_call = []
    for k in range(repeats):
        batch = blobs[k * size:(k + 1) * size]
        t0 = time.perf_counter()
        for blob in batch:
            state.report(pickle.loads(blob), now)
        per_call.append((time.perf_counter() - t0) / len(batch) * 1e6)
    return statistics.median(per_call), min(per_call), max(per_call)


def measure(shards: int, calls: int, repeats: int, held: int = MAX_REPORTED_CONVERSATIONS) -> ReportCost:
    """`calls` reports per batch, `repeats` batches, each way."""
    held_ids = [f"h-{i}" for i in range(held)]
    state = _state(shards, held_ids)
    load = {"kv_usage": 0.1, "kv_capacity_tokens": 1_000_000}
    complete = pickle.dumps(ReplicaReport("d0", "decode", conversations=tuple((sid, 1.0) for sid in held_ids), **load))
    complete_us = _timed([complete] * (calls * repeats), state, repeats, 2.0)
    # then deltas in seq order on top of that complete list (seq 0), each listing DELTA_SERVED of the held ids
    deltas = [pickle.dumps(ReplicaReport("d0", "decode", conversations_complete=False, seq=n + 1, **load,
                                         conversations=tuple((held_ids[(n * DELTA_SERVED + j) % held], 0.5) for j in range(DELTA_SERVED))))
              for n in range(calls * repeats)]
    delta_us = _timed(deltas, state, repeats, 2.0)
    if state.totals["complete_lists_asked"]:
        raise AssertionError("an in-order delta after a complete list was answered with a request for the list")
    state.check_integrity()
    return ReportCost(shards, held, complete_us, delta_us, len(complete), len(deltas[0]))
