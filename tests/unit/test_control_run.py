"""baton/bench/control.py's orchestration with the cluster faked out: sizes that would leave < 3 GiB
are skipped from the first size's memory model, a size that fails to start ends the sweep, and
control.json, control.png and the RESULT line come from what ran."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from baton.bench import control
from baton.bench.control_config import Sweep
from baton.bench.control_stats import GIB, MIB, MemoryModel, PointStats, TurnSample, summarize_point

MODEL = MemoryModel(per_replica_bytes=100 * MIB, base_bytes=1 * GIB)


def fake_size(rates: dict[int, list[float]], fail_at: int | None = None, all_fail_at: int | None = None) -> Any:
    def run_size(n: int, sw: Sweep, out_dir: Path, available: int) -> tuple[dict[str, Any], list[PointStats], MemoryModel]:
        if n == fail_at:
            raise RuntimeError(f"only 3 of {n} decode replicas live")
        turn = TurnSample(ok=n != all_fail_at, started_s=0.0, latency_s=0.01, ttft_s=0.01,
                          hops={"route": 0.001 * n / 8, "total": 0.005}, error=None if n != all_fail_at else "timeout")
        points = [summarize_point(n, c, [turn] * int(r), 1.0) for c, r in zip(sw.concurrencies, rates[n], strict=True)]
        return {"replicas": n, "status": "ran", "saturated_at_concurrency": None}, points, MODEL
    return run_size


@pytest.fixture
def sixteen_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "_available", lambda: 16 * GIB)


@pytest.mark.usefixtures("sixteen_gib")
def test_sizes_past_the_memory_projection_are_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rates = {8: [100, 300, 310], 32: [90, 280, 400], 64: [80, 250, 450]}
    monkeypatch.setattr(control, "_run_size", fake_size(rates))
    report = control.run(quick=False, out_dir=tmp_path)
    assert [(s["replicas"], s["status"]) for s in report["sizes"]] == [(8, "ran"), (32, "ran"), (64, "ran"), (128, "skipped_memory")]
    assert report["sizes"][3]["projected_free_bytes"] == pytest.approx(16 * GIB - GIB - 128 * 100 * MIB)  # 2.5 GiB < 3
    assert report["max_replicas"] == 64 and report["projected_max_replicas"] == 122  # (16 - 3 - 1) GiB / 100 MiB
    saved = json.loads((tmp_path / "control.json").read_text())
    assert saved["max_replicas"] == 64 and len(saved["points"]) == 9 and (tmp_path / "control.png").exists()
    assert not saved["goal"]["met"] and saved["goal"]["replicas"] == 64
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("RESULT decisions_per_s_max=450.0 route_p99_ms_at_max=8.00 replicas_at_max=64 max_replicas_on_this_machine=64 "
                    "per_replica_rss_mib=100.0 saturated_at_concurrency=none") == saved["result"]


@pytest.mark.usefixtures("sixteen_gib")
def test_a_size_that_does_not_start_ends_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(control, "_run_size", fake_size({8: [100, 300, 310]}, fail_at=32))
    report = control.run(quick=False, out_dir=tmp_path)
    assert [s["status"] for s in report["sizes"]] == ["ran", "failed", "not_tried", "not_tried"]
    assert "3 of 32" in report["sizes"][1]["error"]
    assert report["max_replicas"] == 8 and report["result"].endswith("saturated_at_concurrency=32")


@pytest.mark.usefixtures("sixteen_gib")
def test_a_size_that_started_but_failed_its_turns_is_not_one_the_machine_holds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rates = {8: [100, 300], 32: [50, 50]}
    monkeypatch.setattr(control, "_run_size", fake_size(rates, all_fail_at=32))
    report = control.run(quick=True, out_dir=tmp_path)
    assert [(s["replicas"], s["status"], s["served"]) for s in report["sizes"]] == [(8, "ran", True), (32, "ran", False)]
    assert report["max_replicas"] == 8 and "max_replicas_on_this_machine=8 " in report["result"]


@pytest.mark.usefixtures("sixteen_gib")
def test_nothing_ran(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(control, "_run_size", fake_size({}, fail_at=8))
    report = control.run(quick=True, out_dir=tmp_path)
    assert report["max_replicas"] is None and report["result"].startswith("RESULT decisions_per_s_max=nan")
    assert not (tmp_path / "control.png").exists() and (tmp_path / "control.json").exists()


def test_inf_is_written_as_a_string() -> None:
    assert control._jsonable({"a": [float("inf"), 1.0], 2: (None,)}) == {"a": ["inf", 1.0], "2": [None]}
