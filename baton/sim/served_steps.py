"""The calibration's CPU step-time model fitted on the steps of the served engines themselves: the
step traces `bench conserve` writes (engine.step_trace_dir, baton/engine/step_trace.py) under
<run>/steps/r<rep>-<policy>/<role>-<pid>.jsonl.

Why not only cpu_steps.py: that times an engine with its core to itself, while in `bench conserve`
the engines share the two cores with Serve's proxy, the ingress, the directory, Ray and the load
generator; the served steps carry that contention as it was.

A step's cost here is its time in engine.step() plus the runner loop's gap before it when that gap
is under GAP_MAX_S (streaming the previous step's outputs, applying queued requests: work the
engine thread does between steps while it has requests); a longer gap is the engine waiting idle
and is not cost.

Fit (least squares, every coefficient kept >= 0 by dropping the most negative one and refitting):
    a step with prefill chunks:   p0 + Σ_chunks (p1·n + p2·n·(c + n/2)) + Σ_decodes (d1 + d2·c)
    a decode-only step:           d0 + Σ_decodes (d1 + d2·c)
the same form as calibrate.CpuStepModel.step_time (n new tokens after c in KV; c a decode's context),
times the host's slowdown 1 + κ·m (contention.py), m the other engines of the same served app (the
traces of one r<rep>-<policy> directory) in a step when this one started. κ and the coefficients are
fitted by alternating least squares: the coefficients on the times divided by (1 + κ·m), then κ on
what the base leaves over, until κ settles.

Held out: the steps inside the time windows of the load levels being scored ("clock" of each level
in conserve.json) are left out of the fit and only used to check it. Two errors, each over a set of
steps: the bias |Σ predicted − Σ observed| / Σ observed (`held_out_error`; on the fitted steps it is
0 by construction — least squares with an intercept per step kind — so it is not reported for them)
and the per-step error Σ |predicted − observed| / Σ observed (`fit_step_error`,
`held_out_step_error`: how well single steps are timed, what the simulator's queueing sees).
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from baton.engine.simulated.timing import PrefillChunk, StepBatch
from baton.sim.calibrate import CpuStepModel
from baton.sim.contention import slowdown
from baton.sim.cpu_steps import SMOLLM2_KV_BYTES_PER_TOKEN

GAP_MAX_S = 0.05  # a gap longer than this between two steps is idle waiting, not loop work
KAPPA_ROUNDS = 50  # alternating rounds at most; κ settles to 1e-9 within ~20 on conserve's traces
ENGINE_KEYS = ("block_size", "kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens")


@dataclass(frozen=True)
class Step:
    t: float  # wall clock at the step's start
    seconds: float  # engine.step() + the loop's gap before it (when under GAP_MAX_S)
    prefills: tuple[tuple[int, int], ...]  # (new tokens, context before)
    decodes: tuple[int, ...]  # contexts
    neighbours: int = 0  # other engines of the same app in a step when this one started


@dataclass(frozen=True)
class ServedSteps:
    steps: tuple[Step, ...]
    engine: dict[str, Any]  # the engine shape calibrate.cpu_pools takes
    files: int


def read_trace(path: Path) -> tuple[dict[str, Any], list[Step]]:
    """(header, steps) of one trace file. A file without its header line: ValueError."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines or "engine" not in json.loads(lines[0]):
        raise ValueError(f"{path} is not a step trace (its first line must be the engine header)")
    header = json.loads(lines[0])["engine"]
    steps = []
    for ln in lines[1:]:
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            continue  # a line cut short when the engine process was killed
        gap = row.get("g")
        cost = float(row["s"]) + (float(gap) if gap is not None and 0 <= gap <= GAP_MAX_S else 0.0)
        steps.append(Step(float(row["t"]), cost, tuple((int(n), int(c)) for n, c in row["p"]), tuple(int(c) for c in row["d"])))
    return header, steps


def load_served_steps(run_dir: Path) -> ServedSteps:
    """Every step trace under <run_dir>/steps. None there, or engines of different shapes: ValueError."""
    files = sorted((run_dir / "steps").glob("r*-*/*.jsonl"))
    if not files:
        raise ValueError(f"no step traces under {run_dir / 'steps'} (a `bench conserve` run writes them since engine.step_trace_dir)")
    steps: list[Step] = []
    shapes = set()
    for app in sorted({f.parent for f in files}):  # one served app: its engines shared the machine
        traces = []
        for f in sorted(app.glob("*.jsonl")):
            header, got = read_trace(f)
            shapes.add(tuple(header.get(k) for k in ENGINE_KEYS))
            traces.append(got)
        steps += with_neighbours(traces)
    if len(shapes) != 1 or None in next(iter(shapes)):
        raise ValueError(f"the traced engines under {run_dir} differ in shape or do not say it: {sorted(map(str, shapes))}")
    engine = dict(zip(ENGINE_KEYS, next(iter(shapes)), strict=True))
    engine.update(bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN, max_model_len=8192)
    return ServedSteps(tuple(sorted(steps, key=lambda s: s.t)), engine, len(files))


