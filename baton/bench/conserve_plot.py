"""The ConServe bench's figure: per load level, each policy's median p95 (over repetitions, bars
from min to max) of TTFET, ITL and TTFT (with the SLO), handoffs per conversation, and TTFT p50
by turn index at each level (repetitions pooled by their medians). +inf (failures) is drawn at
the top of its panel, marked x."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from baton.bench.conserve_stats import Cell, Spread

PANELS = (("ttfet_p95_s", "TTFET p95 (s)"), ("itl_p95_s", "ITL p95 (s)"), ("ttft_p95_s", "TTFT p95 (s)"),
          ("handoffs_per_conversation", "KV handoffs / conversation"))


def plot(summary: dict[str, dict[float, dict[str, Spread | int]]], cells: Sequence[Cell], rates: Sequence[float], slo_s: float,
         path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(PANELS), len(rates))
    fig, axes = plt.subplots(2, cols, figsize=(4 * cols, 7), squeeze=False)
    for ax, (name, title) in zip(axes[0], PANELS, strict=False):
        for policy, by_rate in summary.items():
            xs, ys, lo, hi, failed = [], [], [], [], []
            for rate in rates:
                s = by_rate.get(rate, {}).get(name)
                if not isinstance(s, Spread) or s.median is None:
                    continue
                if math.isinf(s.median):
                    failed.append(rate)
                    continue
                xs.append(rate)
                ys.append(s.median)
                lo.append(s.median - (s.min or s.median))
                hi.append((s.max if s.max is not None and not math.isinf(s.max) else s.median) - s.median)
            line = ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=policy)
            if failed:
                top = ax.get_ylim()[1]
                ax.scatter(failed, [top] * len(failed), marker="x", color=line[0].get_color())
        if name == "ttft_p95_s":
            ax.axhline(slo_s, linestyle="--", color="grey", label=f"SLO {slo_s:g} s")
        ax.set(xlabel="load (conversations/s)", title=title)
        ax.legend(fontsize=7)
    for ax in axes[0][len(PANELS):]:
        ax.axis("off")
    for ax, rate in zip(axes[1], rates, strict=False):
        for policy in summary:
            by_turn: dict[int, list[float]] = {}
            for c in cells:
                if c.policy == policy and c.rate == rate:
                    for t in c.figures.by_turn:
                        if t.ttft_p50_s is not None and not math.isinf(t.ttft_p50_s):
                            by_turn.setdefault(t.turn_index, []).append(t.ttft_p50_s)
            idx = sorted(by_turn)
            ax.plot(idx, [sorted(by_turn[i])[len(by_turn[i]) // 2] for i in idx], marker="o", label=policy)
        ax.set(xlabel="turn index", title=f"TTFT p50 by turn @ {rate:g}/s")
        ax.legend(fontsize=7)
    for ax in axes[1][len(rates):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
