"""Plot of `bench control`: routing decisions/s vs concurrency, and the directory's route-hop p99
vs concurrency, a line per (fleet size, variant): a colour per size, solid for the `pin_cache`
variant and dashed for the others (a +inf p99, a point with failures at that rank, is drawn at
the top edge as a cross)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from baton.bench.control_config import PIN_CACHE
from baton.bench.control_stats import GOAL_DECISIONS_PER_S, GOAL_ROUTE_P99_S, PointStats


def series(points: Sequence[PointStats]) -> list[tuple[int, str, list[PointStats]]]:
    """(replicas, variant, its points by concurrency), sizes ascending, variants by name within a size."""
    keys = sorted({(p.replicas, p.variant) for p in points})
    return [(n, v, sorted((p for p in points if (p.replicas, p.variant) == (n, v)), key=lambda p: p.concurrency)) for n, v in keys]


def plot(points: Sequence[PointStats], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, route_ax) = plt.subplots(1, 2, figsize=(11, 4))
    finite = [p.route_p99_s * 1000 for p in points if p.route_p99_s is not None and math.isfinite(p.route_p99_s)]
    top = max([*finite, GOAL_ROUTE_P99_S * 1000]) * 1.2
    sizes = sorted({p.replicas for p in points})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, variant, row in series(points):
        style = {"color": colours[sizes.index(n) % len(colours)], "linestyle": "-" if variant == PIN_CACHE.name else "--",
                 "marker": "o", "label": f"{n} replicas, {variant}"}
        xs = [p.concurrency for p in row]
        rate_ax.plot(xs, [p.decisions_per_s for p in row], **style)
        p99 = [p.route_p99_s * 1000 if p.route_p99_s is not None else math.nan for p in row]
        route_ax.plot(xs, [v if math.isfinite(v) else math.nan for v in p99], **style)
        inf_x = [x for x, v in zip(xs, p99, strict=True) if v == math.inf]
        if inf_x:
            route_ax.plot(inf_x, [top] * len(inf_x), "x", color=style["color"], markersize=10)
    rate_ax.axhline(GOAL_DECISIONS_PER_S, color="grey", linestyle="--", linewidth=1, label="goal")
    route_ax.axhline(GOAL_ROUTE_P99_S * 1000, color="grey", linestyle="--", linewidth=1, label="goal")
    for ax, title in ((rate_ax, "routing decisions / s (ok turns / s)"), (route_ax, "directory (route hop) p99, ms")):
        ax.set_xscale("log", base=2)
        concurrencies = sorted({p.concurrency for p in points})
        ax.set_xlim(concurrencies[0] / 1.5, concurrencies[-1] * 1.5)  # explicit: a panel with no finite point has no data limits
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrent closed-loop clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    route_ax.set_ylim(0, top * 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
