"""Stop one local Ray head and only it: the processes whose command line names its --temp-dir
(gcs_server, raylet, the agents: Ray passes them the session directory under it), and every
descendant of those (the workers, whose titles Ray rewrites to `ray::...`).

`ray stop --force` stops every Ray process of the user on the machine: a bench that used it
killed an e2e run's cluster (and any other bench's) sharing the machine.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping


def read_processes(proc: str = "/proc") -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line with spaces) of every process now (Linux /proc)."""
    out: dict[int, tuple[int, str]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # the command name in parentheses may hold spaces: the fields after its last ")" are fixed
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out[int(name)] = (ppid, cmdline)
    return out


def session_processes(processes: Mapping[int, tuple[int, str]], marker: str, exclude: Iterable[int] = ()) -> set[int]:
    """Pure: the processes whose command line contains `marker`, and all their descendants."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in processes.items():
        children[ppid].append(pid)
    found: set[int] = set()
    stack = [pid for pid, (_, cmd) in processes.items() if marker in cmd]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children[pid])
    return found - set(exclude)


def stop_ray_session(temp_dir: str, grace_s: float = 15.0) -> int:
    """SIGTERM the head's processes, SIGKILL what is left after grace_s, remove its temp dir;
    returns how many processes were signalled."""
    me = {os.getpid()}
    pids = session_processes(read_processes(), temp_dir, exclude=me)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {p for p in alive if _alive(p)}
    for pid in alive | session_processes(read_processes(), temp_dir, exclude=me):  # and any started meanwhile
        _signal(pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return len(pids)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ")[-1][:1] != b"Z"  # a zombie has exited
    except OSError:
        return False
