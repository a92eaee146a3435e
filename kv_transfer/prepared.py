"""An injection made ready for the paged cache before its request reaches the engine.

KVSegments (kv_transfer/segments.py) hold keys before RoPE, in fp32. Laying them into the cache
needs them rotated to their prompt positions and cast to the engine's KV dtype. The positions are
fixed as soon as the request is planned (the segments tile [0, end) in order), so this work can
run where the segments are resolved, in a thread of the replica, instead of on the engine thread
right before the forward pass. `PreparedInjection` is the result: the whole injected range as
two contiguous [layers, end, kv_heads, head_dim] tensors in the engine's dtype. The engine thread
then only slices the range a load asks for (a suffix [start, end) after a local prefix-cache hit)
and hands each layer to the attention backend's cache write.

`prepare` allocates every tensor it writes: it runs concurrently with the engine thread and with
other requests' preparation, so it shares no buffer with anyone. The rotation is the worker's own
`Rotator` (kv_transfer/rope.py), so a prepared load writes exactly what the engine-thread path
writes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_transfer.buffer_pool import BufferPool
from kv_transfer.rope import RopeSpec, Rotator
from kv_transfer.segments import KVSegment


@dataclass(frozen=True, eq=False)
class PreparedInjection:
    """`segments` laid end to end from position 0, with their KV ready for the cache.

    keys: rotated to positions 0..end-1 and cast to `dtype`; values cast to `dtype`; both
    contiguous [layers, end, kv_heads, head_dim]. rope: the rotation the keys carry (a worker
    whose rotation is a different one must not use them).
    Invariant (check_integrity, run on construction): end == sum of the segments' tokens, the
    tensors' shapes follow the segments', and both tensors have the one dtype."""

    segments: tuple[KVSegment, ...]
    keys: torch.Tensor
    values: torch.Tensor
    rope: RopeSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        self.check_integrity()

    @property
    def end(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def check_integrity(self) -> None:
        if not self.segments:
            raise ValueError("a prepared injection needs at least one segment")
        layers, _, heads, dim = self.segments[0].keys.shape
        for s in self.segments:
            if (s.keys.shape[0], s.keys.shape[2], s.keys.shape[3]) != (layers, heads, dim):
                raise ValueError(f"segment KV {tuple(s.keys.shape)} does not match the first segment's {tuple(self.segments[0].keys.shape)}")
        want = (layers, self.end, heads, dim)
        for name, t in (("keys", self.keys), ("values", self.values)):
            if tuple(t.shape) != want:
                raise ValueError(f"prepared {name} {tuple(t.shape)} do not cover the segments {want}")
            if not t.is_contiguous():
                raise ValueError(f"prepared {name} must be contiguous")
        if self.values.dtype != self.keys.dtype:
            raise ValueError(f"prepared keys are {self.keys.dtype} but values {self.values.dtype}")
        if dim != self.rope.head_dim:
            raise ValueError(f"head dim {dim} but the rotation's is {self.rope.head_dim}")

    def layer_range(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [end-start, heads, dim] of one layer at positions [start, end): views,
        contiguous (the rows of one layer are consecutive)."""
        if not 0 <= start < end <= self.end:
            raise ValueError(f"positions [{start}, {end}) are not within the prepared [0, {self.end})")
        return self.keys[layer, start:end], self.values[layer, start:end]


def prepare(segments: Sequence[KVSegment], rotator: Rotator, dtype: torch.dtype,
            pool: BufferPool | None = None) -> PreparedInjection:
    """Rotate `segments`' keys to positions 0..end-1 and cast keys and values to `dtype`.

    Keys one layer at a time, through a fp32 scratch of one layer (the rotation needs contiguous
    fp32), so the transient memory is a layer's keys, not the whole injection's. pool: the
    keys and values are views of its buffers, given back when the injection is collected
    (kv_transfer/buffer_pool.py); None: fresh tensors."""
    segs = tuple(segments)
    if not segs:
        raise ValueError("nothing to prepare: no segments")
    layers, _, heads, dim = segs[0].keys.shape
    end = sum(s.num_tokens for s in segs)
    shape = (layers, end, heads, dim)
    numel = layers * end * heads * dim
    bufs = (pool.take(numel, dtype), pool.take(numel, dtype)) if pool is not None else None
    if bufs is not None:
        keys, values = bufs[0][:numel].view(shape), bufs[1][:numel].view(shape)
    else:
        keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    torch.cat([s.values for s in segs], dim=1, out=values)  # casts to dtype as it copies
    scratch = None if dtype == torch.float else torch.empty((1, end, heads, dim))
    positions = torch.arange(end)
    for layer in range(layers):
        out = keys[layer : layer + 1] if scratch is None else scratch
        torch.cat([s.keys[layer] for s in segs], dim=0, out=out[0])
        rotator.apply_(out, positions)
        if scratch is not None:
            keys[layer].copy_(scratch[0])
    out = PreparedInjection(segs, keys, values, rotator.spec)
    if bufs is not None:
        pool.give_when_dead(out, *bufs)
    return out
