"""Segment-connector counters (kv_transfer/segment_stats.py) and how a replica publishes them
(deployments/metrics.py). No vLLM, no engine."""
from __future__ import annotations

import threading
from dataclasses import fields

import pytest

from deployments.metrics import SEGMENT_COUNTERS, segment_increments
from kv_transfer.segment_stats import SegmentCounters, SegmentStats, new_counters, segment_stats


def test_stats_invariants_are_checked() -> None:
    with pytest.raises(ValueError, match="negative"):
        SegmentStats(load_failures=-1)
    with pytest.raises(ValueError, match="injected tokens"):
        SegmentStats(injections=2, injected_tokens=1)
    with pytest.raises(ValueError, match="2 prepared and 0 background loads"):
        SegmentStats(injections=1, injected_tokens=4, prepared_loads=2)
    with pytest.raises(ValueError, match="0 prepared and 3 background loads"):
        SegmentStats(injections=2, injected_tokens=4, background_loads=3)
    s = SegmentStats(injections=1, injected_tokens=4, load_seconds=0.5, captures=2)
    assert s + s == SegmentStats(injections=2, injected_tokens=8, load_seconds=1.0, captures=4)
    assert (s + s) - s == s
    with pytest.raises(ValueError):  # not an earlier snapshot: the difference would be negative
        SegmentStats() - s


def test_counters_count_each_kind_of_work() -> None:
    c = SegmentCounters()
    c.injected(5, 0.25)
    c.injected(3, 0.5, prepared=True)
    c.load_failed()
    c.refused()
    c.refused()
    c.captured()
    c.capture_failed()
    assert c.snapshot() == SegmentStats(injections=2, injected_tokens=8, load_seconds=0.75, prepared_loads=1,
                                        load_failures=1, unavailable=2, captures=1, capture_failures=1)
    with pytest.raises(ValueError, match="at least one token"):
        c.injected(0, 0.1)
    assert c.snapshot().injections == 2  # a refused count changes nothing


def test_counters_are_safe_under_threads() -> None:
    c = SegmentCounters()

    def work() -> None:
        for _ in range(500):
            c.injected(2, 0.0)
            c.captured()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.snapshot() == SegmentStats(injections=2000, injected_tokens=4000, captures=2000)


def test_segment_stats_sums_every_side_built_in_this_process() -> None:
    before = segment_stats()
    scheduler_side, worker_side = new_counters(), new_counters()
    scheduler_side.refused()
    worker_side.injected(7, 0.125)
    worker_side.captured()
    assert segment_stats() - before == SegmentStats(injections=1, injected_tokens=7, load_seconds=0.125,
                                                    unavailable=1, captures=1)
    unlisted = SegmentCounters()  # counters not taken from new_counters() are nobody's business
    unlisted.injected(100, 1.0)
    assert segment_stats() - before == SegmentStats(injections=1, injected_tokens=7, load_seconds=0.125,
                                                    unavailable=1, captures=1)


def test_report_names_every_counter() -> None:
    report = SegmentStats(injections=1, injected_tokens=3, unavailable=2).as_report()
    assert report["segment_injections"] == 1 and report["segment_injected_tokens"] == 3
    assert report["segment_unavailable"] == 2 and report["segment_load_failures"] == 0
    assert set(report) == {f"segment_{f.name}" for f in fields(SegmentStats)}


def test_every_counter_has_a_metric_and_increments_only_grow() -> None:
    assert set(SEGMENT_COUNTERS) == {f.name for f in fields(SegmentStats)}
    first = SegmentStats(injections=2, injected_tokens=10, load_seconds=0.5)
    assert segment_increments(SegmentStats(), first) == {"injections": 2.0, "injected_tokens": 10.0, "load_seconds": 0.5}
    later = SegmentStats(injections=3, injected_tokens=12, load_seconds=0.5, load_failures=1)
    assert segment_increments(first, later) == {"injections": 1.0, "injected_tokens": 2.0, "load_failures": 1.0}
    assert segment_increments(later, later) == {}
    with pytest.raises(ValueError):
        segment_increments(later, first)  # totals never go down


def test_memory_pull_metrics_publish_increments_and_never_zero(monkeypatch):
    from ray.serve import metrics as serve_metrics

    from deployments.metrics import MEMORY_PULL_COUNTERS, ServeMemoryPullMetrics

    incs: list[tuple[str, float]] = []

    class Counter:
        def __init__(self, name: str, description: str = "") -> None:
            self.name = name

        def inc(self, value: float = 1.0) -> None:
            if value <= 0:
                raise ValueError("value must be >0")  # as Ray's counter does
            incs.append((self.name, value))

    monkeypatch.setattr(serve_metrics, "Counter", Counter)
    m = ServeMemoryPullMetrics()
    zero = dict.fromkeys(MEMORY_PULL_COUNTERS, 0)
    m.publish(zero)
    m.publish({**zero, "pulled_segments": 3, "pulled_bytes": 300})
    m.publish({**zero, "pulled_segments": 5, "pulled_bytes": 300, "pull_failures": 1})
    assert incs == [("baton_memory_pulled_segments", 3), ("baton_memory_pulled_bytes", 300),
                    ("baton_memory_pulled_segments", 2), ("baton_memory_pull_failures", 1)]
