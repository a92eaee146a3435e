"""Stopping one bench's Ray head and only it (baton/bench/ray_session.py): the processes that name
its temp dir and their descendants, never another Ray's."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from baton.bench.ray_session import read_processes, session_processes, stop_ray_session

TABLE = {
    1: (0, "/sbin/init"),
    10: (1, "gcs_server --log_dir=/tmp/bray-a/session_1/logs"),
    11: (1, "raylet --session_dir=/tmp/bray-a/session_1"),
    12: (11, "ray::ServeReplica:baton:decode"),  # a worker: Ray rewrote its title
    13: (12, "python -c engine-core"),  # and its own child
    20: (1, "raylet --session_dir=/tmp/ray/session_2"),  # another Ray (an e2e run)
    21: (20, "ray::ServeReplica:baton:decode"),
}


def test_its_processes_and_their_descendants_only() -> None:
    assert session_processes(TABLE, "/tmp/bray-a") == {10, 11, 12, 13}
    assert session_processes(TABLE, "/tmp/bray-a", exclude=[13]) == {10, 11, 12}
    assert session_processes(TABLE, "/tmp/bray-b") == set()


def test_the_process_table_knows_this_process_and_its_parent() -> None:
    table = read_processes()
    assert table[os.getpid()][0] == os.getppid()
    assert "pytest" in table[os.getpid()][1] or sys.executable in table[os.getpid()][1]


def test_stopping_signals_the_marked_process_tree_and_removes_the_dir(tmp_path: Path) -> None:
    marker = tmp_path / "bray-x"
    marker.mkdir()
    # a parent naming the marker (as raylet names its session dir) with a child that does not
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", script, str(marker)])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while len(session_processes(read_processes(), str(marker))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = session_processes(read_processes(), str(marker))
        assert parent.pid in tree and len(tree) == 2
        assert stop_ray_session(str(marker), grace_s=5) == 2
        assert parent.wait(timeout=5) is not None
        assert session_processes(read_processes(), str(marker)) == set()
        assert bystander.poll() is None and not marker.exists()
    finally:
        for p in (parent, bystander):
            p.kill()
            p.wait()
