"""`baton bench control [--quick]`: Baton's control plane at many replicas, on this machine.

The real application, as a user starts it: `ray start` + `serve run` (baton/bench/cluster.py)
of cluster_configs/local_simulated.yaml's args with N stand-in engine replicas (`engine.kind:
simulated`) on the colocated policy, so every request crosses the real HTTP proxy, ingress
(parse, template, tokenizer, admission, metrics), conversation directory (placement, pins,
SQLite ownership) and decode replica (runner, engine thread) — only the GPU is simulated, and
its time is scaled down (control_config.TIME_SCALE: a turn's ~11 ms of predicted H200 time
becomes ~0.1 ms), so what is measured is the control plane. Sizes (quick: 8, 32; full: 8, 32,
64, 128), smallest first.

Variants (control_config.VARIANTS): each size runs three times, a fresh cluster each time:
`no_pin_cache` (routing.pin_cache_sync_s = 0: every turn asks the conversation directory),
`pin_cache` (0.5 s, the default config: each ingress serves a pinned conversation's later turns
from its own cache and syncs with the directory every 0.5 s), both under Ray Serve's defaults, and
`throughput_optimized` (the pin cache at 0.5 s, the cluster started with
RAY_SERVE_THROUGHPUT_OPTIMIZED=1: Serve's handle calls over gRPC, user code and routing on the
replica's own event loop, buffered access logs, and direct ingress, the load sent to the ingress
replica's own HTTP port instead of the proxy's). Their order is reversed from one size to the
next (control_config.variant_order) so none always runs first. Every point and size record
carries its `variant`; a size record also its `serve_env` and `load_port`.

Memory: at the first run (the first size's first variant) the decode replicas' RSS (from /proc)
and the fall of MemAvailable give a per-replica cost and the rest of the cluster's
(control_stats.MemoryModel); a larger size runs only if its projection leaves >= 3 GiB free (checked before each of its runs), otherwise that run
is recorded as skipped; a run that fails to start ends the sweep (every later run: not_tried). The
JSON keeps each run's own RSS, the projected ceiling, and `max_replicas` (the largest size a run of
any variant served: what the machine held, what `baton bench scale --replicas-json` reads).

Load: at each size, a sweep of closed-loop concurrency (quick: 8, 32; full: 8, 32, 128), each
point a warm-up then a fixed window (quick 20 s, full 45 s) of multi-turn conversations
(control_load.py: a session id each, the history growing turn by turn, so first turns are new
placements and later ones pinned look-ups). The load generator runs in this process, on the same
2 cores as the cluster: its CPU share is reported per point, since at high rates it competes
with what it measures.

Per point (control_stats.py): routing decisions/s (= ok turns/s: each turn is one routing
decision, the directory's, or with the pin cache a pinned turn's from the ingress's own cache),
client latency p50/p99, the `route` hop p50/p99 from Server-Timing (the routing decision's
latency as the ingress sees it: a directory call, or a cache hit), ingress overhead p50 (total − replica − engine:
parse, route, to_replica, from_replica) and `outside` p50 (client TTFT − total: the HTTP proxy
and the client), every hop's p50, failures (a failed turn is +inf in every percentile, never
dropped). Per size: the saturation concurrency (decisions/s grow < 10 % at the next one).
Goal (the issue's): >= 2,000 decisions/s with route p99 <= 10 ms at the largest size that ran,
read from the `pin_cache` variant.

CPU per turn (control_cpu.py): over each point's measured window exactly (control_load's
on_window hook: the Ray processes are listed and read at the window's start, the same pids read
again once its last turn ended; the warm-up is not in it), the CPU seconds (utime + stime from
/proc) of each role — `proxy`, `ingress`, `directory`, `decode` (all replicas), `ray_other`
(raylet, GCS, controller, agents, …) and `client` (this process, its own clock over the same
window) — divided by the window's ok turns: `cpu_ms_per_turn` {role: ms} and
`cpu_ms_per_turn_total` on every point (zero ok turns: inf, or nan for no CPU either; a pid gone
by the window's end counts nothing and is reported as missing in points_extra).

Writes control.json and control.png (decisions/s and route p99 vs concurrency, a line per size and
variant), prints a table (a line of CPU ms per turn by role under each point) and ends with
`RESULT decisions_per_s_max=… route_p99_ms_at_max=… replicas_at_max=… max_replicas_on_this_machine=…
per_replica_rss_mib=… saturated_at_concurrency=… decisions_per_s_ratio_pin_cache=… route_p50_ms_at_max=…
route_p50_ms_no_pin_cache=… cpu_ms_per_turn_at_max=… decisions_per_s_max_throughput_optimized=…
route_p99_ms_throughput_optimized=… cpu_ms_per_turn_throughput_optimized=…
decisions_per_s_ratio_throughput_optimized=…`, the first ten from the best `pin_cache` point
(saturated_at_concurrency: where its size saturates, `none` when it still grew at the sweep's end;
the ratio: its decisions/s over `no_pin_cache`'s at the same size and concurrency, `nan` when that
point is missing; route_p50_ms_no_pin_cache: that point's route p50; cpu_ms_per_turn_at_max: the
best point's cpu_ms_per_turn_total), the last four from the best `throughput_optimized` point (the
ratio: its decisions/s over `pin_cache`'s at the same size and concurrency). See
control_stats.result_line.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from baton.bench.control_config import (
    MAX_TOKENS,
    PIN_CACHE,
    SLOT,
    THROUGHPUT_OPTIMIZED,
    TIME_SCALE,
    VARIANTS,
    Sweep,
    Variant,
    app_args,
    pick_variants,
    served_model,
    start_timeout_s,
    sweep,
    variant_order,
)
from baton.bench.control_cpu import CpuPerTurn, ProcReading, compact, cpu_per_turn, is_ray_process, read_again, read_snapshot
from baton.bench.control_load import LoadSpec, PointLoad, WindowEdge, run_point, warm_replicas
from baton.bench.control_stats import (
    GIB,
    MIB,
    MemoryModel,
    PointStats,
    best_point,
    fits,
    goal_verdict,
    largest_served,
    live_decode_replicas,
    mem_available_bytes,
    memory_model,
    projected_ceiling,
    projected_free_bytes,
    result_line,
    saturation_concurrency,
    size_served,
    summarize_point,
)

HTTP_PORT, RAY_PORT = 28800, 26800


def _available() -> int:
    return mem_available_bytes(Path("/proc/meminfo").read_text())


def _wait_all_live(url: str, replicas: int, timeout_s: float) -> float:
    """Seconds until the directory sees all `replicas` decode replicas live (/health is ok at
    the first one). Raises RuntimeError naming how many were live at the timeout."""
    t0, live = time.monotonic(), 0
    while time.monotonic() - t0 < timeout_s:
        try:
            live = live_decode_replicas(httpx.get(f"{url}/baton/stats", timeout=10).json())
        except (httpx.HTTPError, ValueError):
            live = 0
        if live >= replicas:
            return time.monotonic() - t0
        time.sleep(1)
    raise RuntimeError(f"only {live} of {replicas} decode replicas live after {timeout_s:.0f}s")


IDLE_SAMPLE_S = 10.0


def _ray_pids() -> list[int]:
    """Every process of the local Ray cluster (raylet, GCS, workers, Serve's controller and
    proxies, the `serve run` driver: control_cpu.is_ray_process)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if is_ray_process(cmd):
            out.append(int(pid))
    return out


