"""ConServe benchmark: routing policies under open-loop agentic load, on equal hardware.

Method (README "Benchmarks" has the command and the figures):
- Trace: BFCL-derived agentic conversations (a user turn answered with tool calls, then the tool
  results whose reply the user sees: the effective turn, docs/TRACES.md), split into distinct
  conversations per load level, each level its own tenant (conserve_load.split_levels), so no
  level hits KV computed at another.
- Load: conversations arrive as a seeded Poisson process at each rate (conversations/s), from
  light to saturating; every turn after the arrival follows the trace (think times from it, or a
  fixed delay). Levels run in sequence, each drained before the next.
- Policies: conversation, per_turn_pd, conditional_pd, colocated. Equal hardware: the
  disaggregated layouts have the prefill engine on core 0 and the decode engine on core 1; colocated
  has two unified engines, one per core (`resources.cpu_cores`). The layout goes in the JSON.
- Repetitions: >= 3 per policy, interleaved (A B C D A B C D ...), each a fresh cluster
  (LocalServeApp) running every load level; the same arrival schedule for every policy of a
  repetition. Figures are the median of the per-repetition p95s, with their min/max.
- Figures per policy and level: TTFET of every effective turn p50/p95, ITL p50/p95 (per token: each
  streamed chunk's gap spread over the tokens it held, counted from the usage Baton adds to every
  chunk under stream_options.continuous_usage_stats; the per-chunk gaps beside them as
  chunk_gap_p50/p95), TTFT p50/p95 and by turn index, failed conversations (a failed turn fails its
  conversation; its effective turns count +inf, never dropped: conserve_stats), KV handoffs per
  conversation from the decode engines' connectors, prefill turns that fell back to the decoder.
- Step traces: every engine writes each step's time and batch shape under steps/r<rep>-<policy>/
  (engine.step_trace_dir); `bench scale --calibrate ... --served-steps <this run>` fits the fleet
  simulator's CPU step times on them (baton/sim/served_steps.py). Level windows are in "clock".
- Headline: at the highest level at which colocated meets the TTFT SLO (TTFT_SLO_P95_S), or the
  lowest level, flagged slo_met=0, when none does."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from baton.bench.conserve_load import estimate_level_s, interleaved, poisson_arrivals, run_open_loop, split_levels
from baton.bench.conserve_stats import Cell, LevelFigures, Spread, fmt, headline, level_figures, over_reps
from baton.paths import REPO_ROOT

ROOT = REPO_ROOT
POLICIES = ("conversation", "per_turn_pd", "conditional_pd", "colocated")
DISAGGREGATED = frozenset({"conversation", "per_turn_pd", "conditional_pd"})
TTFT_SLO_P95_S = 3.0  # the SLO colocated must meet at the headline level: p95 TTFT <= 3 s (SmolLM2-135M, one core per engine)
START_S, STOP_S, SETTLE_S, S_PER_TURN = 40.0, 15.0, 4.0, 1.5  # for the duration estimate (measured here: start 18-40 s)


@dataclass(frozen=True)
class Workload:
    reps: int
    rates: tuple[float, ...]  # conversations per second, light to saturating
    per_level: int  # conversations per load level (distinct at every level)
    user_turns: int
    max_system_chars: int
    max_tokens: int
    think_s: float | None = None  # None: the trace's think times; else this fixed delay before every later turn
    seed: int = 0


QUICK = Workload(reps=3, rates=(0.3, 1.2), per_level=8, user_turns=2, max_system_chars=9000, max_tokens=32)
FULL = Workload(reps=3, rates=(0.1, 0.25, 0.5, 1.0), per_level=16, user_turns=2, max_system_chars=13000, max_tokens=48)


def layout(policy: str) -> dict[str, Any]:
    """Equal hardware: two engines on two cores for every policy."""
    if policy in DISAGGREGATED:
        return {"prefill": {"engines": 1, "cpu_cores": [0]}, "decode": {"engines": 1, "cpu_cores": [1]}}
    return {"decode": {"engines": 2, "cpu_cores": [0, 1], "cpu_cores_per_replica": 1}}


def pool_args(policy: str, step_trace_dir: Path | None = None) -> dict[str, Any]:
    """The app's config for `policy`; step_trace_dir: where every engine writes its step trace."""
    engine: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "max_model_len": 8192, "kv_cache_gib": 1.0}
    if step_trace_dir is not None:
        engine["step_trace_dir"] = str(step_trace_dir)
    args: dict[str, Any] = {"ingress": {"served_model_name": "SmolLM2-135M-Instruct"},
                            "routing": {"policy": policy, "ownership_db_path": ":memory:"}}
    for pool, spec in layout(policy).items():
        resources = {"num_cpus": 0.5, "custom": {f"{pool}_slot": 1}, "cpu_cores": spec["cpu_cores"]}
        if "cpu_cores_per_replica" in spec:
            resources["cpu_cores_per_replica"] = spec["cpu_cores_per_replica"]
        args[pool] = {"num_replicas": spec["engines"], "resources": resources, "engine": engine}
    return args


