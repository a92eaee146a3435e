"""Pure figures of the control-plane bench (baton/bench/control.py): one (replicas, concurrency,
variant) point's summary from its turns, the concurrency where routing decisions/s stop growing,
which fleet sizes fit in this machine's memory, and the RESULT line (the best point, the goal and
the saturation read the `pin_cache` variant, the default config; `no_pin_cache` is compared to it,
and the best `throughput_optimized` point is reported beside it).

Failures are never dropped (the convention of baton/bench/conserve_stats.py): a failed turn
(non-200, an error event, no `[DONE]`, an exception, a timeout) is counted, and it is a +inf
sample of every per-turn figure (client latency, TTFT, the route hop, ingress overhead), so a
percentile whose rank reaches it is +inf and a point cannot look fast by losing its slow turns."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton.bench.conserve_stats import INF, percentile
from baton.bench.control_config import NO_PIN_CACHE, PIN_CACHE, SHARDED_DIRECTORY, SHARDED_RELAY, THROUGHPUT_OPTIMIZED, Variant

GIB = 1 << 30
MIB = 1 << 20
SATURATION_GROWTH = 0.10  # decisions/s growing by less than this from one concurrency to the next: saturated
DEFAULT_RESERVE_BYTES = 3 * GIB  # a fleet size is run only if it leaves this much memory free
GOAL_DECISIONS_PER_S = 2000.0  # the goal, at the largest fleet this machine holds
GOAL_ROUTE_P99_S = 0.010


@dataclass(frozen=True)
class TurnSample:
    """One chat turn as the load generator saw it. hops: Server-Timing, seconds (HOPS names)."""

    ok: bool
    started_s: float  # offset from the start of the measured window
    latency_s: float  # sent -> last byte (failures: until the failure was seen)
    ttft_s: float | None = None  # sent -> first content delta
    hops: dict[str, float] = field(default_factory=dict)
    status: int | None = None  # HTTP status (None: no response)
    error: str | None = None  # why it failed (None when ok)

    @property
    def ingress_overhead_s(self) -> float | None:
        """Baton's time around the engine replica: total − replica − engine (parse, route,
        prefill, to_replica, from_replica); None without those three hops."""
        h = self.hops
        if not all(k in h for k in ("total", "replica", "engine")):
            return None
        return h["total"] - h["replica"] - h["engine"]

    @property
    def outside_s(self) -> float | None:
        """The client's TTFT minus the server's `total`: the HTTP proxy both ways and the client."""
        return None if self.ttft_s is None or "total" not in self.hops else self.ttft_s - self.hops["total"]


@dataclass(frozen=True)
class PointStats:
    """One (replicas, concurrency, variant) point. Percentiles in seconds; +inf when a failure
    reaches the rank. The CPU fields are control_cpu.CpuPerTurn's, set once the window's CPU was
    read ({} and nan: not measured)."""

    replicas: int
    concurrency: int
    turns: int  # turns started in the measured window (ok + failed)
    failures: int
    elapsed_s: float  # window start -> the last of its turns finished
    decisions_per_s: float  # ok turns / elapsed_s: each ok turn is one directory placement
    latency_p50_s: float | None
    latency_p99_s: float | None
    route_p50_s: float | None
    route_p99_s: float | None
    ingress_overhead_p50_s: float | None
    outside_p50_s: float | None
    hops_p50_s: dict[str, float | None]
    errors: dict[str, int]  # failure reason -> count
    variant: str = PIN_CACHE.name  # control_config.Variant.name of the run (default: the default config)
    cpu_ms_per_turn: dict[str, float] = field(default_factory=dict)  # role -> CPU ms per ok turn in the window
    cpu_ms_per_turn_total: float = math.nan  # every role's CPU ms together per ok turn


def _with_failures(turns: Sequence[TurnSample], value: Callable[[TurnSample], float | None]) -> list[float]:
    """value(turn) of every ok turn that has it, and +inf for every failed turn."""
    out: list[float] = []
    for t in turns:
        if not t.ok:
            out.append(INF)
            continue
        v = value(t)
        if v is not None:
            out.append(v)
    return out


def summarize_point(replicas: int, concurrency: int, turns: Sequence[TurnSample], elapsed_s: float, *,
                    variant: str = PIN_CACHE.name) -> PointStats:
    """The point's figures from every turn started in its window (see the module docstring)."""
    if elapsed_s <= 0:
        raise ValueError("elapsed_s must be > 0")
    ok = sum(t.ok for t in turns)
    latency = _with_failures(turns, lambda t: t.latency_s)
    route = _with_failures(turns, lambda t: t.hops.get("route"))
    overhead = _with_failures(turns, lambda t: t.ingress_overhead_s)
    outside = _with_failures(turns, lambda t: t.outside_s)
    hop_names = sorted({h for t in turns for h in t.hops})
    hops = {h: percentile(_with_failures(turns, lambda t, h=h: t.hops.get(h)), 50) for h in hop_names}
    errors: dict[str, int] = {}
    for t in turns:
        if not t.ok:
            reason = t.error or "failed"
            errors[reason] = errors.get(reason, 0) + 1
    return PointStats(
        replicas=replicas, concurrency=concurrency, turns=len(turns), failures=len(turns) - ok, elapsed_s=elapsed_s,
        decisions_per_s=ok / elapsed_s,
        latency_p50_s=percentile(latency, 50), latency_p99_s=percentile(latency, 99),
        route_p50_s=percentile(route, 50), route_p99_s=percentile(route, 99),
        ingress_overhead_p50_s=percentile(overhead, 50), outside_p50_s=percentile(outside, 50),
        hops_p50_s=hops, errors=errors, variant=variant,
    )


