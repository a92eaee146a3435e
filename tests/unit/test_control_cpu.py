"""baton/bench/control_cpu.py: processes grouped into roles from their cmdline bytes, the CPU of
one window per role and per ok turn (vanished and reused pids counted as missing, zero turns
inf or nan), and the /proc readers against stand-in processes of this test's own."""
from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from baton.bench.control_cpu import (
    ROLES,
    ProcReading,
    compact,
    cpu_per_turn,
    is_ray_process,
    parse_stat,
    per_turn_ms,
    read_again,
    read_snapshot,
    role_of,
)

SITE = b"/work/.venv/lib/python3.12/site-packages"


@pytest.mark.parametrize(("cmdline", "role"), [
    (b"ray::ProxyActor\0", "proxy"),
    (b"ray::ProxyActor.ready", "proxy"),
    (b"ray::ServeReplica:baton:ingress\0\0\0", "ingress"),
    (b"ray::ServeReplica:baton:ingress.handle_request_with_rejection", "ingress"),
    (b"ray::ServeReplica:baton:directory", "directory"),
    (b"ray::ServeReplica:baton:directory-3.handle_request", "directory"),  # a shard
    (b"ray::ServeReplica:baton:directory-", "ray_other"),
    (b"ray::ServeReplica:baton:directory-1x", "ray_other"),
    (b"ray::ServeReplica:baton:decode.handle_request_streaming", "decode"),
    (b"ray::ServeReplica:baton:decode", "decode"),
    (b"ray::ServeReplica:baton:prefill", "ray_other"),  # a deployment with no role of its own
    (b"ray::ServeReplica:baton:ingressx", "ray_other"),  # a longer name is not the ingress
    (b"ray::ServeReplica:other:ingress", "ray_other"),  # another application's ingress
    (b"ray::ServeController.listen_for_change", "ray_other"),
    (b"ray::IDLE", "ray_other"),
    (SITE + b"/ray/core/src/ray/raylet/raylet\0--raylet_socket_name=/tmp/bray-x/sockets/raylet", "ray_other"),
    (SITE + b"/ray/core/src/ray/gcs/gcs_server\0--gcs_server_port=26800", "ray_other"),
    (b"/work/.venv/bin/python\0-u\0" + SITE + b"/ray/dashboard/agent.py\0--raylet-name=x", "ray_other"),
    (b"/work/.venv/bin/python\0/work/.venv/bin/serve\0run\0/runs/x/serve_config.yaml", "ray_other"),
    (b"/work/.venv/bin/python\0/work/.venv/bin/baton\0bench\0control", None),  # the load generator: `client`, not from /proc
    (b"/usr/bin/python3\0-m\0pytest\0tests/unit", None),
    (b"bash\0-c\0serve run later", None),
    (b"", None),  # a kernel thread or a zombie
])
def test_role_of(cmdline: bytes, role: str | None) -> None:
    assert role_of(cmdline) == role
    assert is_ray_process(cmdline) == (role is not None)


def test_role_of_another_app() -> None:
    assert role_of(b"ray::ServeReplica:chat:decode", app="chat") == "decode"
    assert role_of(b"ray::ServeReplica:baton:decode", app="chat") == "ray_other"


def test_parse_stat_reads_past_a_command_name_with_spaces_and_parens() -> None:
    rest = ["S", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "250", "50", "0", "0", "20", "0", "9", "0", "123456", "0"]
    assert parse_stat(f"4242 (ray::Serve (x) y) {' '.join(rest)}") == (123456, 300)


def r(role: str, cpu_s: float, start: int = 1) -> ProcReading:
    return ProcReading(role=role, start_ticks=start, cpu_s=cpu_s)


