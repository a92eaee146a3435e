"""Worker nodes of a local multi-node Ray cluster: each a `ray start --address=<head>` of its own
(its own raylet, object store and resources) on this machine, as a second host would run it.

A worker node carries a marker resource `baton_node_<name>: 1`. Ray passes a raylet its resources
on its command line (`--static_resource_list=name,amount,...`), so the marker tells which raylet
is which node's, and a node failure is the SIGKILL of that raylet (`kill_raylet`): its workers
lose their raylet and exit, and the head's GCS marks the node dead after its health checks, as
when a host goes away. The worker shares the head's `--temp-dir`, so stopping the head's session
(ray_session.stop_ray_session) stops the workers too.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from baton.bench.ray_session import read_processes, session_processes

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class WorkerNode:
    """One worker node: its name (marker resource baton_node_<name>), logical CPUs and resources."""

    name: str
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    object_store_mib: int = 512

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"worker node name {self.name!r}: lower-case letters, digits and _, starting with a letter")
        if self.num_cpus < 0 or self.object_store_mib < 80 or any(v <= 0 for v in self.resources.values()):
            raise ValueError(f"worker node {self.name}: num_cpus >= 0, object store >= 80 MiB, resources > 0")

    @property
    def marker(self) -> str:
        return f"baton_node_{self.name}"

    def start_command(self, ray: str, head_address: str, temp_dir: str) -> list[str]:
        resources = {**self.resources, self.marker: 1}
        return [ray, "start", f"--address={head_address}", f"--num-cpus={self.num_cpus}", f"--resources={json.dumps(resources)}",
                f"--object-store-memory={self.object_store_mib * 1024 * 1024}", "--disable-usage-stats", f"--temp-dir={temp_dir}"]


def start_worker(node: WorkerNode, ray: str, head_address: str, temp_dir: str, env: Mapping[str, str]) -> None:
    """`ray start` the worker node and return once it has joined; raises with Ray's reason if not."""
    done = subprocess.run(node.start_command(ray, head_address, temp_dir), env=dict(env), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-5:]
        raise RuntimeError(f"`ray start` of worker node {node.name} failed: " + " | ".join(tail))


def find_raylet(processes: Mapping[int, tuple[int, str]], marker: str) -> int | None:
    """Pure: the pid of the raylet whose static resources name `marker` (None: no such raylet)."""
    for pid, (_, cmd) in sorted(processes.items()):
        if "/raylet/raylet " not in cmd and not cmd.startswith("raylet "):
            continue
        m = re.search(r"--static_resource_list=(\S+)", cmd)
        if m and marker in m.group(1).split(",")[0::2]:
            return pid
    return None


def node_processes(processes: Mapping[int, tuple[int, str]], raylet_pid: int) -> set[int]:
    """Pure: the processes of one node: its raylet and every descendant (its workers and agents;
    their command lines are no help: Ray rewrites a worker's title to `ray::<actor>`)."""
    return session_processes({pid: (ppid, "raylet" if pid == raylet_pid else "") for pid, (ppid, _) in processes.items()}, "raylet") \
        if raylet_pid in processes else set()


@dataclass(frozen=True)
class KilledNode:
    raylet_pid: int
    processes: frozenset[int]  # the node's processes at the kill (node_processes), the raylet included


def kill_raylet(node: WorkerNode) -> KilledNode:
    """SIGKILL the node's raylet (a node failure). Raises if the node has none running."""
    procs = read_processes()
    pid = find_raylet(procs, node.marker)
    if pid is None:
        raise RuntimeError(f"worker node {node.name}: no raylet with resource {node.marker} is running")
    members = frozenset(node_processes(procs, pid))
    os.kill(pid, signal.SIGKILL)
    return KilledNode(pid, members)


def leftovers(killed: KilledNode) -> set[int]:
    """The killed node's processes still alive now (zombies excluded: they have exited)."""
    alive = set()
    for pid in killed.processes:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().split(b") ")[-1][:1] != b"Z":
                    alive.add(pid)
        except OSError:
            continue
    return alive