def build_trace(w: Workload) -> list[Any]:
    from baton.traces.bfcl import BfclOptions, build_bfcl_trace

    return build_bfcl_trace(
        BfclOptions(n=w.per_level * len(w.rates), min_user_turns=w.user_turns, max_user_turns=w.user_turns, drop_response_schema=True,
                    max_system_chars=w.max_system_chars, max_tokens=w.max_tokens, seed=w.seed)
    )


def estimate_s(w: Workload, levels: list[list[Any]]) -> float:
    per_rep = START_S + STOP_S + sum(estimate_level_s(convs, rate, w.think_s, S_PER_TURN) + SETTLE_S
                                     for convs, rate in zip(levels, w.rates, strict=True))
    return per_rep * w.reps * len(POLICIES)


def _counters(url: str) -> dict[str, int]:
    snap = httpx.get(f"{url}/baton/stats", timeout=10).json()
    decoders = [r for r in snap["replicas"].values() if r["pool"] == "decode"]
    return {"transfers": sum(int(r.get("kv_transfers_received", 0)) for r in decoders),
            "bytes": sum(int(r.get("kv_bytes_received", 0)) for r in decoders),
            "planned_handoffs": int(snap.get("handoffs_planned_total", 0)),
            "prefill_fallback_local": int(snap.get("prefill_fallback_local_total", 0)),
            "placed_without_kv_room": int(snap.get("placed_without_kv_room_total", 0))}


def _settled(url: str) -> dict[str, int]:
    """The counters once two reads 1.5 s apart agree (the engines report every second)."""
    last: dict[str, int] = {}
    for _ in range(15):
        time.sleep(1.5)
        now = _counters(url)
        if now == last:
            break
        last = now
    return last


def run_rep(rep: int, policy: str, levels: list[list[Any]], w: Workload, out_dir: Path) -> tuple[list[Cell], dict[str, Any]]:
    """One fresh cluster for `policy`, every load level in sequence."""
    from baton.bench.cluster import LocalServeApp

    cells, rows = [], []
    with LocalServeApp(pool_args(policy, out_dir / "steps" / f"r{rep}-{policy}"), resources={"prefill_slot": 1, "decode_slot": 2},
                       log_dir=out_dir / f"serve-r{rep}-{policy}") as app:
        before = _settled(app.url)
        for k, (convs, rate) in enumerate(zip(levels, w.rates, strict=True)):
            arrivals = poisson_arrivals(len(convs), rate, seed=w.seed * 1000 + rep * 10 + k)  # the same for every policy
            began = time.time()
            runs, wall = asyncio.run(run_open_loop(convs, arrivals, app.url, think_s=w.think_s))
            ended = time.time()
            after = _settled(app.url)
            delta = {name: after[name] - before[name] for name in after}
            before = after
            figs = level_figures(runs, kv_transfers=delta["transfers"])
            cells.append(Cell(rep, policy, rate, figs))
            rows.append({"rate": rate, "wall_s": wall, "clock": [began, ended], "counters": delta, "figures": _figures_json(figs),
                         "conversations": [{"id": r.conversation_id, "failed": r.failed,
                                            "errors": [t.error for t in r.records if t.error]} for r in runs]})
            itl = f"ITL p95 {fmt(figs.itl_p95_s)}{'' if figs.itl_per_token else ' (per chunk)'}  chunk gap p95 {fmt(figs.chunk_gap_p95_s)}"
            print(f"[conserve] rep {rep} {policy:14s} {rate:g}/s  TTFET p95 {fmt(figs.ttfet_p95_s)}  {itl}  "
                  f"TTFT p95 {fmt(figs.ttft_p95_s)}  handoffs/conv {fmt(figs.handoffs_per_conversation, 2)}  "
                  f"failed {figs.failed_conversations}/{figs.conversations}  fallback {delta['prefill_fallback_local']}  wall {wall:.0f}s")
    return cells, {"rep": rep, "policy": policy, "start_s": app.start_seconds, "levels": rows}