class _WindowCpu:
    """control_load's on_window hook: the Ray processes (by role) read at the window's start, and
    the same pids again at its end."""

    def __init__(self) -> None:
        self.start: dict[int, ProcReading] = {}
        self.end: dict[int, ProcReading] = {}

    def __call__(self, edge: WindowEdge) -> None:
        if edge == "start":
            self.start = read_snapshot()
        else:
            self.end = read_again(self.start)


def _idle_cpu_share(seconds: float) -> dict[str, float]:
    """Cores used while no request is in flight: by the decode replicas (each and together) and by
    every Ray process (what a fleet of this size costs before it serves anything)."""
    from baton.bench.cluster import process_cpu_seconds, replica_pids

    decode, every = replica_pids("decode"), _ray_pids()
    d0, a0, t0 = process_cpu_seconds(decode), process_cpu_seconds(every), time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    d, a = (process_cpu_seconds(decode) - d0) / dt, (process_cpu_seconds(every) - a0) / dt
    return {"seconds": dt, "decode_total": d, "per_replica": d / max(1, len(decode)), "all_ray": a, "decode_processes": len(decode)}


def _ms(x: float | None) -> str:
    return "-" if x is None else ("inf" if x == math.inf else f"{x * 1000:.2f}")


def _row(p: PointStats, cpu_share: float) -> str:
    return (f"{p.replicas:>5} {p.variant:>12} {p.concurrency:>5} {p.turns:>7} {p.failures:>5} {p.decisions_per_s:>9.1f} "
            f"{_ms(p.latency_p50_s):>9} {_ms(p.latency_p99_s):>9} {_ms(p.route_p50_s):>9} {_ms(p.route_p99_s):>9} "
            f"{_ms(p.ingress_overhead_p50_s):>9} {_ms(p.outside_p50_s):>9} {cpu_share * 100:>8.0f}%")


