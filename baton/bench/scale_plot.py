"""Plot of `bench scale`: p95 TTFET and goodput vs fleet size per policy (agentic workload), and
energy per conversation, homogeneous vs heterogeneous, at the largest fleet."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agentic = [c for c in cells if c["workload"] == "agentic"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    series = sorted({(c["policy"], c["tiers"]) for c in agentic})
    for policy, tiers in series:
        row = sorted((c for c in agentic if c["policy"] == policy and c["tiers"] == tiers), key=lambda c: c["gpus"])
        xs = [c["gpus"] for c in row]
        p95 = [c["figures"]["ttfet_p95_s"] for c in row]
        style = "-" if tiers == "homo" else "--"
        axes[0].plot(xs, [v if v is not None and math.isfinite(v) else float("nan") for v in p95], style, marker="o",
                     label=f"{policy} ({tiers})")
        axes[1].plot(xs, [c["goodput_per_gpu_s"] for c in row], style, marker="o", label=f"{policy} ({tiers})")
    for ax, title in ((axes[0], "p95 TTFET (s), agentic"), (axes[1], "goodput (good conversations / s / GPU)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    biggest = max((c["gpus"] for c in agentic), default=0)
    bars = [c for c in agentic if c["gpus"] == biggest]
    axes[2].bar([f"{c['policy']}\n{c['tiers']}" for c in bars], [c["energy_per_conversation_j"] / 1e3 for c in bars])
    axes[2].set_title(f"energy per conversation (kJ), agentic, {biggest} GPUs")
    axes[2].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
