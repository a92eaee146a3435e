"""CPU per turn by cluster role, for the control-plane bench (baton/bench/control.py).

What is measured: over one point's measured window (control_load.run_point's `on_window` hook,
"start" at the window's start, "end" once the last turn started in it has ended), the CPU
seconds (utime + stime from /proc/PID/stat, every thread included) each role of the local Ray
cluster used, divided by the window's ok turns, in milliseconds. Everything those processes did
in the window counts, their background work included (replica reports, pin-cache syncs, Ray's
heartbeats), so a figure is what a turn costs that role at this rate, not the turn's own path.

Roles, from a process's /proc/PID/cmdline bytes (role_of): `proxy` (Serve's HTTP proxy actor,
"ProxyActor"), `ingress`, `directory`, `decode` (the Serve replicas of those deployments of the
app, "ray::ServeReplica:<app>:<deployment>", every decode replica and every directory shard summed), `ray_other` (every
other Ray process: raylet, gcs_server, Serve's controller, agents, idle workers, the `serve run`
driver, replicas of other deployments) and `client` (the load generator, this process: its own
CPU clock over the same window, from run_point, not read from /proc).

Processes come and go: the pid list is read once, at the window's start, and the same pids are
read again at its end. A pid that is gone at the end (or whose start time changed: the pid was
reused) has only its start reading, so its CPU in the window is unknown: it contributes nothing
and is counted in `missing`; a process that started during the window is not seen at all.

Zero ok turns: a role's ms per turn is +inf when it used CPU (work with nothing served: never a
cheap-looking point) and nan when it used none (0 / 0)."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROLES = ("proxy", "ingress", "directory", "decode", "ray_other", "client")
REPLICA_ROLES = ("ingress", "directory", "decode")  # Serve deployments of the app, by name
APP = "baton"


def is_ray_process(cmdline: bytes) -> bool:
    """A process of a local Ray cluster: a Ray worker or actor ("ray::…"), a Ray binary or script
    (…/ray/… as its program), the raylet and its agents, the GCS, or a `serve run` driver."""
    args = cmdline.split(b"\0")
    if cmdline.startswith(b"ray::") or b"/ray/" in args[0] or b"raylet" in cmdline or b"gcs_server" in cmdline:
        return True
    return any(a.rsplit(b"/", 1)[-1] == b"serve" and b == b"run" for a, b in zip(args, args[1:], strict=False))


def _is_replica(cmdline: bytes, deployment: str, app: str) -> bool:
    """cmdline is "ray::ServeReplica:<app>:<deployment>", alone or followed by the method Ray
    names in the title (".handle_request") or argv padding — not a longer deployment name."""
    marker = f"ray::ServeReplica:{app}:{deployment}".encode()
    if not cmdline.startswith(marker):
        return False
    rest = cmdline[len(marker):]
    if deployment == "directory" and rest.startswith(b"-"):  # a shard: directory-<i> (router/directory_shards.py)
        digits = len(rest[1:]) - len(rest[1:].lstrip(b"0123456789"))
        rest = rest[1 + digits:] if digits else rest
    return rest[:1] in (b"", b".", b"\0", b" ")


def role_of(cmdline: bytes, app: str = APP) -> str | None:
    """The role of a process from its /proc/PID/cmdline bytes (see the module docstring); None
    for a process that is not Ray's (and `client` is never returned: that is this process)."""
    for deployment in REPLICA_ROLES:
        if _is_replica(cmdline, deployment, app):
            return deployment
    if cmdline.startswith(b"ray::") and b"ProxyActor" in cmdline:
        return "proxy"
    return "ray_other" if is_ray_process(cmdline) else None


def parse_stat(text: str) -> tuple[int, int]:
    """(start time, utime + stime), both in clock ticks, from the text of /proc/PID/stat (the
    command name in parentheses may hold spaces and parentheses: fields are read after the last ")")."""
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[19]), int(fields[11]) + int(fields[12])  # fields 22 (starttime), 14 (utime), 15 (stime)


