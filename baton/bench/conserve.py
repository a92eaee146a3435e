"""ConServe benchmark: the same BFCL-derived agentic trace replayed against each routing policy,
one after the other in one run, with the same number of engines (1 prefill + 2 decode for the
disaggregated policies, 3 unified replicas otherwise) on a local `serve run` cluster.

Figures: TTFET p50/p95 (docs/TRACES.md defines it), TTFT by turn index, KV handoffs per
conversation and bytes moved — the last two counted by the decode engines' connectors."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from baton.paths import REPO_ROOT

ROOT = REPO_ROOT


@dataclass(frozen=True)
class Workload:
    conversations: int
    user_turns: int
    max_system_chars: int
    max_tokens: int
    concurrency: int


QUICK = Workload(conversations=6, user_turns=2, max_system_chars=9000, max_tokens=32, concurrency=6)
FULL = Workload(conversations=32, user_turns=2, max_system_chars=13000, max_tokens=48, concurrency=12)


def pool_args(policy: str, engines: int = 3, prefill_threads: int = 2) -> dict[str, Any]:
    """Same engine count for every policy. The disaggregated layouts make the prefill engine
    prefill-heavy the way a CPU can: more threads (on GPUs: a faster accelerator type)."""
    engine = {"model": "SmolLM2-135M-Instruct", "max_model_len": 8192, "kv_cache_gib": 1.0}
    args: dict[str, Any] = {"ingress": {"served_model_name": "SmolLM2-135M-Instruct"}, "routing": {"policy": policy}}
    if policy in ("conversation", "per_turn_pd"):
        prefill_engine = {**engine, "cpu_threads": prefill_threads}
        args["prefill"] = {"num_replicas": 1, "resources": {"num_cpus": 0.5, "custom": {"prefill_slot": 1}}, "engine": prefill_engine}
        args["decode"] = {"num_replicas": engines - 1, "resources": {"num_cpus": 0.5, "custom": {"decode_slot": 1}}, "engine": engine}
    else:
        args["decode"] = {"num_replicas": engines, "resources": {"num_cpus": 0.5, "custom": {"decode_slot": 1}}, "engine": engine}
    return args


def build_trace(w: Workload) -> list[Any]:
    from baton.traces.bfcl import BfclOptions, build_bfcl_trace

    return build_bfcl_trace(
        BfclOptions(n=w.conversations, min_user_turns=w.user_turns, max_user_turns=w.user_turns, drop_response_schema=True,
                    max_system_chars=w.max_system_chars, max_tokens=w.max_tokens)
    )


def _transfer_totals(url: str) -> dict[str, int]:
    snap = httpx.get(f"{url}/baton/stats", timeout=10).json()
    decoders = [r for r in snap["replicas"].values() if r["pool"] == "decode"]
    return {"transfers": sum(int(r.get("kv_transfers_received", 0)) for r in decoders), "bytes": sum(int(r.get("kv_bytes_received", 0)) for r in decoders)}


def _settled_totals(url: str) -> dict[str, int]:
    last: dict[str, int] = {}
    for _ in range(15):
        time.sleep(1.5)
        now = _transfer_totals(url)
        if now == last:
            break
        last = now
    return last


def run_policy(policy: str, convs: list[Any], w: Workload, out_dir: Path) -> dict[str, Any]:
    from baton.bench.cluster import LocalServeApp
    from baton.traces.replay import replay
    from baton.traces.report import summarize

    with LocalServeApp(pool_args(policy), resources={"prefill_slot": 1, "decode_slot": 3}, log_dir=out_dir / f"serve-{policy}") as app:
        before = _settled_totals(app.url)
        result = asyncio.run(replay(convs, app.url, w.concurrency, progress=False))
        after = _settled_totals(app.url)
        snap = httpx.get(f"{app.url}/baton/stats", timeout=10).json()
    s = summarize(result)
    n = max(1, s.conversations)
    row = {
        "policy": policy,
        "start_s": app.start_seconds,
        "summary": asdict(s),
        "kv_transfers": after["transfers"] - before["transfers"],
        "kv_bytes_moved": after["bytes"] - before["bytes"],
        "handoffs_per_conversation": (after["transfers"] - before["transfers"]) / n,
        "planned_handoffs": snap["handoffs_planned_total"],
        "errors": s.errors,
    }
    print(
        f"[conserve] {policy:13s} TTFET p50 {s.ttfet_p50_s} p95 {s.ttfet_p95_s}  TTFT p50 {s.ttft_p50_s}  "
        f"handoffs/conv {row['handoffs_per_conversation']:.2f}  KV moved {row['kv_bytes_moved'] / 1e6:.1f} MB  errors {s.errors}"
    )
    return row


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    w = QUICK if quick else FULL
    policies = ["conversation", "per_turn_pd", "colocated"] + ([] if quick else ["round_robin"])
    convs = build_trace(w)
    turns = sum(len(c.turns) for c in convs)
    print(f"[conserve] {len(convs)} BFCL conversations, {turns} requests, concurrency {w.concurrency}, policies {policies}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [run_policy(p, convs, w, out_dir) for p in policies]
    by = {r["policy"]: r for r in rows}

    def p95(policy: str) -> float:
        return float(by[policy]["summary"]["ttfet_p95_s"] or float("nan"))

    result = {
        "quick": quick,
        "workload": asdict(w),
        "conversations": len(convs),
        "requests": turns,
        "policies": rows,
        "p95_ttfet_ratio_vs_per_turn_pd": p95("conversation") / p95("per_turn_pd"),
        "p95_ttfet_ratio_vs_colocated": p95("conversation") / p95("colocated"),
        "handoffs_per_conversation": by["conversation"]["handoffs_per_conversation"],
    }
    (out_dir / "conserve.json").write_text(json.dumps(result, indent=2))
    _plot(rows, out_dir / "conserve.png")
    print(f"[conserve] wrote {out_dir / 'conserve.json'} and {out_dir / 'conserve.png'}")
    print(
        f"RESULT p95_ttfet_ratio_vs_per_turn_pd={result['p95_ttfet_ratio_vs_per_turn_pd']:.3f} "
        f"p95_ttfet_ratio_vs_colocated={result['p95_ttfet_ratio_vs_colocated']:.3f} "
        f"handoffs_per_conversation={result['handoffs_per_conversation']:.2f}"
    )
    return result


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["policy"] for r in rows]
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["summary"]["ttfet_p50_s"] or 0 for r in rows], width=0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [r["summary"]["ttfet_p95_s"] or 0 for r in rows], width=0.4, label="p95")
    axes[0].set_xticks(list(x), names, rotation=15)
    axes[0].set_title("TTFET (s)")
    axes[0].legend()
    for r in rows:
        by_turn = r["summary"]["by_turn"]
        axes[1].plot([b["turn_index"] for b in by_turn], [b["ttft_p50_s"] for b in by_turn], marker="o", label=r["policy"])
    axes[1].set_xlabel("turn index")
    axes[1].set_title("TTFT p50 by turn (s)")
    axes[1].legend()
    axes[2].bar(list(x), [r["kv_bytes_moved"] / 1e6 for r in rows])
    axes[2].set_xticks(list(x), names, rotation=15)
    axes[2].set_title("KV moved between engines (MB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
