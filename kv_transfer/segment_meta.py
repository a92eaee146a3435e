"""What the segment connector's scheduler side tells its worker side each step, and the request
parameters both read (kv_transfer/segment_connector.py describes the protocol).

The scheduler side builds one `SegmentConnectorMetadata` per step (build_connector_meta); vLLM
binds it to the worker side's connector before the forward pass. Slots are paged-cache slots:
block_id · block_size + offset.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

PARAMS_KEY = "baton_segments"


@dataclass(frozen=True)
class SegmentLoad:
    """Lay the segments offered under `key` into prompt positions [start, end) at `slots`.

    request_id None: a synchronous load, done before this step's forward pass; else an
    asynchronous one (kv_transfer/segment_loader.py), reported under that request id when done."""

    key: str
    start: int  # first prompt position to load
    end: int  # one past the last
    slots: tuple[int, ...]
    request_id: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end or len(self.slots) != self.end - self.start:
            raise ValueError(f"load [{self.start}, {self.end}) with {len(self.slots)} slots")


@dataclass(frozen=True)
class SegmentCapture:
    """Read the KV of prompt positions `ranges` (at `slots`, per range) and put it under `key`."""

    key: str
    ranges: tuple[tuple[int, int], ...]
    token_ids: tuple[int, ...]  # the whole prompt
    slots: tuple[tuple[int, ...], ...]  # per range

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.ranges) or any(len(s) != b - a for (a, b), s in zip(self.ranges, self.slots, strict=True)):
            raise ValueError(f"capture ranges {self.ranges} do not match their slots")


@dataclass
class SegmentConnectorMetadata(KVConnectorMetadata):
    loads: list[SegmentLoad] = field(default_factory=list)
    captures: list[SegmentCapture] = field(default_factory=list)


def segment_params(request: Any) -> dict[str, Any] | None:
    """The request's `kv_transfer_params["baton_segments"]`, or None when it carries none."""
    params = getattr(request, "kv_transfer_params", None) or {}
    p = params.get(PARAMS_KEY)
    return p if isinstance(p, dict) and isinstance(p.get("key"), str) else None


def slots_for(block_ids: list[int], block_size: int, start: int, end: int) -> tuple[int, ...]:
    """Cache slots of prompt positions [start, end): block_ids[p // bs] · bs + p % bs."""
    return tuple(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
