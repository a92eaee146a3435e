"""The multi-node bench's pure parts: which raylet is a worker node's, which processes belong to
a node, and the per-cycle figures (lost turns, recovery of the conversations pinned to the killed
node's decoder) — baton/bench/ray_nodes.py and multinode_stats.py."""
from __future__ import annotations

import math

import pytest

from baton.bench.multinode_stats import CycleStats, TurnRecord, cycle_stats, result_line
from baton.bench.ray_nodes import WorkerNode, find_raylet, node_processes

RAYLET = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet"


def processes() -> dict[int, tuple[int, str]]:
    return {
        10: (1, f"{RAYLET} --raylet_socket_name=/tmp/s/sockets/raylet --static_resource_list=prefill_slot,1,decode_slot,1,CPU,1"),
        20: (1, f"{RAYLET} --raylet_socket_name=/tmp/s/sockets/raylet.1 --static_resource_list=decode_slot,1,baton_node_worker1,1,CPU,1"),
        21: (20, "ray::ServeReplica:baton:decode"),  # Ray rewrote the worker's title
        22: (20, "python agent.py"),
        23: (21, "a child of the replica"),
        11: (10, "ray::ServeReplica:baton:prefill"),
        30: (1, "vim notes --static_resource_list=baton_node_worker1,1"),  # not a raylet
    }


def test_the_worker_raylet_is_found_by_its_marker_resource_only() -> None:
    assert find_raylet(processes(), "baton_node_worker1") == 20
    assert find_raylet(processes(), "baton_node_worker2") is None
    assert find_raylet(processes(), "1") is None  # an amount is not a resource name


def test_a_node_is_its_raylet_and_its_descendants() -> None:
    assert node_processes(processes(), 20) == {20, 21, 22, 23}
    assert node_processes(processes(), 10) == {10, 11}  # not the other node's processes
    assert node_processes(processes(), 99) == set()


def test_a_worker_node_starts_with_its_marker_and_refuses_bad_names() -> None:
    cmd = WorkerNode("w1", num_cpus=1, resources={"decode_slot": 1}).start_command("ray", "127.0.0.1:6379", "/tmp/x")
    assert "--address=127.0.0.1:6379" in cmd and '--resources={"decode_slot": 1, "baton_node_w1": 1}' in cmd
    assert "--temp-dir=/tmp/x" in cmd
    for bad in ("W1", "1w", "w-1", ""):
        with pytest.raises(ValueError):
            WorkerNode(bad, num_cpus=1)


def turn(conv: str, started: float, ended: float, replica: str | None, *, ok: bool = True, attempts: int = 1) -> TurnRecord:
    return TurnRecord(conv, started, ended, ok, not ok, attempts, replica if ok else None, None)


def stats(turns: list[TurnRecord], killed_at: float = 10.0) -> CycleStats:
    return cycle_stats(0, turns, killed_at, "victim", conversations=2, on_worker=1, cross_node_handoffs=1, cross_node_bytes=100,
                       resumed_streams=1, leftover_processes=0, rejoin_s=30.0)


def test_recovery_is_from_the_kill_to_the_first_ok_turn_elsewhere() -> None:
    turns = [turn("a", 0, 4, "victim"), turn("a", 4, 9, "victim"), turn("a", 9, 14, "victim", ok=False, attempts=2),
             turn("a", 14, 16.5, "other"), turn("a", 16.5, 18, "other"),
             turn("b", 0, 5, "other"), turn("b", 5, 12, "other")]
    s = stats(turns)
    assert s.lost == 1 and s.retried == 1 and s.turns == 7 and s.turns_after_kill == 4
    assert s.moved == 1 and s.recovery_s == pytest.approx(6.5)
    assert s.max_turn_s_after == pytest.approx(7.0) and s.p50_turn_s_before == pytest.approx(5.0)


def test_a_pinned_conversation_that_never_answers_elsewhere_has_infinite_recovery() -> None:
    s = stats([turn("a", 0, 9, "victim"), turn("a", 9, 20, None, ok=False, attempts=2)])
    assert s.moved == 0 and math.isinf(s.recovery_s) and s.lost == 1
    assert "recovery_s_max=inf" in result_line([s]) and "lost_turns=1" in result_line([s])


def test_a_cycle_whose_victim_held_nothing_tested_nothing() -> None:
    s = stats([turn("b", 0, 9, "other"), turn("b", 9, 12, "other")])
    assert math.isnan(s.recovery_s)
    assert "recovery_s_max=nan" in result_line([s, stats([turn("a", 0, 9, "victim"), turn("a", 9, 11, "other")])])
