"""`baton bench checkpoints`: where to keep a hybrid model's recurrent-state checkpoints.

online  (the RESULT) every retention rule — vLLM's default (replay boundary + junction), vLLM's
        interval policy as vLLM runs it, SGLang's branch points, block-dense, uniform, balanced and
        Baton's DP (baton/bench/checkpoint_retention.py) — replayed request by request over (a) BFCL
        as multi-turn conversations, (b) LoCoMo document questions, (c) a mixed agentic trace
        (agentic_small.jsonl + LoCoMo questions); the first half warms the cache and the plans, the
        second half is scored: states held vs recomputed tokens (baton/bench/checkpoint_online.py).
        Families are conversations (system prompt + first user message), with the engine's decay.
in-sample  each first-block family planned once from the whole stream and scored on it (the DP's
        objective, exact): a check of the solver, printed and in the JSON, never in the RESULT.
engine  (skipped with --offline) LoCoMo requests on the real tiny-LFM2 engine (prefix caching off,
        then Baton's scheduler per strategy): TTFT, greedy tokens vs no-cache, hits vs the replay.
hybrid P/D  (skipped with --offline) `serve run` of cluster_configs/local_hybrid_pd.yaml: first
        turns prefilled remotely, KV + conv state moved over NIXL, greedy text vs one no-cache
        engine; one transfer per conversation, second turns pinned (baton/bench/checkpoint_pd.py).

Writes checkpoints.json + checkpoints_pareto.png under the out dir, prints a table per workload
(with every point the DP loses to), and ends with
RESULT dp_dominates_online=… exact_outputs=… states_ratio_vs_vllm_default_same_saving=…
recompute_ratio_vs_vllm_default_same_states=… hybrid_pd_exact=… (each ratio at its worst workload, named on
the line before; hybrid_pd_exact is true only when every remote prefill gave the reference's
tokens and each first turn was really moved, once).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from baton.bench.checkpoint_engine import TINY_HYBRID, run_engine
from baton.bench.checkpoint_online import compare, print_table, state_bytes, summary
from baton.bench.checkpoint_pd import hybrid_pd_phase
from baton.bench.checkpoint_retention import VllmDefault
from baton.bench.checkpoint_sim import StreamRequest, block_keys, match_depths, replay, simulate_keyed, steady_state
from baton.bench.checkpoint_workloads import (
    Timed,
    bfcl_conversations,
    document_questions,
    long_documents,
    merge,
    sample_conversations,
    shared_prompts,
)
from baton.engine.checkpoints.config import CheckpointConfig
from baton.traces.locomo import default_locomo_dir

B = 128  # tiny-LFM2's state block (mamba_block_size = block_size with prefix caching on CPU)
BASELINES = ["uniform", "balanced", "sqrt", "dyadic"]
LOCOMO = default_locomo_dir()  # ../shared/data/locomo next to the checkout (was looked for inside it)
SAMPLES = Path(__file__).resolve().parent.parent / "traces" / "samples"


def _cfg(strategy: str, budget: int) -> CheckpointConfig:
    return CheckpointConfig(strategy=strategy, budget=budget, half_life_s=1e6)


def sweep(prompts: list[list[int]], budgets: list[int]) -> dict[str, Any]:
    """In-sample only: every strategy × budget planned once from the whole stream's histogram and
    scored on that same stream (the planner's objective, exact); q for DP against block-dense."""
    keyed = [(block_keys(p, B), len(p)) for p in prompts]
    stream = match_depths(B, keyed)
    rows = []
    for strategy in ["none", "block_dense"]:
        rec, planned = steady_state(_cfg(strategy, 0), B, stream)
        rows.append({"strategy": strategy, "budget": None, "steady_recomputed": rec, "planned": planned})
    for strategy in ["dp", *BASELINES]:
        for m in budgets:
            rec, planned = steady_state(_cfg(strategy, m), B, stream)
            rows.append({"strategy": strategy, "budget": m, "steady_recomputed": rec, "planned": planned})
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
    none_ = by[("none", None)]
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "match_tokens": sum(m for _, m, _ in stream),
        "families": len({f for f, _, _ in stream if f is not None}),
        "rows": rows,
        "dp_dominates_steady": dom_steady and all(by[("dp", m)]["steady_recomputed"] <= none_["steady_recomputed"] for m in budgets),
        "dp_budget_to_match_dense": q_budget,
        "dp_planned_to_match_dense": q_planned,
        "dense_planned": dense["planned"],
        "q": (q_planned / dense["planned"]) if q_planned is not None and dense["planned"] else None,
        "q_pure_dp": q_pure,
    }


