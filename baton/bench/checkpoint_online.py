"""The online comparison of `baton bench checkpoints`: every retention rule replayed on held-out requests.

For each workload (multi-turn BFCL conversations, LoCoMo document questions, a mixed agentic
trace) every rule of baton/bench/checkpoint_retention.py is replayed over the whole stream; the
first `warmup` share of the requests only warms the cache and the plans, the rest are scored —
so the DP (re-solved as depths arrive, rolling) is always judged on requests it has not seen.
A point is (states held at the end, recomputed matched tokens on the scored requests).

Figures per workload, each able to fail:
  dp_dominates_online          for every other rule's point (s, r): the DP's best recompute with at
                               most s states ≤ r (DP at M = 0 is `none`, so 0 states are covered);
  states_ratio_same_saving     (fewest states of a DP point recomputing ≤ vLLM default) / (vLLM
                               default's states); None when no DP budget reaches its saving;
  recompute_ratio_same_states  (least recompute of a DP point holding ≤ vLLM default's states) /
                               (vLLM default's recompute).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from baton.bench.checkpoint_retention import BranchPoints, FamilyKeying, Planned, Retention, VllmDefault, VllmInterval
from baton.bench.checkpoint_sim import StreamRequest, block_keys, replay
from baton.bench.checkpoint_workloads import Timed
from baton.engine.checkpoints.config import CheckpointConfig

DP = "dp"
HALF_LIFE_S = 600.0  # the engine's default decay of a family's depth histogram
VARIANTS: dict[str, dict[str, Any]] = {
    "dp_first_block": {"family": "first_block"},  # the engine's keying: one family per first block
    "dp_no_decay": {"half_life": 1e12},
    "dp_histogram_only": {"continuation": False},  # the seed's DP: observed depths only
    "dp_no_spare": {"fill_spare": False},  # the DP's own positions only
}


def to_stream(timed: Sequence[Timed], block_size: int) -> list[StreamRequest]:
    """Token streams → block-keyed requests (the KV of all but the last output token is computed)."""
    out = []
    for r in timed:
        seq = r.prompt + r.output[:-1]
        out.append(StreamRequest(tuple(block_keys(seq, block_size)), len(r.prompt), len(r.output), r.family, r.now))
    return out


def state_bytes(model_dir: Path, block_size: int) -> dict[str, Any]:
    """Bytes of one recurrent state of the model (LFM2 short-conv: conv_dim × (L_cache − 1) per conv
    layer, vLLM's MambaStateShapeCalculator.short_conv_state_shape), fp32 as the bench's engine runs;
    and the 512 KiB block the engine reported per state (vLLM pads it to the attention page)."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
    conv_layers = sum(1 for t in cfg.get("layer_types", []) if t == "conv")
    raw = conv_layers * int(cfg.get("conv_dim", 0)) * (int(cfg.get("conv_L_cache", 1)) - 1) * 4
    return {"raw_bytes": raw, "pool_bytes": 512 * 1024, "formula": f"{conv_layers} conv layers x conv_dim {cfg.get('conv_dim')} x "
            f"(conv_L_cache {cfg.get('conv_L_cache')} - 1) x 4 B (fp32); the pool block the engine reported: 512 KiB"}


def rules(block_size: int, budgets: Sequence[int], intervals: Sequence[int], variants: bool) -> list[tuple[str, int | None, Callable[[], Retention]]]:
    """(strategy, parameter, factory) for every point of the comparison."""
    B = block_size

    def planned(strategy: str, m: int, family: FamilyKeying = "conversation", half_life: float = HALF_LIFE_S, name: str | None = None,
                continuation: bool = True, fill_spare: bool = True) -> Callable[[], Retention]:
        cfg = CheckpointConfig(strategy=strategy, budget=m, half_life_s=half_life, continuation=continuation,  # type: ignore[arg-type]
                               fill_spare=fill_spare and strategy == DP)
        return lambda: Planned(cfg, B, family, name)

    out: list[tuple[str, int | None, Callable[[], Retention]]] = [
        ("none", None, planned("none", 0)),
        ("block_dense", None, planned("block_dense", 0)),
        ("vllm_default", None, lambda: VllmDefault(B)),
        ("branch_points", None, lambda: BranchPoints(B)),
    ]
    out += [("vllm_interval", n, (lambda n=n: VllmInterval(B, n))) for n in intervals]
    for s in ["uniform", "balanced", DP]:
        out += [(s, m, planned(s, m)) for m in budgets]
    if variants:  # the DP with the engine's first-block families, without decay, without continuation
        out += [(v, m, planned(DP, m, name=v, **kw)) for v, kw in VARIANTS.items() for m in budgets]  # type: ignore[arg-type]
    return out


def compare(timed: Sequence[Timed], block_size: int, budgets: Sequence[int], intervals: Sequence[int], warmup: float = 0.5,
            variants: bool = True) -> dict[str, Any]:
    stream = to_stream(timed, block_size)
    score_from = int(len(stream) * warmup)
    rows = []
    for strategy, param, make in rules(block_size, budgets, intervals, variants):
        rule = make()
        res = replay(rule, block_size, stream, score_from)
        row = {"strategy": strategy, "param": param, "states_held": res.states_held, "recomputed": res.recomputed_tokens,
               "match": res.match_tokens}
        if isinstance(rule, Planned):
            row["families"] = len(rule.policy.families)
            row["frozen_modes"] = rule.frozen_modes()
        rows.append(row)
    figures = score(rows)
    return {"requests": len(stream), "scored_requests": len(stream) - score_from, "warmup_share": warmup,
            "conversations": len({r.conversation for r in timed}), "families": len({r.family for r in timed}),
            "prompt_tokens": sum(r.prompt_len for r in stream), "rows": rows, **figures}


def score(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The three figures (module docstring) from (states, recompute) points; DP = strategy "dp" + none."""
    dp = [(r["states_held"], r["recomputed"]) for r in rows if r["strategy"] in (DP, "none")]
    others = [r for r in rows if r["strategy"] != DP and r["strategy"] not in VARIANTS]

    def best_with(states: int) -> float:
        return min((rc for s, rc in dp if s <= states), default=math.inf)

    losses = [{"strategy": r["strategy"], "param": r["param"], "states_held": r["states_held"], "recomputed": r["recomputed"],
               "dp_best_recomputed": best_with(r["states_held"])} for r in others if best_with(r["states_held"]) > r["recomputed"]]
    vd = next(r for r in rows if r["strategy"] == "vllm_default")
    same_saving = [s for s, rc in dp if rc <= vd["recomputed"]]
    states_ratio = (min(same_saving) / vd["states_held"] if vd["states_held"] else 1.0) if same_saving else None
    rc = best_with(vd["states_held"])
    recompute_ratio = rc / vd["recomputed"] if vd["recomputed"] else (1.0 if rc == 0 else math.inf)
    return {"dp_dominates_online": not losses, "dp_loses_to": losses, "vllm_default": {"states_held": vd["states_held"], "recomputed": vd["recomputed"]},
            "states_ratio_vs_vllm_default_same_saving": states_ratio, "recompute_ratio_vs_vllm_default_same_states": recompute_ratio}


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Across workloads: dominance everywhere; each ratio at its worst workload, named."""
    def worst(key: str) -> tuple[float | None, str | None]:
        vals = [(math.inf if r[key] is None else r[key], name) for name, r in results.items()]
        if not vals:
            return None, None
        v, name = max(vals)
        return (None if v == math.inf else v), name

    sr, sr_w = worst("states_ratio_vs_vllm_default_same_saving")
    rr, rr_w = worst("recompute_ratio_vs_vllm_default_same_states")
    return {"dp_dominates_online": bool(results) and all(r["dp_dominates_online"] for r in results.values()),
            "states_ratio_vs_vllm_default_same_saving": sr, "states_ratio_workload": sr_w,
            "recompute_ratio_vs_vllm_default_same_states": rr, "recompute_ratio_workload": rr_w}


def print_table(name: str, res: dict[str, Any], pool_bytes: int) -> None:
    print(f"\n{name}: {res['requests']} requests ({res['scored_requests']} scored after a {res['warmup_share']:.0%} warm-up), "
          f"{res['conversations']} conversations, {res['families']} conversation families, {res['prompt_tokens']} prompt tokens")
    print(f"  {'strategy':<15} {'param':>6} {'states':>7} {'state_MiB':>10} {'recomputed':>11} {'of_match':>9} {'families':>8} {'frozen':>6}")
    for r in res["rows"]:
        frac = r["recomputed"] / r["match"] if r["match"] else 0.0
        print(f"  {r['strategy']:<15} {'-' if r['param'] is None else r['param']:>6} {r['states_held']:>7} "
              f"{r['states_held'] * pool_bytes / 2**20:>10.1f} {r['recomputed']:>11} {frac:>9.3f} {r.get('families', '-'):>8} {r.get('frozen_modes', '-'):>6}")
    sr, rr = res["states_ratio_vs_vllm_default_same_saving"], res["recompute_ratio_vs_vllm_default_same_states"]
    vd = res["vllm_default"]
    print(f"  vllm_default holds {vd['states_held']} states, recomputes {vd['recomputed']}; DP: states ratio at the same saving "
          f"{'unreached' if sr is None else f'{sr:.3f}'}, recompute ratio at the same states {rr:.3f}; "
          f"dominates online: {str(res['dp_dominates_online']).lower()}")
    for loss in res["dp_loses_to"]:
        print(f"  DP loses to {loss['strategy']}{'' if loss['param'] is None else ' ' + str(loss['param'])}: {loss['states_held']} states, "
              f"{loss['recomputed']} recomputed; DP's best with ≤ that many states recomputes {loss['dp_best_recomputed']}")
