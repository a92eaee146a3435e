"""baton/bench/control_stats.py: a point's figures count failures as +inf, the saturation knee,
the memory projection that decides which fleet sizes run, the goal and the RESULT line (both read
the pin_cache variant; no_pin_cache is its comparison, nan where it is missing)."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from baton.bench.control_stats import (
    GIB,
    MIB,
    TurnSample,
    best_point,
    counterpart,
    fits,
    goal_verdict,
    live_decode_replicas,
    mem_available_bytes,
    memory_model,
    projected_ceiling,
    projected_free_bytes,
    ratio,
    result_line,
    saturation_concurrency,
    summarize_point,
)

HOPS = {"parse": 0.001, "route": 0.002, "to_replica": 0.0005, "replica": 0.0005, "engine": 0.003, "from_replica": 0.0005, "total": 0.0075}


def ok(latency: float = 0.010, route: float = 0.002, ttft: float = 0.009) -> TurnSample:
    return TurnSample(ok=True, started_s=0.0, latency_s=latency, ttft_s=ttft, hops={**HOPS, "route": route}, status=200)


def failed(reason: str = "http_503") -> TurnSample:
    return TurnSample(ok=False, started_s=0.0, latency_s=0.001, status=503, error=reason)


def test_all_ok_point() -> None:
    p = summarize_point(8, 4, [ok(latency=0.010 + i / 1000) for i in range(11)], elapsed_s=2.0)
    assert p.turns == 11 and p.failures == 0 and p.decisions_per_s == pytest.approx(5.5)
    assert p.latency_p50_s == pytest.approx(0.015) and p.latency_p99_s == pytest.approx(0.0199)
    assert p.route_p50_s == p.route_p99_s == pytest.approx(0.002)
    assert p.ingress_overhead_p50_s == pytest.approx(0.004)  # total - replica - engine
    assert p.outside_p50_s == pytest.approx(0.0015)  # ttft - total
    assert p.hops_p50_s["engine"] == pytest.approx(0.003) and p.errors == {}


def test_a_failure_is_counted_and_is_inf_at_the_ranks_it_reaches() -> None:
    turns = [ok() for _ in range(99)] + [failed()]
    p = summarize_point(32, 8, turns, elapsed_s=1.0)
    assert p.turns == 100 and p.failures == 1 and p.decisions_per_s == pytest.approx(99.0)  # only ok turns are decisions
    assert p.latency_p99_s == math.inf and p.route_p99_s == math.inf
    assert p.latency_p50_s == pytest.approx(0.010) and p.route_p50_s == pytest.approx(0.002)
    assert p.errors == {"http_503": 1}


def test_mostly_failed_point_has_inf_medians() -> None:
    p = summarize_point(8, 8, [ok(), failed("timeout"), failed("timeout")], elapsed_s=1.0)
    assert p.latency_p50_s == math.inf and p.ingress_overhead_p50_s == math.inf and p.errors == {"timeout": 2}


def test_a_turn_without_hops_has_no_overhead_and_no_route_sample() -> None:
    bare = TurnSample(ok=True, started_s=0.0, latency_s=0.01, ttft_s=0.01)
    assert bare.ingress_overhead_s is None and bare.outside_s is None
    p = summarize_point(8, 1, [bare], elapsed_s=1.0)
    assert p.route_p99_s is None and p.decisions_per_s == 1.0
    with pytest.raises(ValueError):
        summarize_point(8, 1, [bare], elapsed_s=0.0)


@pytest.mark.parametrize(("rates", "knee"), [
    ([100.0, 300.0, 320.0], 32),  # +7 % from 32 to 128: saturated at 32
    ([100.0, 105.0, 400.0], 8),  # the first flat step counts
    ([100.0, 200.0, 400.0], None),  # still growing
    ([100.0, 80.0, 50.0], 8),  # falling
])
def test_saturation_is_where_decisions_stop_growing_by_ten_percent(rates: list[float], knee: int | None) -> None:
    assert saturation_concurrency([8, 32, 128], rates) == knee


def test_saturation_sorts_by_concurrency_and_checks_lengths() -> None:
    assert saturation_concurrency([128, 8, 32], [320.0, 100.0, 300.0]) == 32
    assert saturation_concurrency([8], [100.0]) is None
    with pytest.raises(ValueError):
        saturation_concurrency([8, 32], [1.0])


def test_memory_model_projection_and_skip() -> None:
    idle = 20 * GIB
    running = idle - 8 * 100 * MIB - 1 * GIB  # eight 100 MiB replicas + 1 GiB of Ray, Serve, ingress, directory
    m = memory_model([100 * MIB] * 8, idle, running)
    assert m.per_replica_bytes == 100 * MIB and m.base_bytes == pytest.approx(GIB)
    assert projected_free_bytes(m, 128, idle) == pytest.approx(idle - GIB - 128 * 100 * MIB)
    assert fits(m, 128, idle)  # 6.5 GiB left
    assert not fits(m, 128, 16 * GIB)  # 2.5 GiB left < 3 GiB
    assert fits(m, 128, 16 * GIB, reserve_bytes=2 * GIB)
    assert projected_ceiling(m, idle) == math.floor((16 * GIB) / (100 * MIB))  # 20 - 3 reserve - 1 base
    assert projected_ceiling(m, 2 * GIB) == 0


def test_memory_model_never_has_a_negative_base_and_needs_rss() -> None:
    assert memory_model([100 * MIB] * 4, 10 * GIB, 10 * GIB).base_bytes == 0.0  # other processes freed memory meanwhile
    with pytest.raises(ValueError):
        memory_model([], 10 * GIB, 9 * GIB)


def test_goal_verdict_reads_the_given_size_within_the_route_bound() -> None:
    fast = summarize_point(128, 8, [ok(route=0.002)] * 10, elapsed_s=0.004)  # 2500/s
    slow_route = summarize_point(128, 32, [ok(route=0.020)] * 10, elapsed_s=0.002)  # 5000/s but p99 20 ms
    g = goal_verdict([fast, slow_route], 128)
    assert g.met and g.concurrency == 8 and g.decisions_per_s == pytest.approx(2500)
    assert not goal_verdict([slow_route], 128).met and goal_verdict([slow_route], 128).concurrency is None
    assert not goal_verdict([fast], 64).met  # nothing at that size


def test_result_line_is_computed_from_the_points() -> None:
    points = [summarize_point(8, 8, [ok()] * 100, elapsed_s=1.0), summarize_point(8, 32, [ok()] * 300, elapsed_s=1.0),
              summarize_point(8, 128, [ok()] * 310, elapsed_s=1.0),
              summarize_point(32, 8, [ok()] * 90, elapsed_s=1.0), summarize_point(32, 32, [ok()] * 99 + [failed()], elapsed_s=1.0)]
    assert result_line(points, 32, 150.25 * MIB) == (
        "RESULT decisions_per_s_max=310.0 route_p99_ms_at_max=2.00 replicas_at_max=8 max_replicas_on_this_machine=32 "
        "per_replica_rss_mib=150.2 saturated_at_concurrency=32 decisions_per_s_ratio_pin_cache=nan route_p50_ms_at_max=2.00 "
        "route_p50_ms_no_pin_cache=nan cpu_ms_per_turn_at_max=nan decisions_per_s_max_throughput_optimized=nan "
        "route_p99_ms_throughput_optimized=nan cpu_ms_per_turn_throughput_optimized=nan "
        "decisions_per_s_ratio_throughput_optimized=nan "
        "directory_ceiling_throughput_optimized=nan decisions_per_s_max_sharded_directory=nan directory_ceiling_sharded_directory=nan "
        "directory_ceiling_ratio_sharded=nan decisions_per_s_max_sharded_relay=nan directory_ceiling_sharded_relay=nan "
        "directory_ceiling_ratio_relay=nan")  # no no_pin_cache or throughput_optimized point, no CPU read: nan
    assert result_line(points[3:], 32, MIB).split()[2] == "route_p99_ms_at_max=inf"  # 99/s at 32 replicas with one failure
    assert " saturated_at_concurrency=none " in result_line(points[:2], 8, MIB)


def test_result_line_without_points() -> None:
    assert result_line([], None, None) == (
        "RESULT decisions_per_s_max=nan route_p99_ms_at_max=nan replicas_at_max=nan max_replicas_on_this_machine=nan "
        "per_replica_rss_mib=nan saturated_at_concurrency=nan decisions_per_s_ratio_pin_cache=nan route_p50_ms_at_max=nan "
        "route_p50_ms_no_pin_cache=nan cpu_ms_per_turn_at_max=nan decisions_per_s_max_throughput_optimized=nan "
        "route_p99_ms_throughput_optimized=nan cpu_ms_per_turn_throughput_optimized=nan "
        "decisions_per_s_ratio_throughput_optimized=nan "
        "directory_ceiling_throughput_optimized=nan decisions_per_s_max_sharded_directory=nan directory_ceiling_sharded_directory=nan "
        "directory_ceiling_ratio_sharded=nan decisions_per_s_max_sharded_relay=nan directory_ceiling_sharded_relay=nan "
        "directory_ceiling_ratio_relay=nan")


def both(n: int, c: int, on: int, off: int, off_route: float = 0.004) -> list:
    """A pin_cache point of `on` ok turns/s and the no_pin_cache one of `off` at the same (n, c)."""
    return [summarize_point(n, c, [ok()] * on, 1.0, variant="pin_cache"),
            summarize_point(n, c, [ok(route=off_route)] * off, 1.0, variant="no_pin_cache")]


def test_the_best_point_and_the_goal_read_the_pin_cache_variant() -> None:
    points = both(8, 8, 100, 900) + both(8, 32, 300, 950)  # no_pin_cache is faster: it must not be the headline
    best = best_point(points)
    assert best is not None and best.variant == "pin_cache" and best.concurrency == 32
    assert best_point(points, variant="no_pin_cache").decisions_per_s == 950.0  # type: ignore[union-attr]
    assert counterpart(points, best, "no_pin_cache") is points[3] and counterpart(points, best, "other") is None
    assert goal_verdict(points, 8).decisions_per_s == 300.0
    line = result_line(points, 8, MIB)
    assert "decisions_per_s_max=300.0 " in line and "saturated_at_concurrency=none " in line  # 100 -> 300 (not 900 -> 950)


def test_result_line_compares_the_variants_at_the_best_point() -> None:
    points = both(8, 8, 100, 90) + both(8, 32, 300, 200, off_route=0.005) + both(32, 32, 250, 50)
    points[2] = replace(points[2], cpu_ms_per_turn={"decode": 0.5, "client": 0.25}, cpu_ms_per_turn_total=0.75)
    fields = dict(kv.split("=") for kv in result_line(points, 32, MIB).split()[1:])
    assert fields["decisions_per_s_max"] == "300.0" and fields["replicas_at_max"] == "8"
    assert fields["decisions_per_s_ratio_pin_cache"] == "1.500"  # 300 / 200 at (8, 32), not 250 / 50 elsewhere
    assert fields["route_p50_ms_at_max"] == "2.00" and fields["route_p50_ms_no_pin_cache"] == "5.00"
    assert fields["cpu_ms_per_turn_at_max"] == "0.750"


def test_result_line_when_the_comparison_is_missing_or_zero() -> None:
    only_on = [summarize_point(8, 8, [ok()] * 100, 1.0),
               summarize_point(8, 32, [ok()] * 50, 1.0, variant="no_pin_cache")]  # another concurrency: no counterpart
    line = result_line(only_on, 8, MIB)
    assert "decisions_per_s_ratio_pin_cache=nan " in line and "route_p50_ms_no_pin_cache=nan " in line
    off_dead = [summarize_point(8, 8, [ok()] * 100, 1.0), summarize_point(8, 8, [failed()] * 10, 1.0, variant="no_pin_cache")]
    line = result_line(off_dead, 8, MIB)
    assert "decisions_per_s_ratio_pin_cache=inf " in line and "route_p50_ms_no_pin_cache=inf " in line  # every turn failed
    inf_cpu = [replace(summarize_point(8, 8, [ok()] * 100, 1.0), cpu_ms_per_turn_total=math.inf)]
    assert " cpu_ms_per_turn_at_max=inf " in result_line(inf_cpu, 8, MIB)


def test_ratio() -> None:
    assert ratio(3.0, 2.0) == 1.5 and ratio(1.0, 0.0) == math.inf and math.isnan(ratio(0.0, 0.0))


def test_a_point_carries_its_variant() -> None:
    assert summarize_point(8, 8, [ok()], 1.0).variant == "pin_cache"  # the default config
    p = summarize_point(8, 8, [ok()], 1.0, variant="no_pin_cache")
    assert p.variant == "no_pin_cache" and p.cpu_ms_per_turn == {} and math.isnan(p.cpu_ms_per_turn_total)  # CPU not read yet


def test_mem_available_and_live_replicas() -> None:
    assert mem_available_bytes("MemTotal: 100 kB\nMemFree: 5 kB\nMemAvailable:   2048 kB\n") == 2 * MIB
    assert mem_available_bytes(Path("/proc/meminfo").read_text()) > 0
    with pytest.raises(ValueError):
        mem_available_bytes("MemTotal: 1 kB\n")
    stats = {"replicas": {"a": {"pool": "decode", "live": True}, "b": {"pool": "decode", "live": False},
                          "c": {"pool": "prefill", "live": True}, "d": {"pool": "decode", "live": True}}}
    assert live_decode_replicas(stats) == 2 and live_decode_replicas({}) == 0


def test_a_size_serves_only_when_its_turns_mostly_completed() -> None:
    from baton.bench.control_stats import size_served

    ok = TurnSample(ok=True, started_s=0.0, latency_s=0.01, hops={"total": 0.005})
    bad = TurnSample(ok=False, started_s=0.0, latency_s=30.0, error="timeout")
    points = [summarize_point(8, 8, [ok] * 200, 1.0), summarize_point(8, 32, [ok] * 199 + [bad], 1.0),
              summarize_point(32, 8, [], 1.0), summarize_point(32, 32, [bad] * 52, 1.0),
              summarize_point(64, 8, [ok] * 90 + [bad] * 10, 1.0)]
    assert size_served(points, 8)  # 1 failure in 400 turns
    assert not size_served(points, 32)  # started, never completed a turn
    assert not size_served(points, 64)  # 10 % failed
    assert not size_served(points, 128)  # never ran


def test_the_machines_largest_size_counts_every_variant_that_served() -> None:
    from baton.bench.control_stats import largest_served

    sizes = [{"replicas": 8, "variant": "pin_cache", "status": "ran", "served": True},
             {"replicas": 32, "variant": "throughput_optimized", "status": "ran", "served": True},
             {"replicas": 64, "variant": "throughput_optimized", "status": "ran", "served": False},
             {"replicas": 128, "variant": "throughput_optimized", "status": "skipped_memory"}]
    assert largest_served(sizes) == 32  # the headline variant ran only at 8: the machine still held 32
    assert largest_served(sizes, "pin_cache") == 8
    assert largest_served(sizes, "sharded_directory") is None
    assert largest_served([]) is None


def test_process_cpu_seconds_counts_this_process_work() -> None:
    import os

    from baton.bench.cluster import process_cpu_seconds

    before = process_cpu_seconds([os.getpid()])
    x = 0
    for i in range(3_000_000):
        x += i * i
    assert process_cpu_seconds([os.getpid()]) > before >= 0
    assert process_cpu_seconds([2**22 + 7]) == 0  # a pid that does not exist counts nothing


def test_result_line_reports_the_throughput_optimized_variant_against_pin_cache_at_its_best_point() -> None:
    fast = [summarize_point(8, 8, [ok(route=0.001)] * 150, 1.0, variant="throughput_optimized"),
            summarize_point(8, 32, [ok(route=0.003)] * 400, 1.0, variant="throughput_optimized")]
    fast[1] = replace(fast[1], cpu_ms_per_turn={"ingress": 4.0}, cpu_ms_per_turn_total=4.0)
    points = both(8, 8, 100, 90) + both(8, 32, 320, 200) + fast
    fields = dict(kv.split("=") for kv in result_line(points, 8, MIB).split()[1:])
    assert fields["decisions_per_s_max"] == "320.0"  # the headline stays pin_cache's, faster variants beside it
    assert fields["decisions_per_s_max_throughput_optimized"] == "400.0" and fields["route_p99_ms_throughput_optimized"] == "3.00"
    assert fields["cpu_ms_per_turn_throughput_optimized"] == "4.000"
    assert fields["decisions_per_s_ratio_throughput_optimized"] == "1.250"  # 400 / 320 at (8, 32)
    assert goal_verdict(points, 8, variant="throughput_optimized").decisions_per_s == 400.0
    alone = dict(kv.split("=") for kv in result_line(fast, 8, MIB).split()[1:])  # no pin_cache point to compare with
    assert alone["decisions_per_s_ratio_throughput_optimized"] == "nan" and alone["decisions_per_s_max"] == "nan"


def test_the_directory_ceiling_is_shards_over_the_directory_s_cpu_per_turn() -> None:
    from baton.bench.control_config import SHARDED_DIRECTORY, THROUGHPUT_OPTIMIZED
    from baton.bench.control_stats import directory_ceiling

    def at(c: int, rate: int, directory_ms: float, variant: str) -> Any:
        p = summarize_point(8, c, [ok()] * rate, 1.0, variant=variant)
        return replace(p, cpu_ms_per_turn={"directory": directory_ms, "ingress": 4.0}, cpu_ms_per_turn_total=4.0 + directory_ms)

    one = at(8, 150, 0.8, "throughput_optimized")
    assert directory_ceiling(one, THROUGHPUT_OPTIMIZED) == pytest.approx(1250.0)  # one shard, 0.8 ms a turn: 1,250/s
    assert directory_ceiling(replace(one, cpu_ms_per_turn={"directory": 1.0}), SHARDED_DIRECTORY) == pytest.approx(2000.0)
    for unmeasured in ({}, {"directory": math.nan}, {"directory": 0.0}, {"directory": math.inf}):
        assert directory_ceiling(replace(one, cpu_ms_per_turn=unmeasured), THROUGHPUT_OPTIMIZED) is None
    assert directory_ceiling(None, THROUGHPUT_OPTIMIZED) is None
    points = [one, at(32, 140, 1.0, "throughput_optimized"), at(8, 145, 1.2, "sharded_directory"), at(32, 160, 1.25, "sharded_directory")]
    fields = dict(kv.split("=") for kv in result_line(points, 8, MIB).split()[1:])
    assert fields["directory_ceiling_throughput_optimized"] == "1250"  # its best point (c 8, 150/s)
    assert fields["decisions_per_s_max_sharded_directory"] == "160.0" and fields["directory_ceiling_sharded_directory"] == "1600"
    assert fields["directory_ceiling_ratio_sharded"] == "1.600"  # against throughput_optimized at (8, 32): 1600 / 1000
    assert fields["directory_ceiling_ratio_relay"] == "nan"  # no sharded_relay point
    points.append(at(32, 170, 1.0, "sharded_relay"))
    fields = dict(kv.split("=") for kv in result_line(points, 8, MIB).split()[1:])
    assert fields["decisions_per_s_max_sharded_relay"] == "170.0" and fields["directory_ceiling_sharded_relay"] == "2000"
    assert fields["directory_ceiling_ratio_relay"] == "1.250"  # over sharded_directory at the same (8, 32): 2000 / 1600
