"""baton/bench/control.py's orchestration with the cluster faked out: each size runs once per variant
in alternating order, sizes that would leave < 3 GiB are skipped from the first run's memory
model, a run that fails to start ends the sweep, control.json, control.png and the RESULT line
come from what ran (the headline from pin_cache, compared with no_pin_cache; throughput_optimized
beside it), and a point's CPU
per turn is its window's CPU by role over its ok turns."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from baton.bench import control
from baton.bench.control_config import NO_PIN_CACHE, PIN_CACHE, THROUGHPUT_OPTIMIZED, Sweep, Variant
from baton.bench.control_cpu import ProcReading
from baton.bench.control_load import PointLoad
from baton.bench.control_stats import GIB, MIB, MemoryModel, PointStats, TurnSample, summarize_point

MODEL = MemoryModel(per_replica_bytes=100 * MIB, base_bytes=1 * GIB)


def fake_size(rates: dict[int, list[float]], fail_at: int | None = None, all_fail_at: int | None = None,
              calls: list[tuple[int, str]] | None = None) -> Any:
    """_run_size without a cluster: `rates` are pin_cache's ok turns/s per concurrency, no_pin_cache
    gets half of them and a route hop twice as long, throughput_optimized 1.5 times them; every
    point costs 0.5 ms of CPU per turn."""
    def run_size(n: int, variant: Variant, sw: Sweep, out_dir: Path,
                 available: int) -> tuple[dict[str, Any], list[PointStats], MemoryModel]:
        if calls is not None:
            calls.append((n, variant.name))
        if n == fail_at:
            raise RuntimeError(f"only 3 of {n} decode replicas live")
        off = variant == NO_PIN_CACHE
        scale = 0.5 if off else 1.5 if variant == THROUGHPUT_OPTIMIZED else 1.0
        turn = TurnSample(ok=n != all_fail_at, started_s=0.0, latency_s=0.01, ttft_s=0.01,
                          hops={"route": 0.001 * n / 8 * (2 if off else 1), "total": 0.005}, error=None if n != all_fail_at else "timeout")
        points = [replace(summarize_point(n, c, [turn] * int(r * scale), 1.0, variant=variant.name),
                          cpu_ms_per_turn={"decode": 0.5}, cpu_ms_per_turn_total=0.5)
                  for c, r in zip(sw.concurrencies, rates[n], strict=True)]
        return {"replicas": n, "status": "ran", "saturated_at_concurrency": None}, points, MODEL
    return run_size


@pytest.fixture
def sixteen_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "_available", lambda: 16 * GIB)


@pytest.mark.usefixtures("sixteen_gib")
def test_sizes_past_the_memory_projection_are_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rates = {8: [100, 300, 310], 32: [90, 280, 400], 64: [80, 250, 450]}
    calls: list[tuple[int, str]] = []
    monkeypatch.setattr(control, "_run_size", fake_size(rates, calls=calls))
    report = control.run(quick=False, out_dir=tmp_path)
    # every variant at every size, their order reversed from one size to the next
    off, on, fast = "no_pin_cache", "pin_cache", "throughput_optimized"
    assert calls == [(8, off), (8, on), (8, fast), (32, fast), (32, on), (32, off), (64, off), (64, on), (64, fast)]
    assert [(s["replicas"], s["variant"], s["status"]) for s in report["sizes"]] == [
        *((n, v, "ran") for n, v in calls), (128, fast, "skipped_memory"), (128, on, "skipped_memory"), (128, off, "skipped_memory")]
    assert report["sizes"][9]["projected_free_bytes"] == pytest.approx(16 * GIB - GIB - 128 * 100 * MIB)  # 2.5 GiB < 3
    assert report["max_replicas"] == 64 and report["projected_max_replicas"] == 122  # (16 - 3 - 1) GiB / 100 MiB
    saved = json.loads((tmp_path / "control.json").read_text())
    assert saved["max_replicas"] == 64 and len(saved["points"]) == 27 and (tmp_path / "control.png").exists()
    assert sorted({p["variant"] for p in saved["points"]}) == [off, on, fast]
    assert all(s["variant"] in (off, on, fast) for s in saved["sizes"])
    assert all(p["cpu_ms_per_turn"] == {"decode": 0.5} and p["cpu_ms_per_turn_total"] == 0.5 for p in saved["points"])
    assert saved["best"]["variant"] == "pin_cache"
    assert not saved["goal"]["met"] and saved["goal"]["replicas"] == 64
    assert saved["goal_throughput_optimized"]["decisions_per_s"] == 675.0  # 1.5 x 450, route p99 8 ms within the bound
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("RESULT decisions_per_s_max=450.0 route_p99_ms_at_max=8.00 replicas_at_max=64 max_replicas_on_this_machine=64 "
                    "per_replica_rss_mib=100.0 saturated_at_concurrency=none decisions_per_s_ratio_pin_cache=2.000 "
                    "route_p50_ms_at_max=8.00 route_p50_ms_no_pin_cache=16.00 cpu_ms_per_turn_at_max=0.500 "
                    "decisions_per_s_max_throughput_optimized=675.0 route_p99_ms_throughput_optimized=8.00 "
                    "cpu_ms_per_turn_throughput_optimized=0.500 decisions_per_s_ratio_throughput_optimized=1.500 "
        "directory_ceiling_throughput_optimized=nan decisions_per_s_max_sharded_directory=nan directory_ceiling_sharded_directory=nan "
        "directory_ceiling_ratio_sharded=nan decisions_per_s_max_sharded_relay=nan directory_ceiling_sharded_relay=nan "
        "directory_ceiling_ratio_relay=nan") == saved["result"]


@pytest.mark.usefixtures("sixteen_gib")
def test_a_size_that_does_not_start_ends_the_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(control, "_run_size", fake_size({8: [100, 300, 310]}, fail_at=32))
    report = control.run(quick=False, out_dir=tmp_path)
    off, on, fast = "no_pin_cache", "pin_cache", "throughput_optimized"
    assert [(s["replicas"], s["variant"], s["status"]) for s in report["sizes"]] == [
        (8, off, "ran"), (8, on, "ran"), (8, fast, "ran"), (32, fast, "failed"), (32, on, "not_tried"), (32, off, "not_tried"),
        (64, off, "not_tried"), (64, on, "not_tried"), (64, fast, "not_tried"),
        (128, fast, "not_tried"), (128, on, "not_tried"), (128, off, "not_tried")]
    assert "3 of 32" in report["sizes"][3]["error"]
    assert report["max_replicas"] == 8 and " saturated_at_concurrency=32 " in report["result"]


@pytest.mark.usefixtures("sixteen_gib")
def test_a_size_that_started_but_failed_its_turns_is_not_one_the_machine_holds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rates = {8: [100, 300], 32: [50, 50]}
    monkeypatch.setattr(control, "_run_size", fake_size(rates, all_fail_at=32))
    report = control.run(quick=True, out_dir=tmp_path)
    assert [(s["replicas"], s["status"], s["served"]) for s in report["sizes"]] == [
        (8, "ran", True), (8, "ran", True), (8, "ran", True), (32, "ran", False), (32, "ran", False), (32, "ran", False)]
    assert report["max_replicas"] == 8 and "max_replicas_on_this_machine=8 " in report["result"]


@pytest.mark.usefixtures("sixteen_gib")
def test_the_machine_holds_what_any_variant_served_and_the_goal_is_judged_where_pin_cache_served(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rates = {8: [100, 300], 32: [200, 400]}
    run_size = fake_size(rates)

    def pin_cache_fails_at_32(n: int, variant: Variant, *rest: Any) -> Any:
        return fake_size(rates, all_fail_at=32)(n, variant, *rest) if variant == PIN_CACHE else run_size(n, variant, *rest)

    monkeypatch.setattr(control, "_run_size", pin_cache_fails_at_32)
    report = control.run(quick=True, out_dir=tmp_path)
    assert report["max_replicas"] == 32  # the other variants served 32 replicas: the machine held them
    assert report["goal"]["replicas"] == 8 and report["goal_throughput_optimized"]["replicas"] == 32
    assert "decisions_per_s_max=300.0 " in report["result"] and "replicas_at_max=8 " in report["result"]


@pytest.mark.usefixtures("sixteen_gib")
def test_nothing_ran(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(control, "_run_size", fake_size({}, fail_at=8))
    report = control.run(quick=True, out_dir=tmp_path)
    assert report["max_replicas"] is None and report["result"].startswith("RESULT decisions_per_s_max=nan")
    assert not (tmp_path / "control.png").exists() and (tmp_path / "control.json").exists()


def test_inf_and_nan_are_written_as_strings() -> None:
    assert control._jsonable({"a": [float("inf"), 1.0, -math.inf], 2: (None, math.nan)}) == {"a": ["inf", 1.0, "-inf"], "2": [None, "nan"]}


def test_runs_alternate_the_variant_order() -> None:
    off, on, fast = NO_PIN_CACHE, PIN_CACHE, THROUGHPUT_OPTIMIZED
    assert control._runs((8, 32, 64)) == [(8, off), (8, on), (8, fast), (32, fast), (32, on), (32, off), (64, off), (64, on), (64, fast)]


def test_a_points_cpu_is_its_windows_per_ok_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    start = {1: ProcReading("decode", 1, 10.0), 2: ProcReading("proxy", 1, 4.0), 3: ProcReading("directory", 1, 1.0)}
    end = {1: ProcReading("decode", 1, 10.3), 2: ProcReading("proxy", 1, 4.1)}  # the directory exited
    monkeypatch.setattr(control, "read_snapshot", lambda: start)
    monkeypatch.setattr(control, "read_again", lambda pids: end if pids is start else {})
    window = control._WindowCpu()
    window("start")
    window("end")
    assert window.start is start and window.end is end
    good = TurnSample(ok=True, started_s=0.0, latency_s=0.01)
    bad = TurnSample(ok=False, started_s=0.0, latency_s=0.01, error="timeout")
    load = PointLoad(turns=[good] * 100 + [bad] * 20, elapsed_s=1.0, warmup_turns=5, warmup_failures=0,
                     client_cpu_s=0.5, window_client_cpu_s=0.05)
    point, cpu = control._measured(8, 32, NO_PIN_CACHE, load, window)
    assert point.variant == "no_pin_cache" and point.decisions_per_s == 100.0
    assert point.cpu_ms_per_turn == pytest.approx({"proxy": 1.0, "ingress": 0.0, "directory": 0.0, "decode": 3.0, "ray_other": 0.0,
                                                   "client": 0.5})  # over the 100 ok turns, the window's client CPU only
    assert point.cpu_ms_per_turn_total == pytest.approx(4.5) and cpu.missing == 1
    assert "directory 0.000" in control._cpu_line(cpu) and "1 processes gone" in control._cpu_line(cpu)
