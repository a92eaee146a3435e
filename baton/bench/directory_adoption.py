"""`baton bench directory`'s restart-adoption phase: a directory restarted over an ownership file
that holds DECODERS × HELD conversations receives every decoder's complete report at once (as they
arrive after a restart) and adopts their pins (router/pin_adoption.py), each adoption asking the
conversation's owner. `one_by_one` reads each owner from the file on the event loop (how it was:
~8 µs a read, 4,096 per report); `lookup` reads each report's owners in one SELECT … IN off the loop,
ordered with the ownership writes (ClaimBatcher.owners_of). Beside it a probe sends a pinned turn
every PROBE_GAP_S, timed from when it was due. Figures: the time until every pin is adopted, and the
probe's longest wait (the longest stretch the loop served nothing else). Modes alternate, REPS each.
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from baton.bench.directory_claims import DECODERS, PROBE_GAP_S, REPS, spread
from baton.paths import REPO_ROOT
from router.directory_state import DirectorySettings
from router.ownership import OwnershipStore, Write
from router.report import ReplicaReport

HELD = 4096  # conversations in one decoder's complete report (deployments' MAX_REPORTED_CONVERSATIONS)
MODES = ("one_by_one", "lookup")


@dataclass(frozen=True)
class AdoptionRun:
    mode: str
    decoders: int
    held: int
    adopt_ms: float  # the reports' arrival until every pin is adopted
    probe_max_ms: float  # the probe's longest wait meanwhile
    probe_p50_ms: float
    probes: int


async def _one_run(mode: str, path: Path, decoders: int, held: int) -> AdoptionRun:
    with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from router.directory import ConversationDirectory
    d = ConversationDirectory(DirectorySettings(policy="colocated", max_conversations=2 * decoders * held), ownership_db_path=str(path))
    if mode == "one_by_one":
        async def no_lookup(reports: list[ReplicaReport]) -> None:
            return None  # DirectoryState.report then reads each owner from the file, on the loop

        d._adoption_owners = no_lookup  # type: ignore[method-assign]
    for i in range(decoders):
        await d.report(ReplicaReport(f"decode#{i}", "decode", kv_usage=0.1, kv_capacity_tokens=1_000_000))
    await d.route("probe", "user", 100)
    reports = [ReplicaReport(f"decode#{i}", "decode", kv_usage=0.1, kv_capacity_tokens=1_000_000,
                             conversations=tuple((f"held-{i}-{j}", 1.0) for j in range(held))) for i in range(decoders)]
    waits: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        due = time.perf_counter()
        while not done.is_set():
            ahead = due - time.perf_counter()
            if ahead > 0:
                await asyncio.sleep(ahead)
            await d.route("probe", "user", 120)
            waits.append(time.perf_counter() - due)
            due = max(due + PROBE_GAP_S, time.perf_counter())  # a stall is one long wait, not a backlog of late probes

    prober = asyncio.ensure_future(probe())
    await asyncio.sleep(10 * PROBE_GAP_S)
    t0 = time.perf_counter()
    await asyncio.gather(*(d.report(r) for r in reports))
    adopt = time.perf_counter() - t0
    await asyncio.sleep(10 * PROBE_GAP_S)
    done.set()
    await prober
    if d._state.totals["pins_adopted"] != decoders * held:
        raise AssertionError(f"{mode}: {d._state.totals['pins_adopted']} pins adopted of {decoders * held}")
    d._state.check_integrity()
    return AdoptionRun(mode, decoders, held, 1e3 * adopt, 1e3 * max(waits), 1e3 * statistics.median(waits), len(waits))


@dataclass(frozen=True)
class AdoptionPoint:
    mode: str
    adopt_ms: tuple[float, float, float]  # median, min, max over the reps
    probe_max_ms: tuple[float, float, float]


def measure(decoders: int = DECODERS, held: int = HELD, reps: int = REPS) -> tuple[list[AdoptionPoint], list[AdoptionRun]]:
    cache = REPO_ROOT / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    runs: list[AdoptionRun] = []
    with tempfile.TemporaryDirectory(dir=cache, prefix="bench-adoption-") as tmp:
        path = Path(tmp) / "owners.sqlite3"
        seed = OwnershipStore(path)
        seed.write_many([Write(f"held-{i}-{j}", "user") for i in range(decoders) for j in range(held)] + [Write("probe", "user")])
        seed.close()
        for _ in range(reps):
            for mode in MODES:
                runs.append(asyncio.run(_one_run(mode, path, decoders, held)))
    points = [AdoptionPoint(m, spread([r.adopt_ms for r in runs if r.mode == m]), spread([r.probe_max_ms for r in runs if r.mode == m]))
              for m in MODES]
    return points, runs


def result_fields(points: list[AdoptionPoint], decoders: int = DECODERS) -> str:
    at = {p.mode: p for p in points}
    one, lookup = at["one_by_one"], at["lookup"]
    return (f" adoption_ms_one_by_one_d{decoders}={one.adopt_ms[0]:.1f} adoption_ms_lookup_d{decoders}={lookup.adopt_ms[0]:.1f}"
            f" adoption_stall_ms_one_by_one_d{decoders}={one.probe_max_ms[0]:.1f} adoption_stall_ms_lookup_d{decoders}={lookup.probe_max_ms[0]:.1f}")
