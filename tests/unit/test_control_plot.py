"""baton/bench/control_plot.py draws a sweep, a point with a +inf route p99 included, a line per
(fleet size, variant)."""
from __future__ import annotations

from pathlib import Path

from baton.bench.control_plot import plot, series
from baton.bench.control_stats import TurnSample, summarize_point

OK = TurnSample(ok=True, started_s=0.0, latency_s=0.01, ttft_s=0.01, hops={"route": 0.002, "total": 0.008})
BAD = TurnSample(ok=False, started_s=0.0, latency_s=0.01, error="timeout")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    points = [summarize_point(8, 8, [OK] * 10, 1.0), summarize_point(8, 32, [OK] * 20 + [BAD], 1.0),
              summarize_point(32, 8, [OK] * 12, 1.0), summarize_point(8, 8, [OK] * 5, 1.0, variant="no_pin_cache")]
    plot(points, tmp_path / "control.png")
    assert (tmp_path / "control.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_line_per_size_and_variant() -> None:
    points = [summarize_point(32, 8, [OK], 1.0, variant="no_pin_cache"), summarize_point(8, 32, [OK], 1.0),
              summarize_point(8, 8, [OK], 1.0), summarize_point(8, 8, [OK], 1.0, variant="no_pin_cache"),
              summarize_point(32, 8, [OK], 1.0)]
    got = [(n, v, [p.concurrency for p in row]) for n, v, row in series(points)]
    assert got == [(8, "no_pin_cache", [8]), (8, "pin_cache", [8, 32]), (32, "no_pin_cache", [8]), (32, "pin_cache", [8])]
    assert all(p.variant == v and p.replicas == n for n, v, row in series(points) for p in row)


def test_plot_of_a_size_that_completed_no_turn(tmp_path: Path) -> None:
    points = [summarize_point(8, 8, [], 1.0), summarize_point(8, 32, [], 1.0)]  # nothing finished in the window
    plot(points, tmp_path / "control.png")
    assert (tmp_path / "control.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
