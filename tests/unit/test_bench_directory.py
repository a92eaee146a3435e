"""`baton bench directory` on a tiny grid: every point timed, the state sound after it, the JSON,
the plot and the RESULT line written from the points."""
from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest

from baton.bench import directory

real_measure = directory.directory_reports.measure


def test_a_tiny_grid_runs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(directory, "grid", lambda quick: directory.Grid(replicas=(2, 4), pins=(20, 60), calls=5))
    monkeypatch.setattr(directory, "REPEATS", 3)
    monkeypatch.setattr(directory, "REPORT_CALLS", 4)
    monkeypatch.setattr(directory, "CLAIM_CONVERSATIONS_QUICK", 40)
    monkeypatch.setattr(directory.directory_adoption, "HELD", 300)
    monkeypatch.setattr(directory.directory_gc, "CALLS", 2000)
    monkeypatch.setattr(directory.directory_reports, "measure",
                        lambda shards, calls, repeats: real_measure(shards, calls, repeats, held=40))
    report = directory.run(True, tmp_path)
    saved = json.loads((tmp_path / "directory.json").read_text())
    assert (tmp_path / "directory.png").exists() and saved["result"] == report["result"]
    assert [(p["replicas"], p["pins"]) for p in saved["points"]] == [(2, 20), (2, 60), (4, 20), (4, 60)]
    for p in saved["points"]:
        for what in ("route_new", "route_pinned", "sync"):
            t = p[what]
            assert 0 < t["min_us"] <= t["median_us"] <= t["max_us"]
    fields = dict(kv.split("=") for kv in report["result"].split()[1:])
    assert set(fields) == {"route_new_us_at_4", "route_pinned_us_at_4", "ceiling_new_per_s_at_4", "pins_growth", "replicas_growth",
                           "report_us_complete_shards2", "report_us_delta_shards2", "durable_new_per_s_one_by_one_c64",
                           "durable_new_per_s_group_c64", "durable_new_speedup_c64", "pinned_p99_ms_one_by_one_c64",
                           "pinned_p99_ms_group_c64", "durable_lifecycle_per_s_one_by_one_c64", "durable_lifecycle_per_s_group_c64",
                           "durable_lifecycle_speedup_c64", "pinned_p99_ms_lifecycle_one_by_one_c64",
                           "pinned_p99_ms_lifecycle_group_c64", "adoption_ms_one_by_one_d8", "adoption_ms_lookup_d8",
                           "adoption_stall_ms_one_by_one_d8", "adoption_stall_ms_lookup_d8", "gc_gen2_max_ms_default",
                           "gc_gen2_max_ms_frozen", "route_max_ms_gc_default", "route_max_ms_gc_frozen"}
    collector = saved["collector"]["runs"]
    assert [r["mode"] for r in collector] == ["default", "frozen"] * 3 and all(r["calls"] == 2000 for r in collector)
    assert all(r["frozen_objects"] == 0 for r in collector if r["mode"] == "default")
    assert all(r["frozen_objects"] > 1000 for r in collector if r["mode"] == "frozen")  # at least the imported modules'
    assert gc.get_freeze_count() > 0  # the phase leaves the heap frozen, as the directories built before it did
    adoption = saved["restart_adoption"]
    assert adoption["held"] == 300 and [r["mode"] for r in adoption["runs"]] == ["one_by_one", "lookup"] * 3
    assert all(r["held"] == 300 and r["probes"] >= 1 and r["adopt_ms"] > 0 for r in adoption["runs"])  # each run checked all 2,400 adopted
    runs = saved["durable_claims"]["runs"]
    assert len(runs) == 3 * 2 * 2 * 3 and all(r["conversations"] == 40 and r["probes"] >= 1 for r in runs)
    for workload, writes in (("open", 40), ("open_end", 80)):
        group = [r for r in runs if r["mode"] == "group" and r["workload"] == workload]
        assert all(r["flushes"] == writes for r in group if r["callers"] == 1)  # one caller: nothing to share a write with
        assert all(r["flushes"] < writes for r in group if r["callers"] == 64)  # a burst: writes share transactions
    assert all(r["flushes"] is None for r in runs if r["mode"] == "one_by_one")
    assert [(r["shards"], r["held"]) for r in saved["reports"]] == [(1, 40), (2, 40)]
    assert all(0 < r["complete_us"][1] <= r["complete_us"][0] <= r["complete_us"][2] for r in saved["reports"])
    assert all(math.isfinite(float(v)) and float(v) >= 0 for v in fields.values())  # a gen-2 pause is 0.0 when none ran
    assert all(float(v) > 0 for k, v in fields.items() if not k.startswith("gc_gen2"))
    assert capsys.readouterr().out.strip().endswith(report["result"])