def _vllm_default_replay(keyed: list[tuple[list[bytes], int]], max_tokens: int) -> Any:
    """The replay of vLLM's own default retention over the engine's prompts (outputs never reused)."""
    return replay(VllmDefault(B), B, [StreamRequest(tuple(k), L, max_tokens) for k, L in keyed])


def dp_budget_for_states(keyed: list[tuple[list[bytes], int]], states: int) -> int:
    """The largest DP budget whose engine-checked replay holds no more states than `states` (≥ 1)."""
    fit = [m for m in range(1, 33) if simulate_keyed(_cfg("dp", m), B, keyed).states_held <= states]
    return max(fit, default=1)


def engine_phase(prompts: list[list[int]], budget: int, strategies: list[str], max_tokens: int) -> dict[str, Any]:
    """The real engine on a subset: TTFT, exactness vs no-cache, hits vs the replay — for Baton's
    strategies at `budget`, for vLLM's own default retention, and for the DP at vLLM default's states."""
    keyed = [(block_keys(p, B), len(p)) for p in prompts]
    ref = run_engine("nocache", prompts, max_tokens=max_tokens, max_model_len=8192)
    out: dict[str, Any] = {"budget": budget, "requests": len(prompts), "runs": {}}
    ttft_ref = [r["ttft_s"] for r in ref["rows"]]
    out["runs"]["nocache"] = {"ttft_mean_s": statistics.fmean(ttft_ref), "ttft_p50_s": statistics.median(ttft_ref)}
    ref_tokens = [r["tokens"] for r in ref["rows"]]

    def record(label: str, res: dict[str, Any], sim_hits: list[int], t0: float) -> bool:
        hits = [r["cached"] for r in res["rows"]]
        ttft = [r["ttft_s"] for r in res["rows"]]
        m = res.get("metrics", {})
        out["runs"][label] = {
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": statistics.median(ttft),
            "exact_tokens": [r["tokens"] for r in res["rows"]] == ref_tokens, "hits_match_simulator": hits == sim_hits,
            "recomputed_tokens": m.get("recomputed_tokens"), "checkpoints_held": m.get("checkpoints_held"),
            "state_bytes": m.get("state_bytes", 0), "wall_s": round(time.monotonic() - t0, 1),
        }
        return hits == sim_hits

    exact, sim_ok = True, True
    vd_sim = _vllm_default_replay(keyed, max_tokens)
    m_same = dp_budget_for_states(keyed, vd_sim.states_held)
    runs = [(s, _cfg(s, budget)) for s in strategies] + [("dp_same_states_as_vllm", _cfg("dp", m_same))]
    for label, cfg in runs:
        t0 = time.monotonic()
        res = run_engine("baton", prompts, ckpt=cfg.model_dump(), max_tokens=max_tokens, max_model_len=8192)
        sim_ok &= record(label, res, [r.hit for r in simulate_keyed(cfg, B, keyed, output_len=max_tokens).requests], t0)
        exact &= out["runs"][label]["exact_tokens"]
    t0 = time.monotonic()
    res = run_engine("vllm", prompts, max_tokens=max_tokens, max_model_len=8192)  # vLLM's own default retention
    out["vllm_default_matches_replay"] = record("vllm_default", res, [r.hit for r in vd_sim.requests], t0)
    out["runs"]["vllm_default"].update(recomputed_tokens=vd_sim.recomputed_tokens, checkpoints_held=vd_sim.states_held,
                                       held_from="replay (vLLM reports no state count)")
    out["dp_same_states"] = {"budget": m_same, "vllm_default_states": vd_sim.states_held}
    held = [(r["state_bytes"], r["checkpoints_held"]) for r in out["runs"].values() if r.get("checkpoints_held") and r.get("state_bytes")]
    out["bytes_per_state"] = held[0][0] // held[0][1] if held else None
    out["runs"]["vllm_default"]["state_bytes"] = vd_sim.states_held * (out["bytes_per_state"] or 0)
    out["exact_outputs"] = exact and out["runs"]["vllm_default"]["exact_tokens"]
    out["engine_matches_simulator"] = sim_ok
    return out


