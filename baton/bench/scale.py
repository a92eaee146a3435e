"""Fleet projection (issue 16): Baton's routing policies on simulated GPU fleets of 8 to 512 GPUs.

`baton bench scale [--quick] [--calibrate conserve.json (--cpu-steps steps.json | --served-steps <conserve run>)] [--replicas-json r.json]`

Method (README "Fleet projection" has the assumptions and their sources):
- engines: baton/sim/engine.py (baton/engine/simulated's vLLM-shaped scheduler in simulated time,
  steps timed by AIConfigurator's measured kernels for Llama-3.1-8B on H200 / L40S); hardware and
  links: baton/sim/hardware.py; routing: Baton's DirectoryState (plan_turn, scoring, choose_prefill)
  fed engine reports every second; real-time admission: Baton's AIMDController;
- workloads (baton/sim/workloads.py): agentic (BFCL-shaped), memory (LoCoMo-shaped), realtime
  (Metronome ticks), open-loop Poisson arrivals at a stated per-GPU rate × the fleet's GPUs;
- figures (baton/sim/slo.py, energy.py): goodput under the TTFT/TPOT SLOs (failures counted),
  p50/p95 TTFET of every effective turn, KV bytes moved by handoffs, energy per completed
  conversation;
- RESULT: calibration_error (calibrate.py; nan without calibration data), conversation vs
  per_turn_pd p95 TTFET on the agentic workload at 512 GPUs (homogeneous), energy per
  conversation of the heterogeneous fleet vs the homogeneous one (conversation policy, agentic,
  512 GPUs), max_replicas_on_this_machine (from --replicas-json's "max_replicas"; nan without it).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from baton.sim import hardware, workloads
from baton.sim.energy import IDLE_FRACTION, TDP_W, GpuUse, energy_per_conversation_j
from baton.sim.fleet import Fleet
from baton.sim.slo import TPOT_SLO_S, TTFT_SLO_S, run_figures

POLICIES = ("conversation", "per_turn_pd", "conditional_pd", "colocated")
PER_GPU_RATE = {"agentic": 1.0, "memory": 0.5, "realtime": 0.5}  # conversations (sessions) per second per GPU
DRAIN_S = 120.0  # after the last arrival; whatever is unfinished then has failed
SEED = 0


@dataclass(frozen=True)
class CellSpec:
    workload: workloads.WorkloadName
    gpus: int
    policy: str
    tiers: hardware.Tiers
    horizon_s: float  # arrivals over [0, horizon)


def plan(quick: bool) -> list[CellSpec]:
    """The cells a run simulates. Quick keeps CPU under ~3 min: short arrival horizons at the big
    fleets and, at 512 GPUs, only the cells the RESULT reads."""
    cells: list[CellSpec] = []
    if quick:
        for gpus, horizon in ((8, 30.0), (64, 5.0)):
            cells += [CellSpec("agentic", gpus, p, t, horizon) for p in POLICIES for t in hardware.TIERS]
        cells += [CellSpec("agentic", 512, p, t, 1.5) for p, t in (("conversation", "homo"), ("per_turn_pd", "homo"),
                                                                   ("conversation", "hetero"))]
        cells += [CellSpec(w, 8, p, "homo", 30.0) for w in ("memory", "realtime") for p in POLICIES]
        return cells
    for gpus in (8, 16, 32, 64, 128, 256, 512):
        cells += [CellSpec(w, gpus, p, t, 120.0) for w in workloads.WORKLOADS for p in POLICIES for t in hardware.TIERS]
    return cells


@cache
def _timer(gpu: str) -> Any:
    from baton.engine.simulated.timing import AicStepTimer

    return AicStepTimer(gpu, hardware.MODEL, 1)


def run_cell(c: CellSpec) -> dict[str, Any]:
    t0 = time.process_time()
    convs = workloads.build(c.workload, PER_GPU_RATE[c.workload] * c.gpus, c.horizon_s, c.gpus, SEED)
    fleet = Fleet(hardware.pools(c.gpus, c.tiers, c.policy != "colocated"), c.policy, _timer)  # type: ignore[arg-type]
    r = fleet.run(convs, until_s=c.horizon_s + DRAIN_S)
    figs = run_figures(r.runs)
    uses = [GpuUse(r.gpu_of[rid], busy) for rid, busy in r.busy_s.items()]
    return {**asdict(c), "figures": asdict(figs), "goodput_per_gpu_s": figs.good / c.horizon_s / c.gpus,
            "kv_bytes_moved": r.kv_bytes_pd, "kv_bytes_injected": r.kv_bytes_injected, "handoffs": r.handoffs,
            "energy_per_conversation_j": energy_per_conversation_j(uses, c.horizon_s, figs.completed),
            "utilization": sum(u.busy_s for u in uses) / (len(uses) * r.wall_s), "sim_s": r.wall_s,
            "directory": r.directory_totals, "cpu_s": time.process_time() - t0}


def _find(cells: list[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    return next((c for c in cells if all(c[k] == v for k, v in want.items())), None)


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or b == 0 or math.isinf(b) or math.isnan(a):
        return float("nan")
    return a / b


def result_line(cells: list[dict[str, Any]], calibration_error: float, max_replicas: int | None) -> str:
    biggest = max(c["gpus"] for c in cells)
    conv = _find(cells, workload="agentic", gpus=512, policy="conversation", tiers="homo")
    ptpd = _find(cells, workload="agentic", gpus=512, policy="per_turn_pd", tiers="homo")
    ttfet = _ratio(conv and conv["figures"]["ttfet_p95_s"], ptpd and ptpd["figures"]["ttfet_p95_s"])
    homo = _find(cells, workload="agentic", gpus=biggest, policy="conversation", tiers="homo")
    hetero = _find(cells, workload="agentic", gpus=biggest, policy="conversation", tiers="hetero")
    energy = _ratio(hetero and hetero["energy_per_conversation_j"], homo and homo["energy_per_conversation_j"])
    return (f"RESULT calibration_error={_fmt(calibration_error)} p95_ttfet_ratio_vs_per_turn_pd_at_512={_fmt(ttfet)} "
            f"energy_per_conversation_ratio_hetero_vs_homo={_fmt(energy)} "
            f"max_replicas_on_this_machine={max_replicas if max_replicas is not None else 'nan'}")


def _fmt(x: float | None) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.3f}"


def _ratios(r: dict[str, float]) -> str:
    return ", ".join(f"{p} {x:.3f}" for p, x in sorted(r.items()))


def run(quick: bool, out_dir: Path, calibrate: Path | None = None, cpu_steps: Path | None = None,
        served_steps: Path | None = None, replicas_json: Path | None = None) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    calibration: dict[str, Any] | None = None
    if calibrate is not None:  # first: a bad calibration input fails before the fleet runs
        from baton.sim.calibrate import run_calibration

        calibration = run_calibration(calibrate, steps_json=cpu_steps, served_steps=served_steps)
        print(f"[scale] calibration at {calibration['rate']:g} conv/s ({calibration['step_source']['kind']}): "
              f"measured {calibration['measured']} simulated {calibration['simulated']}", flush=True)
        print(f"[scale] calibration_error {calibration['calibration_error']:.3f}; at the other levels "
              f"{calibration['calibration_error_other_levels']}", flush=True)
        r = calibration["ttfet_p95_ratios"]
        print(f"[scale] conversation's p95 TTFET over each policy's: measured {_ratios(r['measured'])}; simulated {_ratios(r['simulated'])}; "
              + "; ".join(f"simulated at {k} conv/s {_ratios(v)}" for k, v in calibration["ttfet_p95_ratios_projected"].items()), flush=True)
        src = calibration["step_source"]
        if src["kind"] == "served_steps":
            print(f"[scale] served step model: fit on {src['fit_on']['steps']} steps (per-step error {src['fit_step_error']:.3f}, "
                  f"host slowdown per busy neighbour engine {src['contention']:.3f}), "
                  f"held out {src['held_out']['steps']} (bias {src['held_out_error']}, per-step {src['held_out_step_error']})", flush=True)
        error = float(calibration["calibration_error"])
    else:
        error = float("nan")
        print("[scale] no calibration data (--calibrate conserve.json --cpu-steps/--served-steps): calibration_error=nan")
    cells: list[dict[str, Any]] = []
    for spec in plan(quick):
        cell = run_cell(spec)
        cells.append(cell)
        f = cell["figures"]
        print(f"[scale] {spec.workload:8s} {spec.gpus:4d} GPUs {spec.policy:14s} {spec.tiers:6s} conv {f['conversations']:5d} "
              f"good {f['goodput_fraction']:.3f}  TTFET p95 {_fmt(f['ttfet_p95_s'])} s  KV moved {cell['kv_bytes_moved'] / 1e9:.1f} GB  "
              f"E/conv {cell['energy_per_conversation_j'] / 1e3:.2f} kJ  util {cell['utilization']:.2f}  cpu {cell['cpu_s']:.1f}s", flush=True)
    max_replicas = None
    if replicas_json is not None:
        max_replicas = int(json.loads(replicas_json.read_text())["max_replicas"])
    else:
        print("[scale] no control-plane measurement (--replicas-json): max_replicas_on_this_machine=nan")
    line = result_line(cells, error, max_replicas)
    result = {"quick": quick, "model": hardware.MODEL, "per_gpu_rate": PER_GPU_RATE, "drain_s": DRAIN_S, "seed": SEED,
              "slo": {"ttft_s": TTFT_SLO_S, "tpot_s": TPOT_SLO_S, "realtime": "tick reply within the tick period"},
              "energy": {"tdp_w": TDP_W, "idle_fraction": IDLE_FRACTION},
              "hardware": {"kv_gib": hardware.KV_GIB, "link_gbps": hardware.LINK_GBPS, "inject_gbps": hardware.INJECT_GBPS,
                           "block_size": hardware.BLOCK_SIZE, "prefill_fraction": hardware.PREFILL_FRACTION},
              "cells": cells, "calibration": calibration, "wall_s": time.monotonic() - t0, "result_line": line}
    (out_dir / "scale.json").write_text(json.dumps(_clean(result), indent=1))
    from baton.bench.scale_plot import plot

    plot(cells, out_dir / "scale.png")
    print(f"[scale] wrote {out_dir / 'scale.json'} and {out_dir / 'scale.png'} in {result['wall_s'] / 60:.1f} min")
    print(line)
    return result


def _clean(x: Any) -> Any:
    """JSON has no infinity or nan: they are written as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x
