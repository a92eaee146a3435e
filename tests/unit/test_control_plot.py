"""baton/bench/control_plot.py draws a sweep, a point with a +inf route p99 included."""
from __future__ import annotations

from pathlib import Path

from baton.bench.control_plot import plot
from baton.bench.control_stats import TurnSample, summarize_point


def test_plot_writes_a_png(tmp_path: Path) -> None:
    ok = TurnSample(ok=True, started_s=0.0, latency_s=0.01, ttft_s=0.01, hops={"route": 0.002, "total": 0.008})
    bad = TurnSample(ok=False, started_s=0.0, latency_s=0.01, error="timeout")
    points = [summarize_point(8, 8, [ok] * 10, 1.0), summarize_point(8, 32, [ok] * 20 + [bad], 1.0),
              summarize_point(32, 8, [ok] * 12, 1.0)]
    plot(points, tmp_path / "control.png")
    assert (tmp_path / "control.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_size_that_completed_no_turn(tmp_path: Path) -> None:
    points = [summarize_point(8, 8, [], 1.0), summarize_point(8, 32, [], 1.0)]  # nothing finished in the window
    plot(points, tmp_path / "control.png")
    assert (tmp_path / "control.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