def plot(online: dict[str, Any], path: Path, pool_bytes: int) -> None:
    """Per workload: states held vs recomputed tokens on the held-out requests, every rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(online)
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(6.5 * max(len(names), 1), 5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=False):
        rows = online[name]["rows"]
        for s in ["dp", "dp_histogram_only", "uniform", "balanced", "vllm_interval"]:
            pts = sorted((r["states_held"], r["recomputed"]) for r in rows if r["strategy"] == s)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=s, lw=2 if s == "dp" else 1)
        for s, mk in [("none", "x"), ("block_dense", "s"), ("vllm_default", "*"), ("branch_points", "D")]:
            r = next(r for r in rows if r["strategy"] == s)
            ax.scatter([r["states_held"]], [r["recomputed"]], marker=mk, s=80, label=s, zorder=5)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_yscale("symlog", linthresh=128)
        ax.set_xlabel(f"states held (x {pool_bytes / 2**20:.2f} MiB)")
        ax.set_ylabel("recomputed tokens (held-out requests)")
        ax.set_title(f"{name}: online, scored after a {online[name]['warmup_share']:.0%} warm-up")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def locomo_prompts(quick: bool) -> list[list[int]] | None:
    return long_documents(TINY_HYBRID, LOCOMO, 30 if quick else 200, 6 if quick else None)


def online_workloads(quick: bool, docs: list[list[int]] | None) -> dict[str, list[Timed]]:
    """(a) BFCL as multi-turn conversations, (b) LoCoMo document questions, (c) a mixed agentic trace."""
    out: dict[str, list[Timed]] = {"bfcl_multiturn": bfcl_conversations(TINY_HYBRID, 40 if quick else 200, gap_s=30.0)}
    if docs is None:
        print(f"locomo_documents, mixed_agentic: skipped (no LoCoMo data under {LOCOMO})")
        return out
    out["locomo_documents"] = document_questions(docs, gap_s=10.0)
    agentic = sample_conversations(TINY_HYBRID, SAMPLES / "agentic_small.jsonl", gap_s=60.0)
    out["mixed_agentic"] = merge(agentic, document_questions(docs[: len(docs) // 3], gap_s=5.0, start_s=0.5))
    return out


def offline_part(quick: bool, docs: list[list[int]] | None) -> dict[str, Any]:
    """Everything that needs no engine: the online comparison (RESULT) and the in-sample sweep."""
    t0 = time.monotonic()
    budgets = [1, 2, 3, 4, 6, 8, 12, 16, 32] if quick else [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    intervals = [2 * B, 8 * B, 32 * B] if quick else [2 * B, 4 * B, 8 * B, 16 * B, 32 * B]
    online = {name: compare(timed, B, budgets, intervals) for name, timed in online_workloads(quick, docs).items()}
    print(f"online comparison done in {time.monotonic() - t0:.1f} s")
    in_sample: dict[str, Any] = {"shared_prompts": sweep(shared_prompts(TINY_HYBRID, 40 if quick else 200), budgets)}
    if docs is not None:
        in_sample["long_documents"] = sweep(docs, budgets)
    return {"budgets": budgets, "intervals": intervals, "online": online, "online_summary": summary(online),
            "in_sample": in_sample, "state_bytes": state_bytes(TINY_HYBRID, B), "offline_wall_s": round(time.monotonic() - t0, 1)}


def run(quick: bool, out_dir: Path, offline: bool = False) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    docs = locomo_prompts(quick)
    doc = {"quick": quick, "offline": offline, "block_size": B, **offline_part(quick, docs)}
    pool_bytes = doc["state_bytes"]["pool_bytes"]
    print(f"one state: {doc['state_bytes']['raw_bytes']} B of conv state ({doc['state_bytes']['formula']})")
    for name, res in doc["online"].items():
        print_table(name, res, pool_bytes)
    print("\nin-sample (each family planned from the whole stream it is scored on; not a claim):")
    for name, res in doc["in_sample"].items():
        print(f"  {name}: {res['requests']} requests, {res['families']} first-block families; dp_dominates_in_sample="
              f"{str(res['dp_dominates_steady']).lower()}; DP matches block-dense at M={res['dp_budget_to_match_dense']} "
              f"(q={res['q']:.3f}, without spare fill q={res['q_pure_dp']:.3f})")

    engine: dict[str, Any] | None = None
    if not offline:
        eng_name = "long_documents" if docs is not None else "shared_prompts"
        prompts = docs if docs is not None else shared_prompts(TINY_HYBRID, 40 if quick else 200)
        subset = [p for p in prompts if len(p) <= 8000][: 16 if quick else 48]
        strategies = ["none", "block_dense", "uniform", "dp"] if quick else ["none", "block_dense", "uniform", "balanced", "sqrt", "dyadic", "dp"]
        engine = engine_phase(subset, 4, strategies, max_tokens=4)
        engine["workload"] = eng_name
        print(f"\nengine ({eng_name}, {engine['requests']} requests, M={engine['budget']}, bytes/state={engine['bytes_per_state']}):")
        print(f"{'strategy':<24} {'ttft_mean_ms':>13} {'ttft_p50_ms':>12} {'exact':>6} {'=sim':>5} {'recomp':>7} {'held':>5} {'state_MiB':>10}")
        for s, r in engine["runs"].items():
            print(f"{s:<24} {r['ttft_mean_s'] * 1e3:>13.1f} {r['ttft_p50_s'] * 1e3:>12.1f} {r.get('exact_tokens', '-')!s:>6} "
                  f"{r.get('hits_match_simulator', '-')!s:>5} {r.get('recomputed_tokens', '-'):>7} {r.get('checkpoints_held', '-'):>5} "
                  f"{r.get('state_bytes', 0) / 2**20:>10.1f}")
    doc["engine"] = engine
    pd: dict[str, Any] | None = None
    if not offline:
        firsts = [p[:3000] for p in prompts[: 4 if quick else 12]]
        pd = hybrid_pd_phase(firsts, max_tokens=16, log_dir=out_dir / "serve-hybrid-pd")
        print(f"\nhybrid P/D ({pd['config']}, {pd['dtype']}, {pd['requests']} conversations, 2 turns each): exact "
              f"{sum(r['exact'] for r in pd['rows'])}/{pd['requests']} vs one no-cache engine; transfers after first turns "
              f"{pd['first_turn_transfers']}, after second turns {pd['total_transfers']}; pinned={str(pd['pinned']).lower()}")
    doc["hybrid_pd"] = pd
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    (out_dir / "checkpoints.json").write_text(json.dumps(doc, indent=1, default=str))
    plot(doc["online"], out_dir / "checkpoints_pareto.png", pool_bytes)
    print(f"\nwrote {out_dir / 'checkpoints.json'} and {out_dir / 'checkpoints_pareto.png'} ({doc['wall_s']} s)")
    summ = doc["online_summary"]
    sr, rr = summ["states_ratio_vs_vllm_default_same_saving"], summ["recompute_ratio_vs_vllm_default_same_states"]
    print(f"online, held-out requests: dp_dominates_online={str(summ['dp_dominates_online']).lower()} (all of "
          f"{', '.join(doc['online'])}); states ratio worst on {summ['states_ratio_workload']}, recompute ratio worst on "
          f"{summ['recompute_ratio_workload']}" + ("" if engine is None else f"; engine_matches_simulator={str(engine['engine_matches_simulator']).lower()} "
                  f"vllm_default_matches_replay={str(engine['vllm_default_matches_replay']).lower()}"))
    exact = "not_run" if engine is None else str(engine["exact_outputs"]).lower()
    print(f"RESULT dp_dominates_online={str(summ['dp_dominates_online']).lower()} exact_outputs={exact} "
          f"states_ratio_vs_vllm_default_same_saving={'unreached' if sr is None else f'{sr:.3f}'} "
          f"recompute_ratio_vs_vllm_default_same_states={'none' if rr is None else f'{rr:.3f}'} "
          f"hybrid_pd_exact={'not_run' if pd is None else str(pd['exact'] and pd['one_handoff_each']).lower()}")