def run(quick: bool, out_dir: Path, rates: tuple[float, ...] | None = None, ttft_slo_s: float | None = None) -> dict[str, Any]:
    """`rates`: load levels instead of the mode's (conversations/s, increasing); `ttft_slo_s`: the
    p95 TTFT colocated must meet at the headline level (default TTFT_SLO_P95_S)."""
    w = QUICK if quick else FULL
    if rates is not None:
        w = replace(w, rates=tuple(rates))
    slo = TTFT_SLO_P95_S if ttft_slo_s is None else ttft_slo_s
    levels = split_levels(build_trace(w), len(w.rates), w.per_level)
    order = interleaved(POLICIES, w.reps)
    requests = sum(len(c.turns) for convs in levels for c in convs)
    print(f"[conserve] {len(levels)} load levels {list(w.rates)} conv/s x {w.per_level} BFCL conversations ({requests} requests), "
          f"policies {list(POLICIES)} x {w.reps} reps interleaved; expected ~{estimate_s(w, levels) / 60:.0f} min")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cells: list[Cell] = []
    reps: list[dict[str, Any]] = []
    for rep, policy in order:
        got, row = run_rep(rep, policy, levels, w, out_dir)
        cells += got
        reps.append(row)
    summary = over_reps(cells)
    head = headline(summary, w.rates, slo)
    result = {
        "quick": quick, "workload": asdict(w), "layout": {p: layout(p) for p in POLICIES},
        "slo": {"policy": "colocated", "ttft_p95_s_at_most": slo, "met": head.slo_met, "rate": head.rate},
        "order": [f"r{rep}:{p}" for rep, p in order], "wall_s": time.monotonic() - t0,
        "summary": {p: {str(rate): {k: v.as_json() if isinstance(v, Spread) else v for k, v in row.items()} for rate, row in by.items()}
                    for p, by in summary.items()},
        "headline": asdict(head), "result_line": head.result_line(), "reps": reps,
    }
    (out_dir / "conserve.json").write_text(json.dumps(_clean(result), indent=1))
    from baton.bench.conserve_plot import plot

    plot(summary, cells, w.rates, slo, out_dir / "conserve.png")
    print(f"[conserve] wrote {out_dir / 'conserve.json'} and {out_dir / 'conserve.png'} in {result['wall_s'] / 60:.1f} min")
    if not head.slo_met:
        print(f"[conserve] colocated met the TTFT SLO (p95 <= {slo:g} s) at no load level: the headline is at the lowest")
    print(head.result_line())
    return result


def _figures_json(f: LevelFigures) -> dict[str, Any]:
    return _clean(asdict(f))


def _clean(x: Any) -> Any:
    """JSON has no infinity: +inf (a failure in a percentile, a ratio over one) is written "inf"."""
    if isinstance(x, float) and x == float("inf"):
        return "inf"
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x
