"""`baton bench control [--quick]`: Baton's control plane at many replicas, on this machine.

The real application, as a user starts it: `ray start` + `serve run` (baton/bench/cluster.py)
of cluster_configs/local_simulated.yaml's args with N stand-in engine replicas (`engine.kind:
simulated`) on the colocated policy, so every request crosses the real HTTP proxy, ingress
(parse, template, tokenizer, admission, metrics), conversation directory (placement, pins,
SQLite ownership) and decode replica (runner, engine thread) — only the GPU is simulated, and
its time is scaled down (control_config.TIME_SCALE: a turn's ~11 ms of predicted H200 time
becomes ~0.1 ms), so what is measured is the control plane. Sizes (quick: 8, 32; full: 8, 32,
64, 128), one fresh cluster each, smallest first.

Memory: at the first size the decode replicas' RSS (from /proc) and the fall of MemAvailable give
a per-replica cost and the rest of the cluster's (control_stats.MemoryModel); a larger size runs
only if its projection leaves >= 3 GiB free, otherwise it is recorded as skipped. The JSON keeps
each size's own RSS, the projected ceiling, and `max_replicas` (the largest size that ran, what
`baton bench scale --replicas-json` reads).

Load: at each size, a sweep of closed-loop concurrency (quick: 8, 32; full: 8, 32, 128), each
point a warm-up then a fixed window (quick 20 s, full 45 s) of multi-turn conversations
(control_load.py: a session id each, the history growing turn by turn, so first turns are new
placements and later ones pinned look-ups). The load generator runs in this process, on the same
2 cores as the cluster: its CPU share is reported per point, since at high rates it competes
with what it measures.

Per point (control_stats.py): routing decisions/s (= ok turns/s: each turn is one directory
decision), client latency p50/p99, the `route` hop p50/p99 from Server-Timing (the directory's
placement, its latency as the ingress sees it), ingress overhead p50 (total − replica − engine:
parse, route, to_replica, from_replica) and `outside` p50 (client TTFT − total: the HTTP proxy
and the client), every hop's p50, failures (a failed turn is +inf in every percentile, never
dropped). Per size: the saturation concurrency (decisions/s grow < 10 % at the next one).
Goal (the issue's): >= 2,000 decisions/s with route p99 <= 10 ms at the largest size that ran.

Writes control.json and control.png (decisions/s and route p99 vs concurrency per size), prints
a table and ends with `RESULT decisions_per_s_max=… route_p99_ms_at_max=… replicas_at_max=…
max_replicas_on_this_machine=… per_replica_rss_mib=… saturated_at_concurrency=…` (the
concurrency where the best point's size saturates; `none` when it still grew at the sweep's end).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from baton.bench.control_config import MAX_TOKENS, SLOT, TIME_SCALE, Sweep, app_args, served_model, start_timeout_s, sweep
from baton.bench.control_load import LoadSpec, run_point, warm_replicas
from baton.bench.control_stats import (
    GIB,
    MIB,
    MemoryModel,
    PointStats,
    best_point,
    fits,
    goal_verdict,
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
    """Every process of the local Ray cluster (raylet, GCS, workers, Serve's controller and proxies)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"ray::") or b"/ray/" in cmd.split(b"\0", 1)[0] or b"raylet" in cmd or b"gcs_server" in cmd:
            out.append(int(pid))
    return out


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
    return (f"{p.replicas:>5} {p.concurrency:>5} {p.turns:>7} {p.failures:>5} {p.decisions_per_s:>9.1f} {_ms(p.latency_p50_s):>9} "
            f"{_ms(p.latency_p99_s):>9} {_ms(p.route_p50_s):>9} {_ms(p.route_p99_s):>9} {_ms(p.ingress_overhead_p50_s):>9} "
            f"{_ms(p.outside_p50_s):>9} {cpu_share * 100:>7.0f}%")


HEADER = (f"{'N':>5} {'C':>5} {'turns':>7} {'fail':>5} {'dec/s':>9} {'lat50ms':>9} {'lat99ms':>9} {'route50':>9} {'route99':>9} "
          f"{'ingr50':>9} {'outs50':>9} {'clientCPU':>8}")


def _run_size(n: int, sw: Sweep, out_dir: Path, available_idle: int) -> tuple[dict[str, Any], list[PointStats], MemoryModel]:
    """One fleet size: start it, wait for every replica, measure memory, run the concurrency sweep."""
    from baton.bench.cluster import LocalServeApp, replica_rss_bytes

    args = app_args(n, Path(tempfile.mkdtemp(prefix="baton-control-")), max_concurrency=max(sw.concurrencies))
    app = LocalServeApp(args, resources={SLOT: n}, num_cpus=2, http_port=HTTP_PORT, ray_port=RAY_PORT,
                        log_dir=out_dir / f"serve-{n}", start_timeout_s=start_timeout_s(n))
    points: list[PointStats] = []
    extras: list[dict[str, Any]] = []
    with app as running:
        live_s = _wait_all_live(running.url, n, timeout_s=start_timeout_s(n))
        idle_cpu = _idle_cpu_share(IDLE_SAMPLE_S)
        print(f"[control] idle for {IDLE_SAMPLE_S:.0f}s: decode replicas used {idle_cpu['per_replica'] * 100:.1f}% of a core each, "
              f"{idle_cpu['decode_total']:.2f} cores together; the whole cluster {idle_cpu['all_ray']:.2f} cores")
        print(f"[control] {n} replicas live ({running.start_seconds:.0f}s to /health, +{live_s:.0f}s to all live)")
        warm = asyncio.run(warm_replicas(running.url, served_model(args), n))
        print(f"[control] warm-up: {warm['conversations']} first turns in {warm['seconds']:.0f}s ({warm['failed']} failed), "
              f"decisions spread over {warm['replicas_used']} of {n} replicas")
        print(HEADER)
        for c in sw.concurrencies:
            spec = LoadSpec(model=served_model(args), concurrency=c, duration_s=sw.duration_s, warmup_s=sw.warmup_s, max_tokens=MAX_TOKENS)
            load = asyncio.run(run_point(running.url, spec, tag=f"n{n}-c{c}"))
            point = summarize_point(n, c, load.turns, load.elapsed_s)
            cpu_share = load.client_cpu_s / (sw.warmup_s + load.elapsed_s)
            print(_row(point, cpu_share), flush=True)
            points.append(point)
            extras.append({"replicas": n, "concurrency": c, "warmup_turns": load.warmup_turns, "warmup_failures": load.warmup_failures,
                           "client_cpu_share": cpu_share})
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
    print(f"[control] {n} replicas: saturated at concurrency {knee if knee is not None else 'none (still growing)'}")
    record = {
        "replicas": n, "status": "ran", "start_s": running.start_seconds, "all_live_s": live_s,
        "decode_rss_bytes": rss, "ingress_rss_bytes": others["ingress"], "directory_rss_bytes": others["directory"],
        "memory_model": asdict(model), "saturated_at_concurrency": knee, "points_extra": extras, "idle_cpu": idle_cpu, "warm_up": warm,
        "directory": {k: stats.get(k) for k in ("policy", "live_pins", "conversations_total", "turns_total", "totals")},
        "live_decode_replicas_at_end": live_decode_replicas(stats), "ingress": stats.get("ingress"),
    }
    return record, points, model


def _jsonable(x: Any) -> Any:
    """inf as the string "inf" (JSON has no infinity)."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from baton.bench.control_plot import plot

    sw = sweep(quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[control] sizes {sw.replicas}, concurrency {sw.concurrencies}, {sw.duration_s:.0f}s per point after {sw.warmup_s:.0f}s "
          f"warm-up; simulated time_scale {TIME_SCALE}, max_tokens {MAX_TOKENS}, policy colocated")
    sizes: list[dict[str, Any]] = []
    points: list[PointStats] = []
    model: MemoryModel | None = None
    idle_first: int | None = None
    for i, n in enumerate(sw.replicas):
        available = _available()
        if model is not None and not fits(model, n, available):
            free = projected_free_bytes(model, n, available)
            print(f"[control] {n} replicas skipped: projected to leave {free / GIB:.1f} GiB of {available / GIB:.1f} GiB available (< 3 GiB)")
            sizes.append({"replicas": n, "status": "skipped_memory", "projected_free_bytes": free, "available_bytes": available})
            continue
        try:
            record, got, size_model = _run_size(n, sw, out_dir, available)
        except RuntimeError as e:  # did not start, or not every replica came up: larger sizes will not either
            print(f"[control] {n} replicas failed: {e}")
            sizes.append({"replicas": n, "status": "failed", "error": str(e), "available_bytes": available})
            sizes.extend({"replicas": m, "status": "not_tried"} for m in sw.replicas[i + 1:])
            break
        sizes.append({**record, "served": size_served(got, n), "available_bytes": available})
        points.extend(got)
        if model is None:
            model, idle_first = size_model, available
    ran = [s["replicas"] for s in sizes if s["status"] == "ran" and s.get("served")]
    max_run = max(ran) if ran else None
    ceiling = projected_ceiling(model, idle_first) if model is not None and idle_first is not None else None
    goal = goal_verdict(points, max_run) if max_run is not None else None
    best = best_point(points)
    line = result_line(points, max_run, model.per_replica_bytes if model else None)
    report = {
        "quick": quick, "sweep": asdict(sw), "time_scale": TIME_SCALE, "max_tokens": MAX_TOKENS, "policy": "colocated",
        "sizes": sizes, "points": [asdict(p) for p in points], "best": asdict(best) if best else None,
        "max_replicas": max_run, "projected_max_replicas": ceiling,
        "per_replica_rss_bytes": model.per_replica_bytes if model else None, "goal": asdict(goal) if goal else None, "result": line,
    }
    (out_dir / "control.json").write_text(json.dumps(_jsonable(report), indent=2))
    if points:
        plot(points, out_dir / "control.png")
    print(f"[control] largest size run: {max_run}; projected ceiling from per-replica RSS (3 GiB left free): {ceiling}")
    if goal is not None:
        print(f"[control] goal at {goal.replicas} replicas (>= 2000 decisions/s, route p99 <= 10 ms): "
              f"{'met' if goal.met else 'not met'} — best within the route bound {goal.decisions_per_s:.1f}/s at concurrency {goal.concurrency}")
    print(f"[control] wrote {out_dir / 'control.json'}" + (f" and {out_dir / 'control.png'}" if points else ""))
    print(line)
    return report