def saturation_concurrency(concurrencies: Sequence[int], rates: Sequence[float], growth: float = SATURATION_GROWTH) -> int | None:
    """The first concurrency after which decisions/s grow by less than `growth` (10 %) at the
    next one (the knee of the sweep); None when they keep growing over the whole sweep."""
    if len(concurrencies) != len(rates):
        raise ValueError("one rate per concurrency")
    order = sorted(range(len(concurrencies)), key=lambda i: concurrencies[i])
    for a, b in zip(order, order[1:], strict=False):
        if rates[b] < rates[a] * (1 + growth):
            return concurrencies[a]
    return None


@dataclass(frozen=True)
class MemoryModel:
    """What one fleet size costs, measured at the first (smallest) size that ran: the mean RSS of
    a decode replica, and the rest of the cluster (Ray, Serve, ingress, directory) as what the
    machine's MemAvailable fell by, less the replicas. RSS counts shared library pages in every
    process, so the projection errs on the side of too much."""

    per_replica_bytes: float
    base_bytes: float


def memory_model(replica_rss: Sequence[int], available_idle: int, available_running: int) -> MemoryModel:
    """From the replicas' RSS and MemAvailable before the cluster started and while it ran."""
    if not replica_rss:
        raise ValueError("no replica RSS measured")
    per = sum(replica_rss) / len(replica_rss)
    used = available_idle - available_running
    return MemoryModel(per_replica_bytes=per, base_bytes=max(0.0, used - per * len(replica_rss)))


def projected_free_bytes(model: MemoryModel, replicas: int, available_now: int) -> float:
    """MemAvailable left once `replicas` replicas and the rest of the cluster run."""
    return available_now - model.base_bytes - model.per_replica_bytes * replicas