HEADER = (f"{'N':>5} {'variant':>12} {'C':>5} {'turns':>7} {'fail':>5} {'dec/s':>9} {'lat50ms':>9} {'lat99ms':>9} {'route50':>9} "
          f"{'route99':>9} {'ingr50':>9} {'outs50':>9} {'clientCPU':>9}")


def _measured(n: int, c: int, variant: Variant, load: PointLoad, window: _WindowCpu) -> tuple[PointStats, CpuPerTurn]:
    """One point's figures, its CPU by role over the measured window per ok turn included."""
    point = summarize_point(n, c, load.turns, load.elapsed_s, variant=variant.name)
    cpu = cpu_per_turn(window.start, window.end, load.window_client_cpu_s, point.turns - point.failures)
    return replace(point, cpu_ms_per_turn=cpu.ms_per_turn, cpu_ms_per_turn_total=cpu.total_ms_per_turn), cpu


def _cpu_line(cpu: CpuPerTurn) -> str:
    gone = f" ({cpu.missing} processes gone by the window's end, not counted)" if cpu.missing else ""
    return f"{'':>5} cpu ms/turn: {compact(cpu.ms_per_turn, cpu.total_ms_per_turn)}{gone}"


def _run_size(n: int, variant: Variant, sw: Sweep, out_dir: Path,
              available_idle: int) -> tuple[dict[str, Any], list[PointStats], MemoryModel]:
    """One fleet size in one variant: start it, wait for every replica, measure memory, run the
    concurrency sweep (each point's CPU by role read over its measured window)."""
    from baton.bench.cluster import LocalServeApp, replica_rss_bytes

    args = app_args(n, Path(tempfile.mkdtemp(prefix="baton-control-")), max_concurrency=max(sw.concurrencies),
                    pin_cache_sync_s=variant.pin_cache_sync_s, directory_shards=variant.directory_shards,
                    report_relay_period_s=variant.report_relay_period_s)
    app = LocalServeApp(args, resources={SLOT: n}, num_cpus=2, http_port=HTTP_PORT, ray_port=RAY_PORT,
                        log_dir=out_dir / f"serve-{n}-{variant.name}", start_timeout_s=start_timeout_s(n), env=variant.env(HTTP_PORT))
    points: list[PointStats] = []
    extras: list[dict[str, Any]] = []
    with app as running:
        live_s = _wait_all_live(running.url, n, timeout_s=start_timeout_s(n))
        idle_cpu = _idle_cpu_share(IDLE_SAMPLE_S)
        print(f"[control] idle for {IDLE_SAMPLE_S:.0f}s: decode replicas used {idle_cpu['per_replica'] * 100:.1f}% of a core each, "
              f"{idle_cpu['decode_total']:.2f} cores together; the whole cluster {idle_cpu['all_ray']:.2f} cores")
        print(f"[control] {n} replicas live, {variant.name} (pin_cache_sync_s {variant.pin_cache_sync_s}): "
              f"{running.start_seconds:.0f}s to /health, +{live_s:.0f}s to all live")
        load_url = f"http://127.0.0.1:{variant.load_port(HTTP_PORT)}"  # the proxy, or the ingress replica's own port
        warm = asyncio.run(warm_replicas(load_url, served_model(args), n))
        print(f"[control] warm-up: {warm['conversations']} first turns in {warm['seconds']:.0f}s ({warm['failed']} failed), "
              f"decisions spread over {warm['replicas_used']} of {n} replicas")
        print(HEADER)
        for c in sw.concurrencies:
            spec = LoadSpec(model=served_model(args), concurrency=c, duration_s=sw.duration_s, warmup_s=sw.warmup_s, max_tokens=MAX_TOKENS)
            window = _WindowCpu()
            load = asyncio.run(run_point(load_url, spec, tag=f"n{n}-{variant.name}-c{c}", on_window=window))
            point, cpu = _measured(n, c, variant, load, window)
            cpu_share = load.client_cpu_s / (sw.warmup_s + load.elapsed_s)
            print(_row(point, cpu_share), flush=True)
            print(_cpu_line(cpu), flush=True)
            points.append(point)
            extras.append({"replicas": n, "variant": variant.name, "concurrency": c, "warmup_turns": load.warmup_turns,
                           "warmup_failures": load.warmup_failures, "client_cpu_share": cpu_share,
                           "cpu_s": cpu.cpu_s, "cpu_processes": cpu.processes, "cpu_processes_missing": cpu.missing})
        # memory after the load: a stand-in engine's first steps load what it needs (its RSS at
        # start-up undercounts); the projection for larger sizes uses this
        rss = replica_rss_bytes("decode")
        others = {d: sum(replica_rss_bytes(d)) for d in ("ingress", "directory")}
        model = memory_model(rss, available_idle, _available())
        print(f"[control] after the load: decode RSS {model.per_replica_bytes / MIB:.0f} MiB each ({len(rss)} processes), "
              f"rest of the cluster {model.base_bytes / GIB:.2f} GiB")
        try:
            stats = httpx.get(f"{running.url}/baton/stats", timeout=10).json()
        except (httpx.HTTPError, ValueError) as e:
            stats = {"error": type(e).__name__}
    knee = saturation_concurrency([p.concurrency for p in points], [p.decisions_per_s for p in points])
    print(f"[control] {n} replicas, {variant.name}: saturated at concurrency {knee if knee is not None else 'none (still growing)'}")
    record = {
        "replicas": n, "variant": variant.name, "pin_cache_sync_s": variant.pin_cache_sync_s, "directory_shards": variant.directory_shards,
        "report_relay_period_s": variant.report_relay_period_s,
        "serve_env": variant.env(HTTP_PORT),
        "load_port": variant.load_port(HTTP_PORT), "status": "ran",
        "start_s": running.start_seconds, "all_live_s": live_s,
        "decode_rss_bytes": rss, "ingress_rss_bytes": others["ingress"], "directory_rss_bytes": others["directory"],
        "memory_model": asdict(model), "saturated_at_concurrency": knee, "points_extra": extras, "idle_cpu": idle_cpu, "warm_up": warm,
        "directory": {k: stats.get(k) for k in ("policy", "live_pins", "conversations_total", "turns_total", "totals")},
        "live_decode_replicas_at_end": live_decode_replicas(stats), "ingress": stats.get("ingress"),
    }
    return record, points, model


