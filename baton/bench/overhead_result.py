"""`bench overhead`'s ratios and its RESULT line, from the phases' reports (pure: unit-tested on
phase dicts of the shape baton/bench/overhead.py writes)."""
from __future__ import annotations

from typing import Any

Phase = dict[str, Any]


def overhead_ratios(bare: Phase, served: Phase, baton: Phase, direct: Phase, fast: Phase, prepare: dict[str, Any]) -> dict[str, float]:
    """Every ratio of the RESULT line and the JSON; each phase's `summary` (closed loop), `single`
    (c1), `open` (open loop), and for Baton's phases `hops_single` with `own`."""
    b, s = bare["summary"], baton["summary"]
    return {
        "ttft_p50_ratio_c1": baton["single"]["ttft_p50_s"] / bare["single"]["ttft_p50_s"],
        "ttft_p50_ratio": s["ttft_p50_s"] / b["ttft_p50_s"],
        "ttft_p95_ratio": s["ttft_p95_s"] / b["ttft_p95_s"],
        "e2e_p50_ratio": s["e2e_p50_s"] / b["e2e_p50_s"],
        "throughput_ratio": s["output_tok_per_s"] / b["output_tok_per_s"],
        # against vLLM's own server (same engine arguments, same HTTP client)
        "ttft_p50_ratio_vs_vllm_serve": s["ttft_p50_s"] / served["summary"]["ttft_p50_s"],
        "ttft_p50_ratio_c1_vs_vllm_serve": baton["single"]["ttft_p50_s"] / served["single"]["ttft_p50_s"],
        "throughput_ratio_vs_vllm_serve": s["output_tok_per_s"] / served["summary"]["output_tok_per_s"],
        # Serve's direct ingress (no HTTP proxy in the request's path)
        "ttft_p50_ratio_direct_ingress": direct["summary"]["ttft_p50_s"] / b["ttft_p50_s"],
        "ttft_p50_ratio_c1_direct_ingress": direct["single"]["ttft_p50_s"] / bare["single"]["ttft_p50_s"],
        # Serve's throughput-optimized mode (gRPC handle calls, one event loop, direct ingress)
        "ttft_p50_ratio_throughput_optimized": fast["summary"]["ttft_p50_s"] / b["ttft_p50_s"],
        "ttft_p50_ratio_c1_throughput_optimized": fast["single"]["ttft_p50_s"] / bare["single"]["ttft_p50_s"],
        "throughput_ratio_throughput_optimized": fast["summary"]["output_tok_per_s"] / b["output_tok_per_s"],
        "chat_prepare_ms_ratio_incremental": prepare["ratio_p50"],
        # open-loop arrivals (baton/bench/open_loop.py): the same arrival times for every phase
        "ttft_p50_ratio_open": baton["open"]["ttft_p50_s"] / bare["open"]["ttft_p50_s"],
        "ttft_p95_ratio_open": baton["open"]["ttft_p95_s"] / bare["open"]["ttft_p95_s"],
        "ttft_p50_ratio_open_vs_vllm_serve": baton["open"]["ttft_p50_s"] / served["open"]["ttft_p50_s"],
        "ttft_p50_ratio_open_vllm_serve": served["open"]["ttft_p50_s"] / bare["open"]["ttft_p50_s"],
        "ttft_p50_ratio_open_direct_ingress": direct["open"]["ttft_p50_s"] / bare["open"]["ttft_p50_s"],
        "ttft_p50_ratio_open_throughput_optimized": fast["open"]["ttft_p50_s"] / bare["open"]["ttft_p50_s"],
        "ttft_p95_ratio_open_throughput_optimized": fast["open"]["ttft_p95_s"] / bare["open"]["ttft_p95_s"],
        # Baton's own time at c1 (TTFT − engine hop, per request) added to the bare engine's TTFT: the
        # ratio if Baton's engine ran exactly as fast as the bare one (no drift between phases)
        "ttft_p50_ratio_c1_engine_normalized": (bare["single"]["ttft_p50_s"] + baton["hops_single"]["own"]) / bare["single"]["ttft_p50_s"],
        "ttft_p50_ratio_c1_engine_normalized_throughput_optimized":
            (bare["single"]["ttft_p50_s"] + fast["hops_single"]["own"]) / bare["single"]["ttft_p50_s"],
        # each served phase's c1 against the bare engine's c1 pass right after it (overhead.py)
        "ttft_p50_ratio_c1_paired": _paired(baton),
        "ttft_p50_ratio_c1_paired_vllm_serve": _paired(served),
        "ttft_p50_ratio_c1_paired_direct_ingress": _paired(direct),
        "ttft_p50_ratio_c1_paired_throughput_optimized": _paired(fast),
        "bare_c1_spread": bare_c1_spread(bare, (served, baton, direct, fast)),
    }