def test_the_growth_figures_are_the_ratios_of_the_named_points() -> None:
    def pt(r: int, pins: int, us: float) -> directory.Point:
        t = directory.Timed(us, us, us)
        return directory.Point(r, pins, t, t, t)

    reports = [directory.ReportCost(1, 4096, (900.0, 1, 1), (8.0, 1, 1), 1, 1), directory.ReportCost(2, 4096, (3000.0, 1, 1), (12.5, 1, 1), 1, 1)]
    line = directory.result_line([pt(8, 10, 50.0), pt(8, 1000, 55.0), pt(128, 10, 400.0), pt(128, 1000, 1200.0)], reports)
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert fields == {"route_new_us_at_128": "1200.0", "route_pinned_us_at_128": "1200.0", "ceiling_new_per_s_at_128": "833",
                      "pins_growth": "3.000", "replicas_growth": "8.000", "report_us_complete_shards2": "3000.0",
                      "report_us_delta_shards2": "12.5"}


def test_the_report_phase_sends_deltas_in_order_and_they_are_a_fraction_of_the_list() -> None:
    cost = directory.directory_reports.measure(2, calls=5, repeats=3, held=400)  # raises if an in-order delta asked for the list
    assert cost.delta_bytes * 10 < cost.complete_bytes and cost.held == 400


def test_the_state_it_times_holds_the_pins_and_replicas_asked() -> None:
    state = directory.build_state(3, 25)
    assert state.snapshot(2.0)["live_pins"] == 25 and len(state.live("decode", 2.0)) == 3
    state.check_integrity()


def test_the_durable_claim_fields_compare_the_modes_at_the_most_callers() -> None:
    def pt(mode: str, callers: int, per_s: float, p99: float, workload: str = "open") -> directory.directory_claims.ClaimPoint:
        return directory.directory_claims.ClaimPoint(workload, mode, callers, (per_s, per_s, per_s), (p99, p99, p99), p99 / 2, None)

    line = directory.directory_claims.result_fields([pt("one_by_one", 1, 900.0, 1.0), pt("group", 1, 700.0, 0.5),
                                                     pt("one_by_one", 16, 1000.0, 20.0), pt("group", 16, 4000.0, 2.0)])
    assert dict(kv.split("=") for kv in line.split()) == {
        "durable_new_per_s_one_by_one_c16": "1000", "durable_new_per_s_group_c16": "4000", "durable_new_speedup_c16": "4.00",
        "pinned_p99_ms_one_by_one_c16": "20.00", "pinned_p99_ms_group_c16": "2.00"}
    line = directory.directory_claims.result_fields([pt("one_by_one", 8, 500.0, 30.0, "open_end"), pt("group", 8, 1500.0, 3.0, "open_end")])
    assert dict(kv.split("=") for kv in line.split()) == {
        "durable_lifecycle_per_s_one_by_one_c8": "500", "durable_lifecycle_per_s_group_c8": "1500", "durable_lifecycle_speedup_c8": "3.00",
        "pinned_p99_ms_lifecycle_one_by_one_c8": "30.00", "pinned_p99_ms_lifecycle_group_c8": "3.00"}
