"""A KV segment as bytes: the layout the memory store's arena holds, and the reference a replica
pulls it by.

One segment is one contiguous extent: its keys (fp32, RoPE removed) then its values (model dtype),
each `[layers, tokens, kv_heads, head_dim]` in C order. `pack` writes a KVSegment into such an
extent, `unpack` views an extent as a KVSegment (no copy). A `SegmentRef` names an extent in another
process's NIXL-registered memory: which agent, which address, how it is laid out, and how long the
owner promises not to reuse it (the lease, counted from before the lookup was sent).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.segments import KVSegment

MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class SegmentLayout:
    """How a segment's bytes are laid out in its extent: keys at 0, values right after."""

    token_ids: tuple[int, ...]
    shape: tuple[int, int, int, int]  # [L, T, H, D] of keys and of values
    key_dtype: str  # torch dtype name, e.g. "float32"
    value_dtype: str

    def __post_init__(self) -> None:
        if len(self.shape) != 4 or any(d <= 0 for d in self.shape):
            raise ValueError(f"segment shape must be 4 positive dims, got {self.shape}")
        if self.shape[1] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but a shape of {self.shape[1]} tokens")
        for name in (self.key_dtype, self.value_dtype):
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ValueError(f"unknown dtype {name!r}")

    @classmethod
    def of(cls, seg: KVSegment) -> SegmentLayout:
        return cls(seg.token_ids, tuple(seg.keys.shape), _name(seg.keys.dtype), _name(seg.values.dtype))  # type: ignore[arg-type]

    @property
    def key_nbytes(self) -> int:
        return _numel(self.shape) * _dtype(self.key_dtype).itemsize

    @property
    def value_nbytes(self) -> int:
        return _numel(self.shape) * _dtype(self.value_dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.key_nbytes + self.value_nbytes


@dataclass(frozen=True)
class SegmentRef:
    """Where a pullable segment lives: `nbytes` bytes at `addr` in `agent`'s registered memory."""

    agent: str
    addr: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"
    layout: SegmentLayout
    lease_s: float  # the owner keeps the extent unchanged this long after it answered

    def __post_init__(self) -> None:
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}, got {self.mem_type!r}")
        if not self.agent or self.addr <= 0 or not self.lease_s > 0:  # (NaN is not > 0)
            raise ValueError("a segment ref needs an agent, an address and a positive lease")

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


def pack(seg: KVSegment, extent: torch.Tensor) -> SegmentLayout:
    """Write `seg` into `extent` (a 1-D uint8 tensor of at least its bytes); returns its layout."""
    layout = SegmentLayout.of(seg)
    if extent.dtype != torch.uint8 or extent.dim() != 1 or extent.numel() < layout.nbytes:
        raise ValueError(f"extent must be 1-D uint8 of >= {layout.nbytes} bytes")
    kb = layout.key_nbytes
    extent[:kb].view(seg.keys.dtype).view(seg.keys.shape).copy_(seg.keys)
    extent[kb : layout.nbytes].view(seg.values.dtype).view(seg.values.shape).copy_(seg.values)
    return layout


def unpack(extent: torch.Tensor, layout: SegmentLayout) -> KVSegment:
    """View `extent` (1-D uint8, at least layout.nbytes) as the segment it holds (no copy)."""
    if extent.dtype != torch.uint8 or extent.dim() != 1 or extent.numel() < layout.nbytes:
        raise ValueError(f"extent must be 1-D uint8 of >= {layout.nbytes} bytes")
    kb = layout.key_nbytes
    keys = extent[:kb].view(_dtype(layout.key_dtype)).view(layout.shape)
    values = extent[kb : layout.nbytes].view(_dtype(layout.value_dtype)).view(layout.shape)
    return KVSegment(layout.token_ids, keys, values)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
