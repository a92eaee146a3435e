"""`baton bench directory`: the conversation directory's own CPU per routing decision, without Ray.

What it measures: router/directory_state.DirectoryState — the code one directory replica (or one
shard) runs for every call — in this process, over a grid of fleet sizes (decode replicas that
have reported) and live pins (conversations already placed). At each grid point it times, after
building the state: `route` of a new conversation (the ownership claim in an in-memory SQLite
store, placement over every live decoder, the pin recorded), `route` of a pinned conversation's
next turn, and one ingress pin-cache `sync` carrying 16 touches, with one decoder's report among
every REPORT_EVERY calls (its time counted: reports change what a decision reads). The directory's
clock advances DECISION_S per call, so the turns routed to a decoder stop counting as its unreported
load two of its reports later (router/unreported.py; these reports list no conversations, so none
is acknowledged sooner), as they would at 1 / DECISION_S decisions a second. Each figure is the median of
REPEATS timed batches (its spread, min-max, beside it), in microseconds per call; the ceiling is
1e6 ÷ that: the decisions per second one directory replica can compute when the CPU is its own,
before Ray Serve's transport (which bench control measures, with it).

Why: the directory is the one serial role of the control plane (router/directory_shards.py), and
its per-decision cost must not grow with the conversations it holds. Before pins were kept in a
PinTable (router/pin_table.py) every placement counted every pin; `pins_growth` (a new
conversation's cost at the most pins over the fewest, at the largest fleet) says whether a
placement's cost still grows with the pins (1.0: it does not).

Then what one decoder's report costs a shard (baton/bench/directory_reports.py): its held
conversations listed in full, as every report did before deltas, or as a delta, at 1 and 2 shards.
Then new conversations whose ownership goes to a real SQLite file (baton/bench/directory_claims.py):
claimed one by one on the event loop, or in group commits off it (router/claim_batch.py), alone or
each followed by its end. Then a restarted directory adopting 8 decoders' pins from their complete
reports (baton/bench/directory_adoption.py): owners read one by one on the loop, or in one lookup off it.
Then the garbage collector's pauses while the pins grow, the startup heap walked or frozen (baton/bench/directory_gc.py).

RESULT: `route_new_us_at_<R>` and `route_pinned_us_at_<R>` at the largest fleet and most pins,
`ceiling_new_per_s_at_<R>`, `pins_growth`, `replicas_growth` (new conversation, largest fleet
over smallest, at the fewest pins), `report_us_complete_shards2` and `report_us_delta_shards2`
(a decoder holding MAX_REPORTED_CONVERSATIONS conversations, 2 shards), and directory_claims.result_fields
(durable new conversations/s and a pinned turn's p99 meanwhile, one by one vs group commit, then the
same for conversations opened and ended) and directory_adoption.result_fields (the adoption's time and
a pinned turn's longest wait meanwhile, both ways) and directory_gc.result_fields (the longest
generation-2 pause and the slowest turn, the startup heap walked or frozen)."""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from baton.bench import directory_adoption, directory_claims, directory_gc, directory_reports
from baton.bench.directory_reports import ReportCost
from router.directory_state import DirectorySettings, DirectoryState
from router.pin_cache import Touch
from router.report import ReplicaReport

REPEATS = 7
SYNC_TOUCHES = 16
REPORT_CALLS = 50  # reports per timed batch (the report phase)
# in the route and sync batches, one decoder's report per this many calls (its time included): 128
# decoders reporting each second send one per 16 decisions at 2,000 decisions/s
REPORT_EVERY = 16
DECISION_S = 1e-4  # the directory's clock per timed call: 10,000 decisions a second
REPORT_SHARDS = (1, 2)
CLAIM_CONVERSATIONS, CLAIM_CONVERSATIONS_QUICK = 4000, 2000  # new conversations per durable-claims run


@dataclass(frozen=True)
class Grid:
    replicas: tuple[int, ...]
    pins: tuple[int, ...]
    calls: int  # timed calls per batch


def grid(quick: bool) -> Grid:
    if quick:
        return Grid(replicas=(8, 128), pins=(1_000, 100_000), calls=200)
    return Grid(replicas=(8, 32, 128, 512), pins=(1_000, 10_000, 100_000), calls=500)


@dataclass(frozen=True)
class Timed:
    median_us: float
    min_us: float
    max_us: float


@dataclass(frozen=True)
class Point:
    replicas: int
    pins: int
    route_new: Timed
    route_pinned: Timed
    sync: Timed


