"""The KV transfer ledger and the NIXL config helpers, without an engine (milliseconds)."""
from __future__ import annotations

import os
import socket
import sys
import threading

import pytest

from kv_transfer.ledger import TransferLedger, TransferTotals, process_ledger
from kv_transfer.nixl import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    kv_bytes_per_block,
    lower_thread_priority,
    nixl_kv_transfer_config,
    side_channel_env,
)

BPB = 2_949_120  # SmolLM2: 23,040 bytes per token × 128 tokens per block


def ledger() -> TransferLedger:
    led = TransferLedger(max_records=4)
    led.set_bytes_per_block(BPB)
    return led


def test_a_received_request_counts_blocks_and_bytes() -> None:
    led = ledger()
    led.begin_receive("r1", blocks=4, peer_engine_id="P")
    assert led.totals().receives_pending == 1
    rec = led.end_receive("r1", ok=True)
    assert rec is not None and (rec.kind, rec.blocks, rec.bytes, rec.peer_engine_id) == ("received", 4, 4 * BPB, "P")
    t = led.totals()
    assert (t.requests_received, t.blocks_received, t.bytes_received, t.failures, t.receives_pending) == (1, 4, 4 * BPB, 0, 0)
    led.check_integrity()


def test_a_failed_receive_counts_a_failure_and_no_bytes() -> None:
    led = ledger()
    led.begin_receive("r1", blocks=3)
    rec = led.end_receive("r1", ok=False)
    assert rec is not None and (rec.kind, rec.blocks, rec.bytes) == ("failed", 0, 0)
    t = led.totals()
    assert (t.requests_received, t.blocks_received, t.failures) == (0, 0, 1)
    led.check_integrity()


def test_ending_an_unknown_or_finished_receive_changes_nothing() -> None:
    led = ledger()
    assert led.end_receive("never-begun", ok=True) is None  # e.g. a notify-only full local hit
    led.begin_receive("r1", blocks=2)
    led.end_receive("r1", ok=True)
    assert led.end_receive("r1", ok=True) is None
    assert led.totals().requests_received == 1
    led.check_integrity()


def test_a_repeated_begin_while_pending_counts_once() -> None:
    led = ledger()
    led.begin_receive("r1", blocks=2)
    led.begin_receive("r1", blocks=2)
    led.end_receive("r1", ok=True)
    assert (led.totals().requests_received, led.totals().blocks_received) == (1, 2)
    led.check_integrity()


def test_a_receive_moves_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        ledger().begin_receive("r1", blocks=0)
    with pytest.raises(ValueError):
        TransferLedger().set_bytes_per_block(0)


def test_producer_side_offer_then_served_or_expired() -> None:
    led = ledger()
    led.note_offered("p1", blocks=4)
    led.note_offered("p2", blocks=2)
    led.note_offered("p3", blocks=0)  # nothing held: not an offer
    assert led.totals().requests_offered == 2
    led.check_integrity()
    served = led.note_released("p1", served=True)
    expired = led.note_released("p2", served=False)
    assert served is not None and (served.kind, served.blocks, served.bytes) == ("sent", 4, 4 * BPB)
    assert expired is not None and (expired.kind, expired.blocks) == ("expired", 0)
    assert led.note_released("p3", served=True) is None
    t = led.totals()
    assert (t.requests_offered, t.blocks_offered, t.requests_sent, t.leases_expired) == (2, 6, 1, 1)
    led.check_integrity()


def test_records_are_bounded_and_oldest_go_first() -> None:
    led = ledger()
    for i in range(6):
        led.begin_receive(f"r{i}", blocks=1)
        led.end_receive(f"r{i}", ok=True)
    assert [r.request_id for r in led.records()] == ["r2", "r3", "r4", "r5"]
    assert led.totals().requests_received == 6  # totals are not bounded
    led.check_integrity()


def test_reset_keeps_bytes_per_block_and_nixl_bytes_are_a_separate_count() -> None:
    led = ledger()
    led.begin_receive("r1", blocks=1)
    led.add_nixl_bytes(BPB)
    assert led.totals().nixl_bytes_read == BPB
    led.reset()
    assert led.totals() == TransferTotals(bytes_per_block=BPB)
    assert led.records() == ()
    led.check_integrity()