def fits(model: MemoryModel, replicas: int, available_now: int, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> bool:
    """True when `replicas` would leave at least reserve_bytes (3 GiB) free."""
    return projected_free_bytes(model, replicas, available_now) >= reserve_bytes


def projected_ceiling(model: MemoryModel, available_idle: int, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> int:
    """The most replicas that leave reserve_bytes free on this machine (from the model, not run)."""
    room = available_idle - reserve_bytes - model.base_bytes
    return max(0, math.floor(room / model.per_replica_bytes)) if model.per_replica_bytes > 0 else 0


def best_point(points: Sequence[PointStats], variant: str = PIN_CACHE.name) -> PointStats | None:
    """The point of `variant` with the most routing decisions/s (ties: fewer failures, then more replicas)."""
    mine = [p for p in points if p.variant == variant]
    return max(mine, key=lambda p: (p.decisions_per_s, -p.failures, p.replicas), default=None)


def counterpart(points: Sequence[PointStats], point: PointStats, variant: str) -> PointStats | None:
    """The point of `variant` at the same fleet size and concurrency as `point` (None: not run)."""
    return next((p for p in points if p.variant == variant and (p.replicas, p.concurrency) == (point.replicas, point.concurrency)), None)


def ratio(a: float, b: float) -> float:
    """a / b; b == 0: +inf when a > 0, nan when a == 0 too."""
    if b == 0:
        return math.inf if a > 0 else math.nan
    return a / b


@dataclass(frozen=True)
class GoalVerdict:
    """The goal at one fleet size: the most decisions/s among its points whose route p99 is
    within the bound (0.0 and concurrency None when no point is)."""

    replicas: int
    decisions_per_s: float
    concurrency: int | None
    met: bool


def goal_verdict(points: Sequence[PointStats], replicas: int, min_rate: float = GOAL_DECISIONS_PER_S,
                 max_route_p99_s: float = GOAL_ROUTE_P99_S, variant: str = PIN_CACHE.name) -> GoalVerdict:
    """The goal over the points of `variant` at `replicas` (see GoalVerdict)."""
    within = [p for p in points if p.variant == variant and p.replicas == replicas
              and p.route_p99_s is not None and p.route_p99_s <= max_route_p99_s]
    best = max(within, key=lambda p: p.decisions_per_s, default=None)
    if best is None:
        return GoalVerdict(replicas, 0.0, None, False)
    return GoalVerdict(replicas, best.decisions_per_s, best.concurrency, best.decisions_per_s >= min_rate)


def directory_ceiling(point: PointStats | None, variant: Variant) -> float | None:
    """The decisions/s the directory's CPU allows at `point`'s cost: each shard is one replica
    that serves one call at a time, so at most one core each, and the hash spreads conversations
    evenly (tests/unit/test_directory_shards.py: within 5 %), so shards × 1000 ÷ the directory's
    CPU ms per turn over all its shards (control_cpu.py). Reports reach every shard, so their cost
    grows with the shards and is in the figure. None: not measured (nan or 0 ms)."""
    if point is None:
        return None
    ms = point.cpu_ms_per_turn.get("directory", math.nan)
    if not 0 < ms < math.inf:  # nan fails it too
        return None
    return variant.directory_shards * 1000.0 / ms


def _ms(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "nan"
    return "inf" if x == INF else f"{x * 1000:.2f}"


def _num(x: float | None, digits: int) -> str:
    if x is None or math.isnan(x):
        return "nan"
    return "inf" if math.isinf(x) else f"{x:.{digits}f}"


def result_line(points: Sequence[PointStats], max_replicas_run: int | None, per_replica_rss_bytes: float | None) -> str:
    """`RESULT decisions_per_s_max=… route_p99_ms_at_max=… replicas_at_max=… max_replicas_on_this_machine=…
    per_replica_rss_mib=… saturated_at_concurrency=… decisions_per_s_ratio_pin_cache=… route_p50_ms_at_max=…
    route_p50_ms_no_pin_cache=… cpu_ms_per_turn_at_max=… decisions_per_s_max_throughput_optimized=…
    route_p99_ms_throughput_optimized=… cpu_ms_per_turn_throughput_optimized=…
    decisions_per_s_ratio_throughput_optimized=… directory_ceiling_throughput_optimized=…
    decisions_per_s_max_sharded_directory=… directory_ceiling_sharded_directory=…
    directory_ceiling_ratio_sharded=… decisions_per_s_max_sharded_relay=… directory_ceiling_sharded_relay=…
    directory_ceiling_ratio_relay=…`.

    The best point of the `pin_cache` variant (the default config), the concurrency where its
    fleet size saturates (`none`: still growing at the sweep's end; `nan`: nothing ran), its
    decisions/s over the `no_pin_cache` point's at the same size and concurrency (x / 0: inf;
    `nan`: that point did not run, or 0 / 0), both points' route p50, and the best point's CPU ms
    per ok turn over every role (control_cpu.py; `nan`: not measured). Then the best point of
    `throughput_optimized` (Ray Serve's throughput-optimized mode): its decisions/s, route p99 and
    CPU ms per turn, and its decisions/s over the `pin_cache` point's at the same size and
    concurrency (`nan` where either did not run). Then the directory's ceiling (directory_ceiling)
    at that point, the best point of `sharded_directory` (the same mode, 2 shards) with its
    ceiling, and the ratio of the sharded ceiling to the unsharded one at the same size and
    concurrency (2.0 if sharding split the directory's work with no cost; less where the shards'
    duplicated report handling costs). Then the best point of `sharded_relay` (2 shards, each
    replica reporting to its home shard, which relays) with its ceiling, and that ceiling over
    `sharded_directory`'s at the same size and concurrency (> 1: relaying saved the shards work)."""
    best = best_point(points)
    off = counterpart(points, best, NO_PIN_CACHE.name) if best is not None else None
    if best is None:
        sat = "nan"
    else:
        same = sorted((p for p in points if p.variant == best.variant and p.replicas == best.replicas), key=lambda p: p.concurrency)
        knee = saturation_concurrency([p.concurrency for p in same], [p.decisions_per_s for p in same])
        sat = "none" if knee is None else str(knee)
    rss = "nan" if per_replica_rss_bytes is None else f"{per_replica_rss_bytes / MIB:.1f}"
    speedup = ratio(best.decisions_per_s, off.decisions_per_s) if best is not None and off is not None else None
    fast = best_point(points, THROUGHPUT_OPTIMIZED.name)
    base = counterpart(points, fast, PIN_CACHE.name) if fast is not None else None
    fast_gain = ratio(fast.decisions_per_s, base.decisions_per_s) if fast is not None and base is not None else None
    ceil_fast = directory_ceiling(fast, THROUGHPUT_OPTIMIZED)
    sharded = best_point(points, SHARDED_DIRECTORY.name)
    ceil_sharded = directory_ceiling(sharded, SHARDED_DIRECTORY)
    same = counterpart(points, sharded, THROUGHPUT_OPTIMIZED.name) if sharded is not None else None
    ceil_same = directory_ceiling(same, THROUGHPUT_OPTIMIZED)
    ceil_gain = ratio(ceil_sharded, ceil_same) if ceil_sharded is not None and ceil_same is not None else None
    relayed = best_point(points, SHARDED_RELAY.name)
    ceil_relayed = directory_ceiling(relayed, SHARDED_RELAY)
    direct = counterpart(points, relayed, SHARDED_DIRECTORY.name) if relayed is not None else None
    ceil_direct = directory_ceiling(direct, SHARDED_DIRECTORY)
    relay_gain = ratio(ceil_relayed, ceil_direct) if ceil_relayed is not None and ceil_direct is not None else None
    return (f"RESULT decisions_per_s_max={'nan' if best is None else f'{best.decisions_per_s:.1f}'} "
            f"route_p99_ms_at_max={_ms(best.route_p99_s if best else None)} "
            f"replicas_at_max={'nan' if best is None else best.replicas} "
            f"max_replicas_on_this_machine={'nan' if max_replicas_run is None else max_replicas_run} "
            f"per_replica_rss_mib={rss} saturated_at_concurrency={sat} "
            f"decisions_per_s_ratio_pin_cache={_num(speedup, 3)} "
            f"route_p50_ms_at_max={_ms(best.route_p50_s if best else None)} "
            f"route_p50_ms_no_pin_cache={_ms(off.route_p50_s if off else None)} "
            f"cpu_ms_per_turn_at_max={_num(best.cpu_ms_per_turn_total if best else None, 3)} "
            f"decisions_per_s_max_throughput_optimized={_num(fast.decisions_per_s if fast else None, 1)} "
            f"route_p99_ms_throughput_optimized={_ms(fast.route_p99_s if fast else None)} "
            f"cpu_ms_per_turn_throughput_optimized={_num(fast.cpu_ms_per_turn_total if fast else None, 3)} "
            f"decisions_per_s_ratio_throughput_optimized={_num(fast_gain, 3)} "
            f"directory_ceiling_throughput_optimized={_num(ceil_fast, 0)} "
            f"decisions_per_s_max_sharded_directory={_num(sharded.decisions_per_s if sharded else None, 1)} "
            f"directory_ceiling_sharded_directory={_num(ceil_sharded, 0)} "
            f"directory_ceiling_ratio_sharded={_num(ceil_gain, 3)} "
            f"decisions_per_s_max_sharded_relay={_num(relayed.decisions_per_s if relayed else None, 1)} "
            f"directory_ceiling_sharded_relay={_num(ceil_relayed, 0)} "
            f"directory_ceiling_ratio_relay={_num(relay_gain, 3)}")


MAX_FAILURE_SHARE = 0.01  # a size "holds" only if its turns failed at most this often


def size_served(points: Sequence[PointStats], replicas: int, max_failure_share: float = MAX_FAILURE_SHARE) -> bool:
    """Whether a fleet size really served: at least one point of it completed turns, and over all
    of its points no more than max_failure_share of the turns failed (a size that started but
    timed every turn out is not one this machine holds). `points`: one run's (one variant's)."""
    mine = [p for p in points if p.replicas == replicas]
    turns = sum(p.turns for p in mine)
    failures = sum(p.failures for p in mine)
    return turns > failures and failures <= max_failure_share * turns


def largest_served(sizes: Sequence[dict], variant: str | None = None) -> int | None:
    """The largest fleet size whose run served (its record's status "ran" and "served" true), of
    `variant` or of any variant; None when none did."""
    return max((s["replicas"] for s in sizes if s["status"] == "ran" and s.get("served") and variant in (None, s["variant"])),
               default=None)


def mem_available_bytes(meminfo: str) -> int:
    """MemAvailable from the text of /proc/meminfo (the kernel's estimate of memory that can be
    had without swapping)."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemAvailable in /proc/meminfo")


def live_decode_replicas(stats: dict[str, object]) -> int:
    """Decode replicas the directory sees live, from a /baton/stats body."""
    replicas = stats.get("replicas")
    if not isinstance(replicas, dict):
        return 0
    return sum(1 for r in replicas.values() if isinstance(r, dict) and r.get("pool") == "decode" and r.get("live"))