def build_state(replicas: int, pins: int) -> DirectoryState:
    """A colocated directory whose `replicas` decoders reported equal loads and that holds `pins` conversations."""
    state = DirectoryState(DirectorySettings(policy="colocated", max_conversations=10 * pins + 1_000_000))
    for i in range(replicas):
        state.report(ReplicaReport(f"d{i}", "decode", kv_usage=0.1, kv_capacity_tokens=1_000_000), 0.0)
    for i in range(pins):
        state.route(f"held-{i}", "user", 100, 1.0)
    return state


def timed(batch: Callable[[int], None], calls: int) -> Timed:
    """`batch(k)` makes `calls` calls (k: the batch's index, for fresh ids); REPEATS batches."""
    per_call = []
    for k in range(REPEATS):
        t0 = time.perf_counter()
        batch(k)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return Timed(statistics.median(per_call), min(per_call), max(per_call))


def measure(replicas: int, pins: int, calls: int) -> Point:
    state = build_state(replicas, pins)
    clock = [2.0]
    reports = [ReplicaReport(f"d{i % replicas}", "decode", kv_usage=0.1 + 0.01 * (i % 7), kv_capacity_tokens=1_000_000)
               for i in range(calls // REPORT_EVERY + 1)]

    def tick() -> float:
        clock[0] += DECISION_S
        return clock[0]

    def reported(i: int) -> float:  # a decoder's report every REPORT_EVERY calls: what a fleet of decoders sends meanwhile
        now = tick()
        if i % REPORT_EVERY == 0:
            state.report(reports[(i // REPORT_EVERY) % len(reports)], now)
        return now

    def new(k: int) -> None:
        for i in range(calls):
            state.route(f"new-{k}-{i}", "user", 100, reported(i))

    def pinned(k: int) -> None:
        for i in range(calls):
            state.route(f"held-{(k * calls + i) % pins}", "user", 120, reported(i))

    start = state.route("syncing", "user", 100, tick(), via="ingress")
    seq = [start.pin_seq]

    def touches_of(i: int) -> list[Touch]:  # 16 pinned conversations, on the decoders they are pinned to
        sids = [f"held-{(i * SYNC_TOUCHES + j) % pins}" for j in range(SYNC_TOUCHES)]
        return [Touch(sid, "user", state.pin_of(sid).decoder, 130, 0.0) for sid in sids]  # type: ignore[union-attr]

    batches = [touches_of(i) for i in range(calls)]  # built before the clock starts: only the sync is timed

    def sync(k: int) -> None:
        for i, touches in enumerate(batches):
            reply = state.sync("ingress", start.incarnation, seq[0], touches, reported(i))
            seq[0] = reply.seq

    point = Point(replicas, pins, timed(new, calls), timed(pinned, calls), timed(sync, calls))
    state.check_integrity()
    return point


def result_line(points: list[Point], reports: list[ReportCost]) -> str:
    r_max, r_min = max(p.replicas for p in points), min(p.replicas for p in points)
    p_max, p_min = max(p.pins for p in points), min(p.pins for p in points)
    at = {(p.replicas, p.pins): p for p in points}
    big, few, small = at[(r_max, p_max)], at[(r_max, p_min)], at[(r_min, p_min)]
    return (f"RESULT route_new_us_at_{r_max}={big.route_new.median_us:.1f} route_pinned_us_at_{r_max}={big.route_pinned.median_us:.1f} "
            f"ceiling_new_per_s_at_{r_max}={1e6 / big.route_new.median_us:.0f} "
            f"pins_growth={big.route_new.median_us / few.route_new.median_us:.3f} "
            f"replicas_growth={few.route_new.median_us / small.route_new.median_us:.3f}"
            + "".join(f" report_us_complete_shards{r.shards}={r.complete_us[0]:.1f} report_us_delta_shards{r.shards}={r.delta_us[0]:.1f}"
                      for r in reports if r.shards == max(x.shards for x in reports)))


def _plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for pins in sorted({p.pins for p in points}):
        row = sorted((p for p in points if p.pins == pins), key=lambda p: p.replicas)
        xs = [p.replicas for p in row]
        ax.errorbar(xs, [p.route_new.median_us for p in row], yerr=[[p.route_new.median_us - p.route_new.min_us for p in row],
                    [p.route_new.max_us - p.route_new.median_us for p in row]], marker="o", capsize=3, label=f"new, {pins} pins")
        ax.plot(xs, [p.route_pinned.median_us for p in row], marker="x", linestyle="--", label=f"pinned, {pins} pins")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode replicas reporting")
    ax.set_ylabel("µs per route call (median of batches)")
    ax.set_title("conversation directory: CPU per routing decision")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    g = grid(quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[directory] replicas {g.replicas} x pins {g.pins}, {REPEATS} batches of {g.calls} calls each, in this process")
    points = []
    for replicas in g.replicas:
        for pins in g.pins:
            p = measure(replicas, pins, g.calls)
            points.append(p)
            print(f"[directory] {replicas:>4} replicas {pins:>7} pins: route new {p.route_new.median_us:7.1f} us "
                  f"({p.route_new.min_us:.1f}-{p.route_new.max_us:.1f}), pinned {p.route_pinned.median_us:7.1f} us, "
                  f"sync of {SYNC_TOUCHES} touches {p.sync.median_us:7.1f} us; ceiling {1e6 / p.route_new.median_us:8.0f} new/s", flush=True)
    reports = []
    for shards in REPORT_SHARDS:
        r = directory_reports.measure(shards, REPORT_CALLS, REPEATS)
        reports.append(r)
        print(f"[directory] a decoder holding {r.held} conversations reports to shard 0 of {shards}: complete list "
              f"{r.complete_us[0]:7.1f} us ({r.complete_us[1]:.1f}-{r.complete_us[2]:.1f}, {r.complete_bytes} bytes), delta of "
              f"{directory_reports.DELTA_SERVED} {r.delta_us[0]:6.1f} us ({r.delta_us[1]:.1f}-{r.delta_us[2]:.1f}, {r.delta_bytes} bytes)", flush=True)
    conversations = CLAIM_CONVERSATIONS_QUICK if quick else CLAIM_CONVERSATIONS
    claim_points, claim_runs = directory_claims.measure(conversations)
    for c in claim_points:
        batch = f", {c.mean_batch:.1f} writes per transaction" if c.mean_batch is not None else ""
        what = "new conversations/s" if c.workload == "open" else "conversations opened and ended/s"
        print(f"[directory] durable {c.workload:8s} {c.mode:10s} {c.callers:>3} callers: {c.new_per_s[0]:7.0f} {what} "
              f"({c.new_per_s[1]:.0f}-{c.new_per_s[2]:.0f}); a pinned turn meanwhile p50 {c.probe_p50_ms:.2f} ms, p99 "
              f"{c.probe_p99_ms[0]:.2f} ms ({c.probe_p99_ms[1]:.2f}-{c.probe_p99_ms[2]:.2f}){batch}", flush=True)
    adoption_points, adoption_runs = directory_adoption.measure(directory_claims.DECODERS, directory_adoption.HELD)
    for a in adoption_points:
        print(f"[directory] restart: {directory_claims.DECODERS} decoders report {directory_adoption.HELD} conversations each, owners read "
              f"{a.mode:10s}: all pins adopted in {a.adopt_ms[0]:6.1f} ms ({a.adopt_ms[1]:.1f}-{a.adopt_ms[2]:.1f}); a pinned turn's "
              f"longest wait meanwhile {a.probe_max_ms[0]:6.1f} ms ({a.probe_max_ms[1]:.1f}-{a.probe_max_ms[2]:.1f})", flush=True)
    gc_points, gc_runs = directory_gc.measure(directory_gc.CALLS)
    for g in gc_points:
        print(f"[directory] collector, heap {g.mode:7s}: {directory_gc.CALLS} turns, pins 0 -> {directory_gc.CALLS // directory_gc.NEW_EVERY}: "
              f"{g.gen2_collections:.0f} generation-2 collections, the longest {g.gen2_max_ms[0]:6.1f} ms ({g.gen2_max_ms[1]:.1f}-"
              f"{g.gen2_max_ms[2]:.1f}); the slowest turn {g.call_max_ms[0]:6.1f} ms, p99.9 {g.call_p999_ms:.3f} ms", flush=True)
    line = (result_line(points, reports) + directory_claims.result_fields(claim_points) + directory_adoption.result_fields(adoption_points)
            + directory_gc.result_fields(gc_points))
    report = {"quick": quick, "grid": asdict(g), "repeats": REPEATS, "sync_touches": SYNC_TOUCHES,
              "points": [asdict(p) for p in points], "reports": [asdict(r) for r in reports],
              "durable_claims": {"conversations": conversations, "points": [asdict(c) for c in claim_points],
                                 "runs": [asdict(r) for r in claim_runs]},
              "restart_adoption": {"decoders": directory_claims.DECODERS, "held": directory_adoption.HELD,
                                   "points": [asdict(a) for a in adoption_points], "runs": [asdict(r) for r in adoption_runs]},
              "collector": {"calls": directory_gc.CALLS, "new_every": directory_gc.NEW_EVERY,
                            "points": [asdict(g) for g in gc_points], "runs": [asdict(r) for r in gc_runs]},
              "result": line}
    (out_dir / "directory.json").write_text(json.dumps(report, indent=2))
    _plot(points, out_dir / "directory.png")
    print(f"[directory] wrote {out_dir / 'directory.json'} and {out_dir / 'directory.png'}")
    print(line)
    return report