def test_check_integrity_catches_a_broken_count() -> None:
    led = ledger()
    led.begin_receive("r1", blocks=1)
    led._begun += 1  # simulate a lost request
    with pytest.raises(AssertionError):
        led.check_integrity()


def test_concurrent_writers_and_a_reader_agree() -> None:
    led = TransferLedger(max_records=64)
    led.set_bytes_per_block(10)

    def write(prefix: str) -> None:
        for i in range(500):
            led.begin_receive(f"{prefix}{i}", blocks=2)
            led.end_receive(f"{prefix}{i}", ok=i % 10 != 0)

    threads = [threading.Thread(target=write, args=(p,)) for p in "abcd"]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        t_now = led.totals()
        assert t_now.bytes_received == t_now.blocks_received * 10
    for t in threads:
        t.join()
    t = led.totals()
    assert (t.requests_received, t.failures, t.blocks_received) == (1800, 200, 3600)
    led.check_integrity()


def test_the_process_ledger_is_one_object() -> None:
    assert process_ledger() is process_ledger()


# ---- config helpers -------------------------------------------------------------------------
def test_kv_transfer_config_selects_the_counting_connector() -> None:
    assert nixl_kv_transfer_config("kv_producer", "cpu") == {
        "kv_connector": "CountingNixlConnector",
        "kv_connector_module_path": "kv_transfer.nixl",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
    }
    assert (CONNECTOR_NAME, CONNECTOR_MODULE) == ("CountingNixlConnector", "kv_transfer.nixl")
    assert nixl_kv_transfer_config("kv_both", "cuda")["kv_role"] == "kv_both"
    with pytest.raises(ValueError, match="kv role"):
        nixl_kv_transfer_config("decode", "cpu")
    with pytest.raises(ValueError, match="buffer device"):
        nixl_kv_transfer_config("kv_both", "tpu")


def test_side_channel_env_defaults_to_loopback_and_a_reserved_port() -> None:
    env = side_channel_env()
    assert env[SIDE_CHANNEL_HOST_ENV] == "127.0.0.1"  # Ray is not initialized in unit tests
    port = int(env[SIDE_CHANNEL_PORT_ENV])
    from kv_transfer.ports import band_below_ephemeral, held_ports

    low, high = band_below_ephemeral()
    assert low <= port < high and port in held_ports()  # reserved for this process, below the ephemeral range
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens there until vLLM's handshake listener does
    assert side_channel_env("10.0.0.5", 5601) == {SIDE_CHANNEL_HOST_ENV: "10.0.0.5", SIDE_CHANNEL_PORT_ENV: "5601"}


def test_side_channel_ports_differ_between_engines() -> None:
    ports = {side_channel_env()[SIDE_CHANNEL_PORT_ENV] for _ in range(8)}
    assert len(ports) > 1


def test_importing_the_module_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, kv_transfer.nixl, kv_transfer.config; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class _FakeTensor:
    def __init__(self, ptr: int, numel: int, element_size: int = 2):
        self._ptr, self._numel, self._es = ptr, numel, element_size

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._es


def test_bytes_per_block_sums_layers_and_counts_shared_memory_once() -> None:
    # 2 layers × [blocks=10, kv_heads=3, block_size=128, 2*head_dim=128] in bf16, plus an alias of layer 0
    per_layer = 10 * 3 * 128 * 128
    caches = {"l0": _FakeTensor(1, per_layer), "l1": _FakeTensor(2, per_layer), "l0_alias": _FakeTensor(1, per_layer)}
    assert kv_bytes_per_block(caches, num_blocks=10) == 2 * 3 * 128 * 128 * 2
    with pytest.raises(ValueError):
        kv_bytes_per_block(caches, num_blocks=7)


def _nice(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux only")
def test_lower_thread_priority_changes_only_the_given_threads() -> None:
    ready, stop, tids = threading.Event(), threading.Event(), []

    def park() -> None:
        tids.append(threading.get_native_id())
        ready.set()
        stop.wait()

    t = threading.Thread(target=park)
    t.start()
    ready.wait()
    try:
        mine = _nice(threading.get_native_id())
        assert lower_thread_priority({tids[0], 2**22 + 12345}) == [tids[0]]  # the second id is no thread here
        assert _nice(tids[0]) == 19
        assert _nice(threading.get_native_id()) == mine == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        stop.set()
        t.join()
