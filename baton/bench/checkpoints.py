"""`baton bench checkpoints`: where to keep a hybrid model's recurrent-state checkpoints.

Two workloads (baton/bench/checkpoint_workloads.py): shared system prompts (BFCL tool docs + many user
questions) and long documents with many questions (LoCoMo). For each, a budget sweep of every
strategy (dp, none, block_dense, uniform = vLLM's retention interval, balanced, sqrt, dyadic):

  steady  recomputed tokens when each prefix family's plan is made from the whole stream's
          match-depth histogram and every planned state exists: Σ_requests (m − s(m)), exact —
          the planner's objective (baton/engine/checkpoints/simulate.steady_state);
  online  the enforced policy replayed request by request (baton/engine/checkpoints/simulate.simulate:
          plans re-solved as depths arrive, states stored only when a prefill passes a planned
          position, cold misses included) → recomputed tokens and states held;
  engine  a subset replayed on the real tiny-LFM2 engine (prefix caching off, then Baton's
          scheduler per strategy): TTFT, greedy tokens vs no-cache, hits vs the online replay,
          bytes per state.

Writes checkpoints.json + checkpoints_pareto.png under the out dir, prints a table, and ends with
RESULT dp_dominates_all_budgets=… exact_outputs=… budget_fraction_to_match_dense=…
(dominance and q on the steady figures; the online dominance is printed on the line before.)
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from baton.bench.checkpoint_engine import TINY_HYBRID, run_engine
from baton.bench.checkpoint_sim import block_keys, match_depths, simulate_keyed, steady_state
from baton.bench.checkpoint_workloads import long_documents, shared_prompts
from baton.engine.checkpoints.config import CheckpointConfig

B = 128  # tiny-LFM2's state block (mamba_block_size = block_size with prefix caching on CPU)
BASELINES = ["uniform", "balanced", "sqrt", "dyadic"]
LOCOMO = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "locomo"


def _cfg(strategy: str, budget: int) -> CheckpointConfig:
    return CheckpointConfig(strategy=strategy, budget=budget, half_life_s=1e6)


def sweep(prompts: list[list[int]], budgets: list[int]) -> dict[str, Any]:
    """Every strategy × budget, steady and online; q for DP against block-dense."""
    keyed = [(block_keys(p, B), len(p)) for p in prompts]
    stream = match_depths(B, keyed)
    rows = []
    for strategy in ["none", "block_dense"]:
        rec, planned = steady_state(_cfg(strategy, 0), B, stream)
        on = simulate_keyed(_cfg(strategy, 0), B, keyed)
        rows.append({"strategy": strategy, "budget": None, "steady_recomputed": rec, "planned": planned,
                     "online_recomputed": on.recomputed_tokens, "states_held": on.states_held})
    for strategy in ["dp", *BASELINES]:
        for m in budgets:
            rec, planned = steady_state(_cfg(strategy, m), B, stream)
            on = simulate_keyed(_cfg(strategy, m), B, keyed)
            rows.append({"strategy": strategy, "budget": m, "steady_recomputed": rec, "planned": planned,
                         "online_recomputed": on.recomputed_tokens, "states_held": on.states_held})
    dense = next(r for r in rows if r["strategy"] == "block_dense")
    q_budget, q_planned = None, None
    for m in range(1, 4096):  # smallest DP budget saving as much as block-dense (steady)
        rec, planned = steady_state(_cfg("dp", m), B, stream)
        if rec <= dense["steady_recomputed"]:
            q_budget, q_planned = m, planned
            break
    q_pure = None
    for m in range(1, 4096):  # the same without fill_spare: the DP's own positions only
        rec, planned = steady_state(CheckpointConfig(strategy="dp", budget=m, fill_spare=False), B, stream)
        if rec <= dense["steady_recomputed"]:
            q_pure = planned / dense["planned"] if dense["planned"] else None
            break
    by = {(r["strategy"], r["budget"]): r for r in rows}
    dom_steady = all(by[("dp", m)]["steady_recomputed"] <= by[(s, m)]["steady_recomputed"] for m in budgets for s in BASELINES)
    dom_online = all(by[("dp", m)]["online_recomputed"] <= by[(s, m)]["online_recomputed"] for m in budgets for s in BASELINES)
    none_ = by[("none", None)]
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "match_tokens": sum(m for _, m, _ in stream),
        "families": len({f for f, _, _ in stream if f is not None}),
        "rows": rows,
        "dp_dominates_steady": dom_steady and all(by[("dp", m)]["steady_recomputed"] <= none_["steady_recomputed"] for m in budgets),
        "dp_dominates_online": dom_online,
        "dp_budget_to_match_dense": q_budget,
        "dp_planned_to_match_dense": q_planned,
        "dense_planned": dense["planned"],
        "q": (q_planned / dense["planned"]) if q_planned is not None and dense["planned"] else None,
        "q_pure_dp": q_pure,
    }


def engine_phase(prompts: list[list[int]], budget: int, strategies: list[str], max_tokens: int) -> dict[str, Any]:
    """The real engine on a subset: TTFT, exactness vs no-cache, hits vs the online replay."""
    keyed = [(block_keys(p, B), len(p)) for p in prompts]
    ref = run_engine("nocache", prompts, max_tokens=max_tokens, max_model_len=8192)
    out: dict[str, Any] = {"budget": budget, "requests": len(prompts), "runs": {}}
    ttft_ref = [r["ttft_s"] for r in ref["rows"]]
    out["runs"]["nocache"] = {"ttft_mean_s": statistics.fmean(ttft_ref), "ttft_p50_s": statistics.median(ttft_ref)}
    exact, sim_ok = True, True
    for s in strategies:
        cfg = _cfg(s, budget)
        t0 = time.monotonic()
        res = run_engine("baton", prompts, ckpt=cfg.model_dump(), max_tokens=max_tokens, max_model_len=8192)
        same = [r["tokens"] for r in res["rows"]] == [r["tokens"] for r in ref["rows"]]
        sim = simulate_keyed(cfg, B, keyed)
        hits = [r["cached"] for r in res["rows"]]
        ttft = [r["ttft_s"] for r in res["rows"]]
        m = res["metrics"]
        out["runs"][s] = {
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": statistics.median(ttft),
            "exact_tokens": same, "hits_match_simulator": hits == [r.hit for r in sim.requests],
            "recomputed_tokens": m["recomputed_tokens"], "checkpoints_held": m["checkpoints_held"],
            "state_bytes": m["state_bytes"], "wall_s": round(time.monotonic() - t0, 1),
        }
        exact &= same
        sim_ok &= hits == [r.hit for r in sim.requests]
    held = [(r["state_bytes"], r["checkpoints_held"]) for r in out["runs"].values() if r.get("checkpoints_held")]
    out["bytes_per_state"] = held[0][0] // held[0][1] if held else None
    out["exact_outputs"] = exact
    out["engine_matches_simulator"] = sim_ok
    return out


def plot(results: dict[str, Any], path: Path, bytes_per_state: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 4.2 * len(names)), squeeze=False)
    mib = (bytes_per_state or 0) / 2**20
    for row, name in enumerate(names):
        rows = results[name]["rows"]
        for col, (xk, yk, xl) in enumerate([("planned", "steady_recomputed", "planned checkpoints (all families)"),
                                             ("states_held", "online_recomputed", "states held" + (f" (x {mib:.2f} MiB)" if mib else ""))]):
            ax = axes[row][col]
            for s in ["dp", *BASELINES]:
                pts = sorted((r[xk], r[yk]) for r in rows if r["strategy"] == s)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=s, lw=2 if s == "dp" else 1)
            for s, mk in [("none", "x"), ("block_dense", "s")]:
                r = next(r for r in rows if r["strategy"] == s)
                ax.scatter([r[xk]], [r[yk]], marker=mk, s=60, label=s, zorder=5)
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xlabel(xl)
            ax.set_ylabel("recomputed tokens")
            ax.set_title(f"{name}: {'steady (plan from the histogram)' if col == 0 else 'online (enforced policy replay)'}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(quick: bool, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    budgets = [1, 2, 4, 8, 16, 32] if quick else [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    workloads: dict[str, list[list[int]]] = {"shared_prompts": shared_prompts(TINY_HYBRID, 40 if quick else 200)}
    docs = long_documents(TINY_HYBRID, LOCOMO, 30 if quick else 200, 6 if quick else None)
    if docs is None:
        print(f"long_documents: skipped (no LoCoMo data under {LOCOMO})")
    else:
        workloads["long_documents"] = docs
    results = {name: sweep(prompts, budgets) for name, prompts in workloads.items()}
    print(f"sweeps done in {time.monotonic() - t0:.1f} s")

    eng_name = "long_documents" if "long_documents" in workloads else "shared_prompts"
    subset = [p for p in workloads[eng_name] if len(p) <= 8000][: 16 if quick else 48]
    strategies = ["none", "block_dense", "uniform", "dp"] if quick else ["none", "block_dense", "uniform", "balanced", "sqrt", "dyadic", "dp"]
    engine = engine_phase(subset, 4, strategies, max_tokens=4)
    engine["workload"] = eng_name
    bps = engine["bytes_per_state"]

    print(f"\n{'workload':<15} {'strategy':<12} {'M':>4} {'planned':>8} {'steady_recomp':>14} {'online_recomp':>14} {'states':>7} {'state_MiB':>10}")
    for name, res in results.items():
        for r in res["rows"]:
            mib = r["states_held"] * (bps or 0) / 2**20
            print(f"{name:<15} {r['strategy']:<12} {r['budget'] if r['budget'] is not None else '-':>4} {r['planned']:>8} "
                  f"{r['steady_recomputed']:>14} {r['online_recomputed']:>14} {r['states_held']:>7} {mib:>10.1f}")
        print(f"{name}: {res['requests']} requests, {res['families']} families, {res['prompt_tokens']} prompt tokens, "
              f"{res['match_tokens']} matched; DP matches block-dense at M={res['dp_budget_to_match_dense']} "
              f"({res['dp_planned_to_match_dense']} vs {res['dense_planned']} checkpoints, q={res['q']:.3f}; DP positions alone "
              f"without spare fill: q={res['q_pure_dp']:.3f})")
    print(f"\nengine ({eng_name}, {engine['requests']} requests, M={engine['budget']}, bytes/state={bps}):")
    print(f"{'strategy':<12} {'ttft_mean_ms':>13} {'ttft_p50_ms':>12} {'exact':>6} {'=sim':>5} {'recomp':>7} {'held':>5} {'state_MiB':>10}")
    for s, r in engine["runs"].items():
        print(f"{s:<12} {r['ttft_mean_s'] * 1e3:>13.1f} {r['ttft_p50_s'] * 1e3:>12.1f} {r.get('exact_tokens', '-')!s:>6} "
              f"{r.get('hits_match_simulator', '-')!s:>5} {r.get('recomputed_tokens', '-'):>7} {r.get('checkpoints_held', '-'):>5} "
              f"{r.get('state_bytes', 0) / 2**20:>10.1f}")

    dom = all(r["dp_dominates_steady"] for r in results.values())
    dom_online = all(r["dp_dominates_online"] for r in results.values())
    qs = [r["q"] for r in results.values()]
    q = max(qs) if qs and all(x is not None for x in qs) else None
    doc = {"quick": quick, "budgets": budgets, "block_size": B, "workloads": results, "engine": engine,
           "dp_dominates_all_budgets": dom, "dp_dominates_all_budgets_online": dom_online,
           "exact_outputs": engine["exact_outputs"], "budget_fraction_to_match_dense": q, "wall_s": round(time.monotonic() - t0, 1)}
    (out_dir / "checkpoints.json").write_text(json.dumps(doc, indent=1, default=str))
    plot(results, out_dir / "checkpoints_pareto.png", bps)
    print(f"\nwrote {out_dir / 'checkpoints.json'} and {out_dir / 'checkpoints_pareto.png'} ({doc['wall_s']} s)")
    print(f"online: dp_dominates_all_budgets_online={str(dom_online).lower()} engine_matches_simulator={str(engine['engine_matches_simulator']).lower()}")
    print(f"RESULT dp_dominates_all_budgets={str(dom).lower()} exact_outputs={str(engine['exact_outputs']).lower()} "
          f"budget_fraction_to_match_dense={'none' if q is None else f'{q:.4f}'}")