def with_neighbours(traces: Sequence[Sequence[Step]]) -> list[Step]:
    """Every step of the engines of one app (one time-ordered list per engine), each with the number
    of the other engines in a step when it started. A step is taken to end at its start + its cost,
    which includes the loop's short gap before it (p50 0.2 ms in conserve's traces)."""
    starts = [[s.t for s in tr] for tr in traces]
    out = []
    for k, trace in enumerate(traces):
        for s in trace:
            busy = 0
            for j, other in enumerate(traces):
                i = bisect.bisect_right(starts[j], s.t) - 1
                busy += j != k and i >= 0 and other[i].t + other[i].seconds > s.t
            out.append(replace(s, neighbours=busy))
    return out


def level_windows(conserve: dict[str, Any], rate: float) -> list[tuple[float, float]]:
    """The (began, ended) wall-clock windows of every repetition's level at `rate`."""
    return [
        (float(lv["clock"][0]), float(lv["clock"][1]))
        for rep in conserve.get("reps", ())
        for lv in rep["levels"]
        if float(lv["rate"]) == rate and "clock" in lv
    ]


def split(steps: Sequence[Step], windows: Sequence[tuple[float, float]]) -> tuple[list[Step], list[Step]]:
    """(outside every window, inside one)."""
    outside: list[Step] = []
    inside: list[Step] = []
    for s in steps:
        (inside if any(a <= s.t <= b for a, b in windows) else outside).append(s)
    return outside, inside


def features(s: Step) -> list[float]:
    """[has prefill, decode only, Σn, Σn(c + n/2), decodes, Σ decode contexts] — columns for p0 d0 p1 p2 d1 d2."""
    mixed = 1.0 if s.prefills else 0.0
    return [
        mixed,
        1.0 - mixed,
        float(sum(n for n, _ in s.prefills)),
        float(sum(n * (c + n / 2) for n, c in s.prefills)),
        float(len(s.decodes)),
        float(sum(s.decodes)),
    ]


def nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, drop the most negative column, solve again.
    A column with no data (all zero) gets 0."""
    active = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    coef = np.zeros(a.shape[1])
    while active:
        sol = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit(steps: Sequence[Step]) -> CpuStepModel:
    """The step model of the module docstring. Needs both kinds of step: ValueError otherwise."""
    if not any(s.prefills for s in steps) or not any(s.decodes and not s.prefills for s in steps):
        raise ValueError(f"the fit needs prefill and decode-only steps; got {len(steps)} steps")
    a = np.array([features(s) for s in steps])
    y = np.array([s.seconds for s in steps])
    m = np.array([float(s.neighbours) for s in steps])
    kappa = 0.0
    for _ in range(KAPPA_ROUNDS):
        coef = nonneg_lstsq(a * (1.0 + kappa * m)[:, None], y)
        lift = (a @ coef) * m  # what one unit of κ adds to each step
        new = max(0.0, float(np.dot(y - a @ coef, lift) / np.dot(lift, lift))) if np.any(lift) else 0.0
        settled = abs(new - kappa) < 1e-9
        kappa = new
        if settled:
            break
    coef = nonneg_lstsq(a * (1.0 + kappa * m)[:, None], y)
    p0, d0, p1, p2, d1, d2 = (float(x) for x in coef)
    return CpuStepModel((p0, p1, p2), (d0, d1, d2), kappa)


def predict(model: CpuStepModel, s: Step) -> float:
    """The model's time for the step's batch and neighbours: the simulator's own step_time and slowdown."""
    base = model.step_time(StepBatch(tuple(PrefillChunk(n, c) for n, c in s.prefills), s.decodes)).seconds
    return base * slowdown(model.contention, s.neighbours)


def summed_error(model: CpuStepModel, steps: Sequence[Step]) -> float:
    """|Σ predicted − Σ observed| / Σ observed; nan without steps."""
    observed = sum(s.seconds for s in steps)
    return abs(sum(predict(model, s) for s in steps) - observed) / observed if observed > 0 else float("nan")


def step_error(model: CpuStepModel, steps: Sequence[Step]) -> float:
    """Σ |predicted − observed| / Σ observed, step by step; nan without steps."""
    observed = sum(s.seconds for s in steps)
    return sum(abs(predict(model, s) - s.seconds) for s in steps) / observed if observed > 0 else float("nan")


def describe(steps: Sequence[Step]) -> dict[str, Any]:
    decodes = [s for s in steps if not s.prefills]
    one = [s.seconds for s in decodes if len(s.decodes) == 1]
    return {
        "steps": len(steps),
        "with_neighbour_busy": sum(s.neighbours > 0 for s in steps),
        "with_prefill": len(steps) - len(decodes),
        "decode_only": len(decodes),
        "decode_batch_mean": statistics.fmean(len(s.decodes) for s in decodes) if decodes else None,
        "decode_batch1_p50_ms": statistics.median(one) * 1e3 if one else None,
    }


def served_step_model(run_dir: Path, held_out: Sequence[tuple[float, float]]) -> tuple[CpuStepModel, dict[str, Any], dict[str, Any]]:
    """(model fitted outside `held_out`, the engine shape, a report of the fit) for calibrate."""
    served = load_served_steps(run_dir)
    train, test = split(served.steps, held_out)
    model = fit(train)
    report = {
        "source": str(run_dir),
        "files": served.files,
        "fit_on": describe(train),
        "held_out": describe(test),
        "contention": model.contention,
        "fit_step_error": step_error(model, train),
        "held_out_error": summed_error(model, test) if test else None,
        "held_out_step_error": step_error(model, test) if test else None,
        "gap_max_s": GAP_MAX_S,
    }
    return model, served.engine, report