def _paired(phase: Phase) -> float:
    return phase["single"]["ttft_p50_s"] / phase["bare_c1_paired"]["ttft_p50_s"]


def bare_c1_spread(bare: Phase, served: tuple[Phase, ...]) -> float:
    """The largest over the smallest of the bare engine's c1 TTFT p50s (its own pass and the one
    after each served phase): how far the host's speed moved during the run."""
    p50s = [bare["single"]["ttft_p50_s"], *(p["bare_c1_paired"]["ttft_p50_s"] for p in served)]
    return max(p50s) / min(p50s)


def result_line(ratios: dict[str, float], bare: Phase, baton: Phase, fast: Phase, prepare: dict[str, Any]) -> str:
    return (
        f"RESULT ttft_p50_ratio={ratios['ttft_p50_ratio']:.3f} ttft_p50_ratio_c1={ratios['ttft_p50_ratio_c1']:.3f} e2e_p50_ratio={ratios['e2e_p50_ratio']:.3f} "
        f"throughput_ratio={ratios['throughput_ratio']:.3f} ttft_p50_ratio_vs_vllm_serve={ratios['ttft_p50_ratio_vs_vllm_serve']:.3f} "
        f"ttft_p50_ratio_c1_vs_vllm_serve={ratios['ttft_p50_ratio_c1_vs_vllm_serve']:.3f} "
        f"throughput_ratio_vs_vllm_serve={ratios['throughput_ratio_vs_vllm_serve']:.3f} "
        f"ttft_p50_ratio_direct_ingress={ratios['ttft_p50_ratio_direct_ingress']:.3f} "
        f"ttft_p50_ratio_c1_direct_ingress={ratios['ttft_p50_ratio_c1_direct_ingress']:.3f} "
        f"ttft_p50_ratio_throughput_optimized={ratios['ttft_p50_ratio_throughput_optimized']:.3f} "
        f"ttft_p50_ratio_c1_throughput_optimized={ratios['ttft_p50_ratio_c1_throughput_optimized']:.3f} "
        f"throughput_ratio_throughput_optimized={ratios['throughput_ratio_throughput_optimized']:.3f} "
        f"chat_prepare_ms_p50={prepare['whole_ms_p50']:.2f}/{prepare['incremental_ms_p50']:.2f} "
        f"chat_prepare_ms_ratio_incremental={ratios['chat_prepare_ms_ratio_incremental']:.3f} baton_start_s={baton['start_s']:.1f} "
        f"replica_rss_gib={baton['rss_bytes'] / (1 << 30):.2f} open_loop_rate_per_s={bare['open_rate_per_s']:.2f} "
        f"ttft_p50_ratio_open={ratios['ttft_p50_ratio_open']:.3f} ttft_p95_ratio_open={ratios['ttft_p95_ratio_open']:.3f} "
        f"ttft_p50_ratio_open_vs_vllm_serve={ratios['ttft_p50_ratio_open_vs_vllm_serve']:.3f} "
        f"ttft_p50_ratio_open_vllm_serve={ratios['ttft_p50_ratio_open_vllm_serve']:.3f} "
        f"ttft_p50_ratio_open_direct_ingress={ratios['ttft_p50_ratio_open_direct_ingress']:.3f} "
        f"ttft_p50_ratio_open_throughput_optimized={ratios['ttft_p50_ratio_open_throughput_optimized']:.3f} "
        f"ttft_p95_ratio_open_throughput_optimized={ratios['ttft_p95_ratio_open_throughput_optimized']:.3f} "
        f"own_ms_c1={baton['hops_single']['own'] * 1000:.1f} own_ms_c1_throughput_optimized={fast['hops_single']['own'] * 1000:.1f} "
        f"ttft_p50_ratio_c1_engine_normalized={ratios['ttft_p50_ratio_c1_engine_normalized']:.3f} "
        f"ttft_p50_ratio_c1_engine_normalized_throughput_optimized={ratios['ttft_p50_ratio_c1_engine_normalized_throughput_optimized']:.3f} "
        f"ttft_p50_ratio_c1_paired={ratios['ttft_p50_ratio_c1_paired']:.3f} "
        f"ttft_p50_ratio_c1_paired_vllm_serve={ratios['ttft_p50_ratio_c1_paired_vllm_serve']:.3f} "
        f"ttft_p50_ratio_c1_paired_direct_ingress={ratios['ttft_p50_ratio_c1_paired_direct_ingress']:.3f} "
        f"ttft_p50_ratio_c1_paired_throughput_optimized={ratios['ttft_p50_ratio_c1_paired_throughput_optimized']:.3f} "
        f"bare_c1_spread={ratios['bare_c1_spread']:.3f}"
    )
