"""Race-free TCP ports for engine side channels (NIXL handshakes), one per engine process.

"A port that was free a moment ago" (bind to port 0, release, hand the number to vLLM) loses
races: between the release and vLLM's own bind, the kernel can give the same port to any other
socket of the host as an ephemeral port (Ray's and vLLM's ZMQ sockets bind port 0 all the time),
and vLLM's handshake listener then dies with EADDRINUSE while the engine build waits on it
forever. So a reservation here is:

- taken from a band *below* the kernel's ephemeral range (`ip_local_port_range`), where the kernel
  never assigns a port on its own; only programs that ask for a number explicitly compete there;
- owned through an exclusive `flock` on a per-port file, held for the life of the process: two
  Baton engines on one host can never hold the same port, and a killed process releases its lock
  (the kernel drops it), so a restarted replica can reuse the number;
- checked by a test bind, so a port some other program already listens on is skipped.

Invariant: within one host, a port is reserved by at most one live process.
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BAND = (30000, 32768)  # [low, high): under Linux's default ephemeral range (32768-60999)
_held: dict[int, int] = {}  # port -> fd of its lock file, kept open for the process's life
_held_lock = threading.Lock()


class NoPortAvailable(RuntimeError):
    """Every port of the band is reserved or in use on this host."""


@dataclass(frozen=True)
class PortReservation:
    host: str
    port: int
    lock_path: Path


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range [low, high] (Linux); (32768, 60999) where unreadable."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def band_below_ephemeral(band: tuple[int, int] = DEFAULT_BAND) -> tuple[int, int]:
    """Pure-ish: the band clipped so it ends where the ephemeral range begins."""
    low, high = band
    eph_low, _ = ephemeral_range()
    high = min(high, eph_low)
    if high - low < 16:  # an unusual host whose ephemeral range starts low: take the 1000 ports under it
        low, high = max(1024, eph_low - 1000), eph_low
    return low, high


def lock_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"baton-ports-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def reserve_port(host: str = "127.0.0.1", band: tuple[int, int] | None = None, rng: random.Random | None = None) -> PortReservation:
    """Reserve one port on `host` for this process (see the module docstring). Raises NoPortAvailable."""
    low, high = band or band_below_ephemeral()
    if not 0 < low < high <= 65536:
        raise ValueError(f"port band must satisfy 0 < low < high <= 65536, got [{low}, {high})")
    ports = list(range(low, high))
    (rng or random.Random()).shuffle(ports)
    directory = lock_dir()
    for port in ports:
        with _held_lock:
            if port in _held:
                continue
            path = directory / f"{port}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    continue  # another live process holds it
                raise
            if not _bindable(host, port):
                os.close(fd)  # someone outside Baton listens there: leave the number alone
                continue
            _held[port] = fd
            return PortReservation(host=host, port=port, lock_path=path)
    raise NoPortAvailable(f"no free port in [{low}, {high}) on {host}: all reserved or in use")


def release_port(port: int) -> None:
    """Give a reservation back (for tests and for engines that stop before their process ends)."""
    with _held_lock:
        fd = _held.pop(port, None)
    if fd is not None:
        os.close(fd)


def held_ports() -> frozenset[int]:
    with _held_lock:
        return frozenset(_held)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
