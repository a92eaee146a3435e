"""kv_transfer/ports.py: side-channel ports reserved race-free (below the ephemeral range, one
live owner per port on a host, released when the owner exits)."""
from __future__ import annotations

import random
import socket
import subprocess
import sys
import time

import pytest

from kv_transfer.ports import (
    NoPortAvailable,
    band_below_ephemeral,
    ephemeral_range,
    held_ports,
    release_port,
    reserve_port,
)

BAND = (31000, 31040)


@pytest.fixture(autouse=True)
def _release_all() -> None:
    yield
    for p in held_ports():
        release_port(p)


def test_band_lies_below_the_kernels_ephemeral_range() -> None:
    low, high = band_below_ephemeral()
    assert high <= ephemeral_range()[0] and high - low >= 16


def test_reservations_in_one_process_never_repeat() -> None:
    ports = [reserve_port(band=BAND, rng=random.Random(0)).port for _ in range(20)]
    assert len(set(ports)) == 20 and all(BAND[0] <= p < BAND[1] for p in ports)


def test_exhausted_band_raises() -> None:
    for _ in range(4):
        reserve_port(band=(31100, 31104))
    with pytest.raises(NoPortAvailable, match="31100"):
        reserve_port(band=(31100, 31104))


def test_a_port_someone_listens_on_is_skipped() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 31200))
        s.listen()
        assert reserve_port(band=(31200, 31202)).port == 31201


def _hold_in_child(port_band: tuple[int, int]) -> tuple[subprocess.Popen, int]:
    code = (
        "import sys, time\n"
        "from kv_transfer.ports import reserve_port\n"
        f"r = reserve_port(band={port_band!r})\n"
        "print(r.port, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def test_another_process_holding_a_port_excludes_it_until_it_dies() -> None:
    child, port = _hold_in_child((31300, 31301))
    try:
        with pytest.raises(NoPortAvailable):
            reserve_port(band=(31300, 31301))  # the only port is the child's
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5
    while True:  # the kernel drops a dead process's lock
        try:
            assert reserve_port(band=(31300, 31301)).port == port
            break
        except NoPortAvailable:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_bad_band_is_rejected() -> None:
    with pytest.raises(ValueError):
        reserve_port(band=(100, 100))