@dataclass(frozen=True)
class ProcReading:
    """One process at one instant: its role, its start time (ticks since boot: tells a reused
    pid apart) and the CPU seconds it has used so far."""

    role: str
    start_ticks: int
    cpu_s: float


Snapshot = Mapping[int, ProcReading]  # pid -> reading


@dataclass(frozen=True)
class CpuPerTurn:
    """One window's CPU by role. ms_per_turn has every role of ROLES; total_ms_per_turn is the
    roles' CPU together over the same ok turns."""

    ok_turns: int
    cpu_s: dict[str, float]  # role -> CPU seconds used in the window
    ms_per_turn: dict[str, float]  # role -> cpu_s * 1000 / ok_turns (zero turns: inf, or nan for 0 / 0)
    total_ms_per_turn: float
    processes: dict[str, int]  # role -> processes read at both ends
    missing: int  # processes read at the start but gone (or their pid reused) at the end


def per_turn_ms(cpu_s: float, ok_turns: int) -> float:
    """cpu_s as milliseconds per ok turn; zero turns: +inf if cpu_s > 0, nan if cpu_s == 0."""
    if ok_turns < 0 or cpu_s < 0:
        raise ValueError("ok_turns and cpu_s must be >= 0")
    if ok_turns == 0:
        return math.inf if cpu_s > 0 else math.nan
    return cpu_s * 1000.0 / ok_turns


def cpu_per_turn(start: Snapshot, end: Snapshot, client_cpu_s: float, ok_turns: int) -> CpuPerTurn:
    """The window's CPU by role from the readings at its two ends (the start's pids only) and the
    client's CPU over it, per ok turn (see the module docstring for vanished pids)."""
    cpu = dict.fromkeys(ROLES, 0.0)
    processes = dict.fromkeys(ROLES, 0)
    missing = 0
    for pid, first in start.items():
        last = end.get(pid)
        if last is None or last.start_ticks != first.start_ticks:
            missing += 1
            continue
        cpu[first.role] += last.cpu_s - first.cpu_s
        processes[first.role] += 1
    cpu["client"] = client_cpu_s
    processes["client"] = 1
    ms = {role: per_turn_ms(s, ok_turns) for role, s in cpu.items()}
    return CpuPerTurn(ok_turns=ok_turns, cpu_s=cpu, ms_per_turn=ms, total_ms_per_turn=per_turn_ms(sum(cpu.values()), ok_turns),
                      processes=processes, missing=missing)


def read_snapshot(app: str = APP, proc: Path = Path("/proc")) -> dict[int, ProcReading]:
    """Every Ray process on this machine now, with its role and CPU so far (this process left
    out: the client is measured by its own clock). A process that exits while being read is skipped."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    out: dict[int, ProcReading] = {}
    for name in filter(str.isdigit, os.listdir(proc)):
        pid = int(name)
        if pid == me:
            continue
        try:
            role = role_of((proc / name / "cmdline").read_bytes(), app)
            if role is None:
                continue
            start_ticks, ticks = parse_stat((proc / name / "stat").read_text())
        except (OSError, IndexError, ValueError):
            continue
        out[pid] = ProcReading(role, start_ticks, ticks / tick)
    return out


def read_again(pids: Snapshot, proc: Path = Path("/proc")) -> dict[int, ProcReading]:
    """The same pids read again (their roles kept from the first reading); a pid that is gone is
    left out (cpu_per_turn counts it as missing)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, ProcReading] = {}
    for pid, first in pids.items():
        try:
            start_ticks, ticks = parse_stat((proc / str(pid) / "stat").read_text())
        except (OSError, IndexError, ValueError):
            continue
        out[pid] = ProcReading(first.role, start_ticks, ticks / tick)
    return out


def compact(ms: Mapping[str, float], total: float) -> str:
    """`proxy 0.210 ingress 0.300 … total 0.910` (ms per turn; inf / nan as such)."""
    def f(x: float) -> str:
        return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.3f}")
    return " ".join(f"{role} {f(ms[role])}" for role in ROLES if role in ms) + f" total {f(total)}"
