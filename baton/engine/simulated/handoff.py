"""NIXL-shaped P/D handoff accounting for simulated engines: what moves, how long it takes.

The prefill engine (its request carries `{"do_remote_decode": True}`, deployments/backend.py)
finishes with kv_transfer_params shaped like vLLM's NIXL connector's (remote_block_ids,
remote_engine_id, remote_host/port, ...) and holds the request's blocks for the transfer. The
decode engine (its request carries those params, `do_remote_prefill`) pulls every prompt block its
own prefix cache lacks, waits out the transfer, then computes the last prompt token, as vLLM does.

Assumptions, stated once:
- bytes = blocks × block_size × the model's per-token KV bytes (all layers and KV heads, bf16),
  whatever the TP size: one link carries a request's whole KV;
- transfer time = bytes / link bandwidth (`link_gbps`, Gbit/s), × the engine's time_scale; no
  per-transfer latency, no contention between concurrent transfers;
- the prefill side cannot see the reader (another process), so it holds the blocks for the time a
  full transfer of them takes, then frees them as read (vLLM frees on the reader's notification).
Both sides write this process's transfer ledger (kv_transfer/ledger.py) as the NIXL connector does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kv_transfer.ledger import TransferLedger

TRANSFER_MODE = "simulated"


@dataclass(frozen=True)
class HandoffLink:
    """The link a handoff crosses, and the bytes per KV block of the simulated model."""

    link_gbps: float
    bytes_per_block: int

    def transfer_seconds(self, blocks: int) -> float:
        return blocks * self.bytes_per_block * 8 / (self.link_gbps * 1e9)


def producer_params(engine_id: str, request_id: str, block_ids: list[int], num_computed_tokens: int, tp: int) -> dict[str, Any]:
    """What a prefill engine returns for the decoder (the keys vLLM's NIXL connector returns)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": "simulated",
        "remote_port": 0,
        "tp_size": tp,
        "remote_num_tokens": num_computed_tokens,
        "transfer_mode": TRANSFER_MODE,
    }


class HandoffAccounting:
    """Times transfers on one engine and writes them to its process's ledger."""

    def __init__(self, link: HandoffLink, ledger: TransferLedger, time_scale: float = 1.0):
        self.link = link
        self.ledger = ledger
        self.time_scale = time_scale  # the engine's: transfers speed up with its steps
        ledger.set_bytes_per_block(link.bytes_per_block)

    def begin_receive(self, request_id: str, blocks: int, params: dict[str, Any]) -> float:
        """The decoder posts reads of `blocks` blocks; returns the transfer's duration (s)."""
        if blocks > 0:
            self.ledger.begin_receive(request_id, blocks, params.get("remote_engine_id"))
        return self.link.transfer_seconds(blocks) * self.time_scale

    def end_receive(self, request_id: str, ok: bool) -> None:
        self.ledger.end_receive(request_id, ok)

    def offer(self, request_id: str, blocks: int) -> float:
        """The prefill engine holds `blocks` blocks for a reader; returns how long (s)."""
        self.ledger.note_offered(request_id, blocks)
        return self.link.transfer_seconds(blocks) * self.time_scale

    def release(self, request_id: str) -> None:
        self.ledger.note_released(request_id, served=True)
