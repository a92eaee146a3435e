"""Calibration: the same fleet simulator at the CPU scale of `bench conserve`, its engines timed by a
step-time model fitted on real vLLM CPU engines (cpu_steps.py measures them), compared with the
per-policy TTFET that `bench conserve` measured.

Step-time model, fitted by least squares on one of two sources: the grid an engine timed alone
measured (`--cpu-steps steps.json`), or the steps of conserve's own served engines from their step
traces (`--served-steps <conserve run dir>`, served_steps.py: contention with the serving stack
included, the scored level held out when it is the same run):
    prefill chunk of n new tokens after c in KV:  p0 + p1·n + p2·n·(c + n/2)   (linear work + attention)
    decode step of b sequences at mean context c: d0 + d1·b + d2·b·c
    a mixed step: the prefill part + the decode part without its d0 (one step's fixed cost, once)
    on a shared host, times (1 + κ·m) with m the other engines in a step (contention.py; κ from
    served steps only: the whole CPU fleet of conserve is one machine)
steps.json: {"prefill": [{"tokens", "context", "seconds"}...], "decode": [{"batch", "context",
"seconds"}...], "engine": {"max_num_batched_tokens", "max_num_seqs", "block_size",
"kv_capacity_tokens", "bytes_per_token"}} (cpu_steps.py writes exactly this).

The CPU fleet is conserve's layout (baton/bench/conserve.layout): disaggregated policies one
prefill and one decode engine, colocated two unified engines; the workload is conserve's own
(its JSON's "workload": the BFCL trace it built, the same Poisson arrival seeds, levels run one
after another, each with fresh engines: conserve salts each level's prefix cache). Replies are
max_tokens long (SmolLM2 may stop earlier: the simulator's TTFET is then an upper bound).

calibration_error = max over policies and over {p50, p95} of |sim − measured| / measured, at
conserve's headline load level (its JSON's "headline"."rate"); the same error at every other level
is reported beside it (`calibration_error_other_levels`: with served steps of the same run, those
levels' steps were fitted on). Beside the error: conversation's p95 TTFET over each other policy's,
measured and simulated (`ttfet_p95_ratios`), and simulated at 2× and 4× the headline load
(`ttfet_p95_ratios_projected`: the same conversations arriving faster on the same engines).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from baton.engine.simulated.timing import StepBatch, StepTime
from baton.sim import workloads
from baton.sim.engine import EngineShape
from baton.sim.fleet import Fleet, PoolSpec
from baton.sim.slo import run_figures

CPU_NIXL_GBPS = 3.0 * 8 * 1.0737  # NIXL/UCX DRAM loopback measured here: 2.4-4.5 GiB/s (DESIGN.md); 3 GiB/s
TEMPLATE_TOKENS = 5  # ChatML framing per message (<|im_start|>role\n ... <|im_end|>\n)
PROJECTED_LOAD_FACTORS = (2.0, 4.0)  # loads beyond conserve's headline the calibrated simulator is run at


@dataclass(frozen=True)
class CpuStepModel:
    prefill: tuple[float, float, float]  # p0, p1, p2
    decode: tuple[float, float, float]  # d0, d1, d2
    # κ: a step's slowdown per other engine of the same host in a step (contention.py); 0 for an
    # engine timed alone (cpu_steps), fitted on served steps (served_steps.py)
    contention: float = 0.0

    def step_time(self, batch: StepBatch) -> StepTime:
        if batch.empty:
            return StepTime(0.0, "idle")
        p0, p1, p2 = self.prefill
        d0, d1, d2 = self.decode
        dec = sum(d1 + d2 * c for c in batch.decode_contexts)
        if not batch.prefills:
            return StepTime(max(0.0, d0 + dec), "decode")
        pre = p0 + sum(p1 * ch.new_tokens + p2 * ch.new_tokens * (ch.context_before + ch.new_tokens / 2) for ch in batch.prefills)
        return StepTime(max(0.0, pre + dec), "mixed")


def fit_step_model(steps: dict[str, Any]) -> CpuStepModel:
    """Least-squares fit of the model in the module docstring to measured steps. A step time that
    is not a positive finite number is a broken measurement (re-run cpu_steps): ValueError."""
    bad = [s for s in (*steps["prefill"], *steps["decode"]) if not (math.isfinite(s["seconds"]) and s["seconds"] > 0)]
    if bad:
        raise ValueError(f"steps.json has step times that are not positive: {bad[:3]}; re-run baton.sim.cpu_steps")
    pre = steps["prefill"]
    a = np.array([[1.0, s["tokens"], s["tokens"] * (s["context"] + s["tokens"] / 2)] for s in pre])
    p = np.linalg.lstsq(a, np.array([s["seconds"] for s in pre]), rcond=None)[0]
    dec = steps["decode"]
    b = np.array([[1.0, s["batch"], s["batch"] * s["context"]] for s in dec])
    d = np.linalg.lstsq(b, np.array([s["seconds"] for s in dec]), rcond=None)[0]
    return CpuStepModel(tuple(float(x) for x in p), tuple(float(x) for x in d))  # type: ignore[arg-type]


def calibration_error(sim: dict[str, dict[str, float]], measured: dict[str, dict[str, float]]) -> float:
    """max over policies and figures of |sim − measured| / measured; nan when nothing compares.
    sim/measured: policy -> {"ttfet_p50_s": x, "ttfet_p95_s": y}."""
    errors = [
        abs(sim[p][k] - m) / m for p, figs in measured.items() if p in sim for k, m in figs.items() if k in sim[p] and m not in (None, 0) and m != float("inf")
    ]
    return max(errors) if errors else float("nan")


def measured_ttfets(conserve: dict[str, Any], rate: float | None = None) -> tuple[float, dict[str, dict[str, float]]]:
    """(rate, policy -> {ttfet_p50_s, ttfet_p95_s}) from conserve.json at `rate` (default: its headline rate)."""
    rate = float(conserve["headline"]["rate"]) if rate is None else float(rate)
    key = next(k for k in conserve["summary"][next(iter(conserve["summary"]))] if float(k) == rate)
    out: dict[str, dict[str, float]] = {}
    for policy, by_rate in conserve["summary"].items():
        row = by_rate.get(key, {})
        figs = {name: row[name]["median"] for name in ("ttfet_p50_s", "ttfet_p95_s") if name in row}
        out[policy] = {k: (float("inf") if v == "inf" else float(v)) for k, v in figs.items() if v is not None}
    return rate, out


def cpu_pools(policy: str, engine: dict[str, Any]) -> list[PoolSpec]:
    shape = EngineShape(
        gpu="cpu",
        kv_capacity_tokens=int(engine["kv_capacity_tokens"]),
        bytes_per_token=int(engine["bytes_per_token"]),
        link_gbps=CPU_NIXL_GBPS,
        inject_gbps=CPU_NIXL_GBPS,
        block_size=int(engine["block_size"]),
        max_num_seqs=int(engine["max_num_seqs"]),
        max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
        max_model_len=int(engine.get("max_model_len", 8192)),
    )
    if policy == "colocated":
        return [PoolSpec("decode", 2, shape)]
    return [PoolSpec("prefill", 1, shape), PoolSpec("decode", 1, shape)]


def to_sim(conv: Any, arrival_s: float, count: Callable[[str], int], max_model_len: int) -> workloads.Conversation:
    """A conserve trace conversation (baton/traces/format.Conversation) as token counts."""
    system = count(conv.system or "") + TEMPLATE_TOKENS
    turns = tuple(workloads.Turn(count(t.content) + TEMPLATE_TOKENS, t.max_tokens, t.think_time_s, t.effective) for t in conv.turns)
    return workloads.Conversation(conv.conversation_id, conv.user, arrival_s, f"sys:{hash(conv.system)}:{conv.user}", system, turns)


def simulate_conserve(
    conserve: dict[str, Any],
    model: CpuStepModel,
    engine: dict[str, Any],
    count: Callable[[str], int],
    trace: Sequence[Any],
    policies: Sequence[str],
    rate: float | None = None,
    arrival_rate: float | None = None,
) -> dict[str, dict[str, float]]:
    """policy -> {ttfet_p50_s, ttfet_p95_s}, medians over conserve's repetitions, at `rate` (default: the headline rate).
    arrival_rate: the conversations of that level arriving at another rate (a load conserve did not run)."""
    from baton.bench.conserve_load import poisson_arrivals, split_levels

    w = conserve["workload"]
    rates = [float(r) for r in w["rates"]]
    levels = split_levels(trace, len(rates), w["per_level"])
    rate = float(conserve["headline"]["rate"]) if rate is None else float(rate)
    k = rates.index(rate)
    arrival_rate = rate if arrival_rate is None else float(arrival_rate)
    out: dict[str, dict[str, float]] = {}
    for policy in policies:
        per_rep: dict[str, list[float]] = {"ttfet_p50_s": [], "ttfet_p95_s": []}
        for rep in range(w["reps"]):
            arrivals = poisson_arrivals(len(levels[k]), arrival_rate, seed=w["seed"] * 1000 + rep * 10 + k)
            convs = [to_sim(c, t, count, int(engine.get("max_model_len", 8192))) for c, t in zip(levels[k], arrivals, strict=True)]
            fleet = Fleet(cpu_pools(policy, engine), policy, lambda _gpu: model, host_contention=model.contention)  # type: ignore[arg-type]
            figs = run_figures(fleet.run(convs, until_s=arrivals[-1] + 600.0).runs)
            for name in per_rep:
                value = getattr(figs, name)
                if value is not None:
                    per_rep[name].append(value)
        out[policy] = {name: statistics.median(v) for name, v in per_rep.items() if v}
    return out


def ttfet_ratios(figs: dict[str, dict[str, float]], of: str = "conversation") -> dict[str, float]:
    """p95 TTFET of `of` over each other policy's (the ratios `bench conserve`'s RESULT reports)."""
    base = figs.get(of, {}).get("ttfet_p95_s")
    return {p: base / f["ttfet_p95_s"] for p, f in figs.items() if p != of and base and f.get("ttfet_p95_s")}


def token_counter() -> Callable[[str], int]:
    """SmolLM2's tokenizer from .cache/models when it loads; else ~4 characters per token."""
    try:
        from transformers import AutoTokenizer

        from baton.paths import REPO_ROOT

        tok = AutoTokenizer.from_pretrained(str(Path(REPO_ROOT) / ".cache" / "models" / "SmolLM2-135M-Instruct"))
        return lambda text: len(tok.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - any failure to load falls back to the character estimate
        return lambda text: max(1, len(text) // 4)


def run_calibration(conserve_json: Path, steps_json: Path | None = None, served_steps: Path | None = None) -> dict[str, Any]:
    """Calibrate against conserve_json with a step model from exactly one source: `steps_json`
    (cpu_steps.py, an engine timed alone) or `served_steps` (a `bench conserve` run dir with step
    traces, served_steps.py; when it is conserve_json's own run, the steps of the scored level are
    held out of the fit)."""
    from baton.bench.conserve import Workload, build_trace

    if (steps_json is None) == (served_steps is None):
        raise ValueError("calibrate with exactly one of steps_json (cpu_steps) or served_steps (a traced conserve run)")
    conserve = json.loads(conserve_json.read_text())
    rate, measured = measured_ttfets(conserve)
    if steps_json is not None:
        steps = json.loads(steps_json.read_text())
        model, engine, source = fit_step_model(steps), steps["engine"], {"kind": "cpu_steps", "source": str(steps_json)}
    else:
        from baton.sim.served_steps import level_windows, served_step_model

        same_run = served_steps.resolve() == conserve_json.parent.resolve()
        held = level_windows(conserve, rate) if same_run else []
        model, engine, report = served_step_model(served_steps, held)
        source = {"kind": "served_steps", "same_run_as_scored": same_run, **report}
    trace = build_trace(Workload(**{**conserve["workload"], "rates": tuple(conserve["workload"]["rates"])}))
    count = token_counter()
    sim = simulate_conserve(conserve, model, engine, count, trace, sorted(measured))
    by_rate = {}  # the other levels too; with served steps of the same run, their steps were fitted on
    for other in (float(r) for r in conserve["workload"]["rates"]):
        if other != rate:
            measured_there = measured_ttfets(conserve, other)[1]
            by_rate[other] = calibration_error(simulate_conserve(conserve, model, engine, count, trace, sorted(measured_there), rate=other), measured_there)
    # the calibrated simulator beyond the loads conserve ran: the headline level's conversations
    # arriving PROJECTED_LOAD_FACTORS times faster, on the same two engines
    projected = {
        f"{rate * f:g}": ttfet_ratios(simulate_conserve(conserve, model, engine, count, trace, sorted(measured), arrival_rate=rate * f))
        for f in PROJECTED_LOAD_FACTORS
    }
    return {
        "rate": rate,
        "measured": measured,
        "simulated": sim,
        "ttfet_p95_ratios": {"measured": ttfet_ratios(measured), "simulated": ttfet_ratios(sim)},
        "ttfet_p95_ratios_projected": projected,
        "step_model": {"prefill": model.prefill, "decode": model.decode, "contention": model.contention},
        "step_source": source,
        "calibration_error": calibration_error(sim, measured),
        "calibration_error_other_levels": by_rate,
    }
