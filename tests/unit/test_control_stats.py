"""baton/bench/control_stats.py: a point's figures count failures as +inf, the saturation knee,
the memory projection that decides which fleet sizes run, the goal and the RESULT line."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from baton.bench.control_stats import (
    GIB,
    MIB,
    TurnSample,
    fits,
    goal_verdict,
    live_decode_replicas,
    mem_available_bytes,
    memory_model,
    projected_ceiling,
    projected_free_bytes,
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
        "per_replica_rss_mib=150.2 saturated_at_concurrency=32")
    assert result_line(points[3:], 32, MIB).split()[2] == "route_p99_ms_at_max=inf"  # 99/s at 32 replicas with one failure
    assert result_line(points[:2], 8, MIB).endswith("saturated_at_concurrency=none")


def test_result_line_without_points() -> None:
    assert result_line([], None, None) == (
        "RESULT decisions_per_s_max=nan route_p99_ms_at_max=nan replicas_at_max=nan max_replicas_on_this_machine=nan "
        "per_replica_rss_mib=nan saturated_at_concurrency=nan")


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


def test_process_cpu_seconds_counts_this_process_work() -> None:
    import os

    from baton.bench.cluster import process_cpu_seconds

    before = process_cpu_seconds([os.getpid()])
    x = 0
    for i in range(3_000_000):
        x += i * i
    assert process_cpu_seconds([os.getpid()]) > before >= 0
    assert process_cpu_seconds([2**22 + 7]) == 0  # a pid that does not exist counts nothing
