"""`baton bench directory`'s durable-claims phase: new conversations whose ownership is written to
the SQLite file (WAL, synchronous=FULL), as a deployed directory writes it by default, claimed one
by one on the directory's event loop (how it was) or in group commits off it (router/claim_batch.py).
Two workloads: `open` (each conversation's first turn: a claim) and `open_end` (its first turn, then
its owner's DELETE: a claim and an end, both written to the file).

One in-process ConversationDirectory (its metrics inert outside Serve) on a fresh file under the
project's .cache (the default ownership path's disk), 8 decoders reported. `callers` coroutines
open NEW conversations back to back (each a first turn: a claim, then placement; under `open_end`
then its end; between two calls a caller yields to the loop, as calls arriving from Serve do). Beside them a probe sends a pinned
conversation's next turn every PROBE_GAP_S and times it from when it was due (a late start counts):
what every other call of the directory (pinned turns, reports, syncs) waits while the loop is busy.
The "one by one" mode swaps in a claimer that writes each claim and end on the loop, exactly the
code path before the group commit; everything else is the same object. Modes alternate, REPS each; figures
are medians of the reps with min-max.
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from baton.paths import REPO_ROOT
from router.directory_state import DirectorySettings
from router.ownership import Claim, KnownOwners
from router.report import ReplicaReport

CALLERS = (1, 16, 64)
WORKLOADS = ("open", "open_end")
REPS = 3
PROBE_GAP_S = 0.002
DECODERS = 8


class OneByOne:
    """Claims and ends written on the event loop, one transaction (fsync) each: the directory before router/claim_batch.py."""

    def __init__(self, owners: KnownOwners):
        self.owners = owners

    async def claim(self, session_id: str, user: str | None) -> Claim:
        return self.owners.claim(session_id, user)

    async def end(self, session_id: str, user: str | None) -> bool:
        return self.owners.forget(session_id, user)


@dataclass(frozen=True)
class ClaimRun:
    workload: str  # "open" | "open_end"
    mode: str  # "one_by_one" | "group"
    callers: int
    conversations: int
    new_per_s: float  # conversations per second (under open_end: opened and ended)
    probe_p50_ms: float
    probe_p99_ms: float
    probes: int
    flushes: int | None  # group commit only: transactions written


@dataclass(frozen=True)
class ClaimPoint:
    workload: str
    mode: str
    callers: int
    new_per_s: tuple[float, float, float]  # median, min, max over the reps
    probe_p99_ms: tuple[float, float, float]
    probe_p50_ms: float
    mean_batch: float | None


async def _one_run(workload: str, mode: str, callers: int, conversations: int, folder: Path) -> ClaimRun:
    with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from router.directory import ConversationDirectory
    d = ConversationDirectory(DirectorySettings(policy="colocated", max_conversations=10 * conversations),
                              ownership_db_path=str(folder / f"{workload}-{mode}-{callers}-{time.monotonic_ns()}.sqlite3"))
    if mode == "one_by_one":
        d._claims = OneByOne(d._claims.owners)  # type: ignore[assignment]
    for i in range(DECODERS):
        await d.report(ReplicaReport(f"decode#{i}", "decode", kv_usage=0.1, kv_capacity_tokens=1_000_000))
    await d.route("probe", "user", 100)
    flushed_before = d._claims.stats().flushes if mode == "group" else 0  # type: ignore[attr-defined]
    left = [conversations]
    done = asyncio.Event()

    async def opener(c: int) -> None:
        n = 0
        while left[0] > 0:
            left[0] -= 1
            await d.route(f"new-{c}-{n}", "user", 100)
            if workload == "open_end":
                await asyncio.sleep(0)
                if not await d.end_conversation(f"new-{c}-{n}", "user"):
                    raise AssertionError(f"new-{c}-{n} was not ended")
            n += 1
            await asyncio.sleep(0)  # the next call arrives as a new task, as Serve's calls do: the loop may run others first

    waits: list[float] = []

    async def probe() -> None:
        due = time.perf_counter()
        while not done.is_set():  # a pinned turn due every PROBE_GAP_S; its latency counts from when it was due
            ahead = due - time.perf_counter()
            if ahead > 0:
                await asyncio.sleep(ahead)
            await d.route("probe", "user", 120)
            waits.append(time.perf_counter() - due)
            due += PROBE_GAP_S

    prober = asyncio.ensure_future(probe())
    t0 = time.perf_counter()
    await asyncio.gather(*(opener(c) for c in range(callers)))
    wall = time.perf_counter() - t0
    done.set()
    await prober
    d._state.check_integrity()
    stats = d._claims.stats() if mode == "group" else None  # type: ignore[attr-defined]
    q = statistics.quantiles(waits, n=100, method="inclusive") if len(waits) > 1 else [waits[0]] * 99
    return ClaimRun(workload, mode, callers, conversations, conversations / wall, 1e3 * statistics.median(waits), 1e3 * q[98], len(waits),
                    stats.flushes - flushed_before if stats is not None else None)


def spread(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def measure(conversations: int, callers: tuple[int, ...] = CALLERS, reps: int = REPS,
            workloads: tuple[str, ...] = WORKLOADS) -> tuple[list[ClaimPoint], list[ClaimRun]]:
    """Every (workload, mode, callers) cell REPS times, the modes alternating within each rep."""
    cache = REPO_ROOT / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    runs: list[ClaimRun] = []
    with tempfile.TemporaryDirectory(dir=cache, prefix="bench-claims-") as tmp:
        for _ in range(reps):
            for w in workloads:
                for c in callers:
                    for mode in ("one_by_one", "group"):
                        runs.append(asyncio.run(_one_run(w, mode, c, conversations, Path(tmp))))
    points = []
    for w in workloads:
        for c in callers:
            for mode in ("one_by_one", "group"):
                mine = [r for r in runs if r.workload == w and r.mode == mode and r.callers == c]
                writes = 2 if w == "open_end" else 1
                batches = [writes * r.conversations / r.flushes for r in mine if r.flushes]
                points.append(ClaimPoint(w, mode, c, spread([r.new_per_s for r in mine]), spread([r.probe_p99_ms for r in mine]),
                                     statistics.median(r.probe_p50_ms for r in mine), statistics.median(batches) if batches else None))
    return points, runs


def result_fields(points: list[ClaimPoint]) -> str:
    """The RESULT fields at the most callers, per workload present: conversations/s and the probe's
    p99, both modes, and their ratio (`open`: durable_new_*; `open_end`: durable_lifecycle_*)."""
    out = ""
    for workload, name, p99 in (("open", "new", "pinned_p99_ms"), ("open_end", "lifecycle", "pinned_p99_ms_lifecycle")):
        mine = [p for p in points if p.workload == workload]
        if not mine:
            continue
        c = max(p.callers for p in mine)
        at = {p.mode: p for p in mine if p.callers == c}
        one, group = at["one_by_one"], at["group"]
        out += (f" durable_{name}_per_s_one_by_one_c{c}={one.new_per_s[0]:.0f} durable_{name}_per_s_group_c{c}={group.new_per_s[0]:.0f}"
                f" durable_{name}_speedup_c{c}={group.new_per_s[0] / one.new_per_s[0]:.2f}"
                f" {p99}_one_by_one_c{c}={one.probe_p99_ms[0]:.2f} {p99}_group_c{c}={group.probe_p99_ms[0]:.2f}")
    return out