def test_cpu_per_turn_sums_each_role_over_the_window() -> None:
    start = {1: r("proxy", 10.0), 2: r("ingress", 5.0), 3: r("directory", 1.0), 4: r("decode", 2.0), 5: r("decode", 3.0),
             6: r("ray_other", 7.0)}
    end = {1: r("proxy", 10.5), 2: r("ingress", 6.0), 3: r("directory", 1.1), 4: r("decode", 2.2), 5: r("decode", 3.3),
           6: r("ray_other", 7.05), 99: r("decode", 50.0)}  # 99 started during the window: not counted
    cpu = cpu_per_turn(start, end, client_cpu_s=0.4, ok_turns=1000)
    assert set(cpu.ms_per_turn) == set(ROLES)
    assert cpu.cpu_s == pytest.approx({"proxy": 0.5, "ingress": 1.0, "directory": 0.1, "decode": 0.5, "ray_other": 0.05, "client": 0.4})
    assert cpu.ms_per_turn == pytest.approx({"proxy": 0.5, "ingress": 1.0, "directory": 0.1, "decode": 0.5, "ray_other": 0.05,
                                             "client": 0.4})  # s / 1000 turns = ms per turn
    assert cpu.total_ms_per_turn == pytest.approx(2.55)
    assert cpu.processes == {"proxy": 1, "ingress": 1, "directory": 1, "decode": 2, "ray_other": 1, "client": 1} and cpu.missing == 0


def test_a_vanished_or_reused_pid_counts_nothing_and_is_missing() -> None:
    start = {1: r("decode", 2.0), 2: r("decode", 3.0), 3: r("ingress", 1.0, start=100)}
    end = {1: r("decode", 2.5), 3: r("ingress", 0.2, start=900)}  # 2 exited; 3 is another process under the same pid
    cpu = cpu_per_turn(start, end, client_cpu_s=0.0, ok_turns=10)
    assert cpu.missing == 2 and cpu.processes["decode"] == 1 and cpu.processes["ingress"] == 0
    assert cpu.cpu_s["decode"] == pytest.approx(0.5) and cpu.cpu_s["ingress"] == 0.0
    assert cpu.ms_per_turn["decode"] == pytest.approx(50.0)


def test_zero_ok_turns_is_inf_for_work_and_nan_for_none() -> None:
    cpu = cpu_per_turn({1: r("decode", 1.0), 2: r("proxy", 1.0)}, {1: r("decode", 1.5), 2: r("proxy", 1.0)}, client_cpu_s=0.1, ok_turns=0)
    assert cpu.ms_per_turn["decode"] == math.inf and cpu.ms_per_turn["client"] == math.inf
    assert math.isnan(cpu.ms_per_turn["proxy"]) and math.isnan(cpu.ms_per_turn["directory"])  # no CPU, no turns: 0 / 0
    assert cpu.total_ms_per_turn == math.inf
    assert math.isnan(cpu_per_turn({}, {}, client_cpu_s=0.0, ok_turns=0).total_ms_per_turn)


def test_per_turn_ms() -> None:
    assert per_turn_ms(0.25, 500) == pytest.approx(0.5) and per_turn_ms(0.0, 10) == 0.0
    with pytest.raises(ValueError):
        per_turn_ms(1.0, -1)


def test_compact() -> None:
    ms = {"proxy": 0.21, "ingress": 0.3, "directory": math.nan, "decode": math.inf, "ray_other": 0.0304, "client": 0.2}
    assert compact(ms, 0.9) == "proxy 0.210 ingress 0.300 directory nan decode inf ray_other 0.030 client 0.200 total 0.900"


def test_snapshots_of_a_stand_in_replica_that_works_then_exits() -> None:
    """A process of this test's own, titled like a decode replica (exec -a), is found with its
    role, its CPU grows between two readings, and once it exits it is missing."""
    busy = "while True:\n    pass"
    proc = subprocess.Popen(["bash", "-c", f'exec -a "ray::ServeReplica:baton:decode" {sys.executable} -c "$0"', busy])
    try:
        deadline = time.monotonic() + 10
        first: dict[int, ProcReading] = {}
        while proc.pid not in first and time.monotonic() < deadline:
            time.sleep(0.05)
            first = {pid: rd for pid, rd in read_snapshot().items() if pid == proc.pid}
        assert first[proc.pid].role == "decode"
        again = read_again(first)
        while again[proc.pid].cpu_s == first[proc.pid].cpu_s and time.monotonic() < deadline:  # a tick is 10 ms
            time.sleep(0.05)
            again = read_again(first)
        assert again[proc.pid].start_ticks == first[proc.pid].start_ticks
        assert again[proc.pid].cpu_s > first[proc.pid].cpu_s
        assert cpu_per_turn(first, again, 0.0, 1).cpu_s["decode"] > 0
    finally:
        proc.kill()
        proc.wait()
    gone = read_again(first)
    assert proc.pid not in gone and cpu_per_turn(first, gone, 0.0, 1).missing == 1
