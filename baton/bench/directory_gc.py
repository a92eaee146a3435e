"""`baton bench directory`'s collector phase: what CPython's cyclic garbage collector costs the
directory's event loop, with its startup heap walked by every generation-2 collection (`default`)
or frozen out of them (`frozen`, router/heap.py, what a deployed directory and ingress now do).

The process is this bench's own: Ray Serve and the router imported, the phases before this one
run, ~the heap a directory replica starts with. A DirectoryState (8 decoders, colocated) routes
CALLS turns, NEW_EVERY-th a new conversation and the rest pinned turns of recent ones, each call
timed, so its pins grow from none to CALLS / NEW_EVERY (as after a start or a restart, or under
rising load: generation-2 collections come when the objects that survived grow by a quarter, so
a steady directory whose pins churn at a constant count has few); gc.callbacks time every
generation-2 collection meanwhile. Modes alternate, REPS each (`default` unfreezes what an earlier
phase froze). Figures: generation-2 collections, their longest pause and total, the slowest call.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

from baton.bench.directory_claims import DECODERS, REPS, spread
from router.directory_state import DirectorySettings, DirectoryState
from router.report import ReplicaReport

CALLS = 400_000
NEW_EVERY = 4  # one new conversation per 4 turns (agentic conversations of ~4 turns): 100,000 pins at the end
MODES = ("default", "frozen")


@dataclass(frozen=True)
class GcRun:
    mode: str
    calls: int
    frozen_objects: int
    gen2_collections: int
    gen2_max_ms: float  # 0.0 when none ran
    gen2_total_ms: float
    call_max_ms: float
    call_p999_ms: float


def _one_run(mode: str, calls: int) -> GcRun:
    if mode == "frozen":
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()
        gc.collect()
    pauses: list[float] = []
    started = [0.0]

    def timer(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    state = DirectoryState(DirectorySettings(policy="colocated"))
    took = []
    gc.callbacks.append(timer)
    try:
        new = 0
        for n in range(calls):
            now = 1.0 + n * 1e-4  # 10,000 turns a second
            if n % 10_000 == 0:  # each decoder reports once a second (not timed)
                for i in range(DECODERS):
                    state.report(ReplicaReport(f"decode#{i}", "decode", kv_usage=0.1, kv_capacity_tokens=1_000_000), now)
            if n % NEW_EVERY == 0:
                new += 1
                sid = f"conv-{new}"
            else:
                sid = f"conv-{max(1, new - n % 97)}"  # a recent conversation's next turn
            t = time.perf_counter()
            state.route(sid, "user", 100 + n % 500, now)
            took.append(time.perf_counter() - t)
    finally:
        gc.callbacks.remove(timer)
    state.check_integrity()
    took.sort()
    return GcRun(mode, calls, gc.get_freeze_count(), len(pauses), 1e3 * max(pauses, default=0.0), 1e3 * sum(pauses),
                 1e3 * took[-1], 1e3 * took[int(0.999 * (len(took) - 1))])


@dataclass(frozen=True)
class GcPoint:
    mode: str
    gen2_max_ms: tuple[float, float, float]  # median, min, max over the reps
    call_max_ms: tuple[float, float, float]
    call_p999_ms: float
    gen2_collections: float  # median per run


def measure(calls: int = CALLS, reps: int = REPS) -> tuple[list[GcPoint], list[GcRun]]:
    runs = [_one_run(mode, calls) for _ in range(reps) for mode in MODES]
    gc.collect()
    gc.freeze()  # as the phase found it: the directory objects built before froze the heap
    points = []
    for m in MODES:
        mine = [r for r in runs if r.mode == m]
        points.append(GcPoint(m, spread([r.gen2_max_ms for r in mine]), spread([r.call_max_ms for r in mine]),
                              statistics.median(r.call_p999_ms for r in mine), statistics.median(r.gen2_collections for r in mine)))
    return points, runs


def result_fields(points: list[GcPoint]) -> str:
    at = {p.mode: p for p in points}
    return (f" gc_gen2_max_ms_default={at['default'].gen2_max_ms[0]:.1f} gc_gen2_max_ms_frozen={at['frozen'].gen2_max_ms[0]:.1f}"
            f" route_max_ms_gc_default={at['default'].call_max_ms[0]:.1f} route_max_ms_gc_frozen={at['frozen'].call_max_ms[0]:.1f}")
