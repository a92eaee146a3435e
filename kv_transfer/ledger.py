"""How many KV transfers this process's engine took part in, as its KV connector saw them.

The connector (kv_transfer/nixl.py) writes here from the engine thread; the engine replica reads
`totals()` and `records()` from any thread. One ledger per process: Baton runs one engine per
process (a Serve replica), and vLLM builds the connector itself, so the connector cannot be handed
a ledger object — it finds this process's one through `process_ledger()`.

Consumer side (a request whose prompt KV is pulled from a remote engine):
    begin_receive(id, blocks)  when the connector posts the reads
    end_receive(id, ok)        when vLLM reports the request done (or failed) receiving
Producer side (a request whose KV is held for a remote reader):
    note_offered(id, blocks)   when the request finishes and its blocks are held for the reader
    note_released(id, served)  when the blocks are freed: read by the consumer, or lease expired

Invariant (check_integrity): every begun receive is either pending or ended exactly once, and
every offered request is either held or released exactly once.
Bytes are always blocks × bytes_per_block (all layers of one block), set once by the worker.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

RecordKind = Literal["received", "failed", "sent", "expired"]
DEFAULT_MAX_RECORDS = 1024


@dataclass(frozen=True)
class TransferTotals:
    """Counts since the process started (or the last reset). Bytes = blocks × bytes per block."""

    requests_received: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    failures: int = 0
    receives_pending: int = 0
    requests_offered: int = 0
    blocks_offered: int = 0
    requests_sent: int = 0  # offered requests a consumer reported as read (it may skip blocks it had)
    leases_expired: int = 0
    nixl_bytes_read: int = 0  # what NIXL itself reported for completed reads (telemetry), a cross-check
    bytes_per_block: int = 0


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer of one request, from this engine's side."""

    request_id: str  # vLLM's internal id: the caller's request id + "-" + 8 hex digits
    kind: RecordKind
    blocks: int  # received: blocks read; sent: blocks held for the reader; failed/expired: 0
    bytes: int  # blocks × bytes per block
    seconds: float  # begin → end as this process saw it (receive: reads posted → reported done)
    peer_engine_id: str | None = None


@dataclass
class _Open:
    blocks: int
    started: float
    peer_engine_id: str | None


class TransferLedger:
    """Thread-safe counters plus a bounded list of the most recent per-request records."""

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS):
        self._lock = threading.Lock()
        self._max_records = max_records
        self._clear()

    def _clear(self) -> None:
        self._receiving: dict[str, _Open] = {}
        self._held: dict[str, _Open] = {}
        self._records: deque[TransferRecord] = deque(maxlen=self._max_records)
        self._bytes_per_block = 0
        self._begun = 0
        self._offered = 0
        self._received = self._blocks_received = self._failures = 0
        self._offered_blocks = 0
        self._sent = self._expired = 0
        self._nixl_bytes = 0

    # ---- writers (the connector) ------------------------------------------------------------
    def set_bytes_per_block(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"bytes per block must be positive, got {nbytes}")
        with self._lock:
            self._bytes_per_block = nbytes

    def begin_receive(self, request_id: str, blocks: int, peer_engine_id: str | None = None) -> None:
        """Reads of `blocks` blocks were posted for `request_id`. A repeat while pending is ignored."""
        if blocks <= 0:
            raise ValueError(f"a receive moves at least one block, got {blocks}")
        with self._lock:
            if request_id in self._receiving:
                return
            self._receiving[request_id] = _Open(blocks, time.monotonic(), peer_engine_id)
            self._begun += 1

    def end_receive(self, request_id: str, ok: bool) -> TransferRecord | None:
        """vLLM reported `request_id` done receiving (ok) or failed. None if it was never begun here
        (e.g. a notify-only full local hit), so callers may pass every finished id."""
        with self._lock:
            opened = self._receiving.pop(request_id, None)
            if opened is None:
                return None
            if ok:
                self._received += 1
                self._blocks_received += opened.blocks
            else:
                self._failures += 1
            return self._record(request_id, "received" if ok else "failed", opened)

    def note_offered(self, request_id: str, blocks: int, peer_engine_id: str | None = None) -> None:
        """The request finished and its `blocks` blocks are held until a remote engine reads them."""
        if blocks <= 0:
            return
        with self._lock:
            if request_id in self._held:
                return
            self._held[request_id] = _Open(blocks, time.monotonic(), peer_engine_id)
            self._offered += 1
            self._offered_blocks += blocks

    def note_released(self, request_id: str, served: bool) -> TransferRecord | None:
        """The held blocks were freed: read by the consumer (served) or their lease expired."""
        with self._lock:
            held = self._held.pop(request_id, None)
            if held is None:
                return None
            if served:
                self._sent += 1
            else:
                self._expired += 1
            return self._record(request_id, "sent" if served else "expired", held)

    def add_nixl_bytes(self, nbytes: int) -> None:
        with self._lock:
            self._nixl_bytes += int(nbytes)

    def _record(self, request_id: str, kind: RecordKind, opened: _Open) -> TransferRecord:
        moved = kind in ("received", "sent")
        blocks = opened.blocks if moved else 0
        rec = TransferRecord(
            request_id=request_id,
            kind=kind,
            blocks=blocks,
            bytes=blocks * self._bytes_per_block,
            seconds=time.monotonic() - opened.started,
            peer_engine_id=opened.peer_engine_id,
        )
        self._records.append(rec)
        return rec

    # ---- readers (the replica, tests) -------------------------------------------------------
    def totals(self) -> TransferTotals:
        with self._lock:
            bpb = self._bytes_per_block
            return TransferTotals(
                requests_received=self._received,
                blocks_received=self._blocks_received,
                bytes_received=self._blocks_received * bpb,
                failures=self._failures,
                receives_pending=len(self._receiving),
                requests_offered=self._offered,
                blocks_offered=self._offered_blocks,
                requests_sent=self._sent,
                leases_expired=self._expired,
                nixl_bytes_read=self._nixl_bytes,
                bytes_per_block=bpb,
            )

    def records(self) -> tuple[TransferRecord, ...]:
        """The most recent finished transfers, oldest first (at most max_records)."""
        with self._lock:
            return tuple(self._records)

    def check_integrity(self) -> None:
        """Raise AssertionError when a count disagrees with the open/closed bookkeeping."""
        with self._lock:
            assert self._begun == self._received + self._failures + len(self._receiving), (
                f"receives: begun {self._begun} != received {self._received} + failed {self._failures}"
                f" + pending {len(self._receiving)}"
            )
            assert self._offered == self._sent + self._expired + len(self._held), (
                f"offers: {self._offered} != sent {self._sent} + expired {self._expired} + held {len(self._held)}"
            )
            assert len(self._records) <= self._max_records

    def reset(self) -> None:
        """Forget everything but bytes per block (tests, benchmarks between phases)."""
        with self._lock:
            bpb = self._bytes_per_block
            self._clear()
            self._bytes_per_block = bpb


_PROCESS_LEDGER = TransferLedger()


def process_ledger() -> TransferLedger:
    """The ledger of this process's engine (the connector writes it, the replica reads it)."""
    return _PROCESS_LEDGER