def _jsonable(x: Any) -> Any:
    """inf and nan as the strings "inf" and "nan" (JSON has neither)."""
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _runs(replicas: tuple[int, ...], variants: tuple[Variant, ...] = VARIANTS) -> list[tuple[int, Variant]]:
    """Every (size, variant) run in order: sizes smallest first, the variants of each in
    control_config.variant_order (alternating from one size to the next)."""
    return [(n, v) for i, n in enumerate(replicas) for v in variant_order(i, variants)]


def run(quick: bool, out_dir: Path, variants: str | None = None) -> dict[str, Any]:
    """variants: the names to run, comma-separated (`--variants`; default every one)."""
    from baton.bench.control_plot import plot

    chosen = pick_variants(variants)
    sw = sweep(quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[control] sizes {sw.replicas}, concurrency {sw.concurrencies}, {sw.duration_s:.0f}s per point after {sw.warmup_s:.0f}s "
          f"warm-up; simulated time_scale {TIME_SCALE}, max_tokens {MAX_TOKENS}, policy colocated; variants "
          + ", ".join(f"{v.name} (pin_cache_sync_s {v.pin_cache_sync_s}, directory shards {v.directory_shards})" for v in chosen))
    sizes: list[dict[str, Any]] = []
    points: list[PointStats] = []
    model: MemoryModel | None = None
    idle_first: int | None = None
    runs = _runs(sw.replicas, chosen)
    for i, (n, variant) in enumerate(runs):
        available = _available()
        tag = {"replicas": n, "variant": variant.name}
        if model is not None and not fits(model, n, available):
            free = projected_free_bytes(model, n, available)
            print(f"[control] {n} replicas, {variant.name} skipped: projected to leave {free / GIB:.1f} GiB of "
                  f"{available / GIB:.1f} GiB available (< 3 GiB)")
            sizes.append({**tag, "status": "skipped_memory", "projected_free_bytes": free, "available_bytes": available})
            continue
        try:
            record, got, size_model = _run_size(n, variant, sw, out_dir, available)
        except RuntimeError as e:  # did not start, or not every replica came up: later runs (as large or larger) will not either
            print(f"[control] {n} replicas, {variant.name} failed: {e}")
            sizes.append({**tag, "status": "failed", "error": str(e), "available_bytes": available})
            sizes.extend({"replicas": m, "variant": v.name, "status": "not_tried"} for m, v in runs[i + 1:])
            break
        sizes.append({**record, **tag, "served": size_served(got, n), "available_bytes": available})
        points.extend(got)
        if model is None:
            model, idle_first = size_model, available
    max_run = largest_served(sizes)
    ceiling = projected_ceiling(model, idle_first) if model is not None and idle_first is not None else None
    at = largest_served(sizes, PIN_CACHE.name)  # each variant's goal at the largest size it served
    goal = goal_verdict(points, at) if at is not None else None
    at = largest_served(sizes, THROUGHPUT_OPTIMIZED.name)
    fast = goal_verdict(points, at, variant=THROUGHPUT_OPTIMIZED.name) if at is not None else None
    best = best_point(points)
    line = result_line(points, max_run, model.per_replica_bytes if model else None)
    report = {
        "quick": quick, "sweep": asdict(sw), "time_scale": TIME_SCALE, "max_tokens": MAX_TOKENS, "policy": "colocated",
        "variants": [asdict(v) for v in chosen], "headline_variant": PIN_CACHE.name,
        "sizes": sizes, "points": [asdict(p) for p in points], "best": asdict(best) if best else None,
        "max_replicas": max_run, "projected_max_replicas": ceiling,
        "per_replica_rss_bytes": model.per_replica_bytes if model else None, "goal": asdict(goal) if goal else None,
        "goal_throughput_optimized": asdict(fast) if fast else None, "result": line,
    }
    (out_dir / "control.json").write_text(json.dumps(_jsonable(report), indent=2))
    if points:
        plot(points, out_dir / "control.png")
    print(f"[control] largest size a run served: {max_run}; "
          f"projected ceiling from per-replica RSS (3 GiB left free): {ceiling}")
    if goal is not None:
        print(f"[control] goal at {goal.replicas} replicas, {PIN_CACHE.name} (>= 2000 decisions/s, route p99 <= 10 ms): "
              f"{'met' if goal.met else 'not met'} — best within the route bound {goal.decisions_per_s:.1f}/s at concurrency {goal.concurrency}")
    if fast is not None:
        print(f"[control] goal at {fast.replicas} replicas under {THROUGHPUT_OPTIMIZED.name}: {'met' if fast.met else 'not met'} — best within the route bound "
              f"{fast.decisions_per_s:.1f}/s at concurrency {fast.concurrency}")
    print(f"[control] wrote {out_dir / 'control.json'}" + (f" and {out_dir / 'control.png'}" if points else ""))
    print(line)
    return report
