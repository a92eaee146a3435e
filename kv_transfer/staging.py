"""Host-side load buffers of the segment worker (kv_transfer/segment_worker.py), and what a
load thread waits for on a device before its writes count as done."""
from __future__ import annotations

from typing import Any

import torch


class Staging:
    """Reusable load buffers: fresh 100 MB tensors per request cost more in page faults (~0.3 s
    here) than the whole rotation, so loads copy into buffers that only ever grow."""

    def __init__(self) -> None:
        self._f32 = torch.empty(0)
        self._low = torch.empty(0, dtype=torch.bfloat16)
        self._val = torch.empty(0, dtype=torch.bfloat16)

    def views(self, layers: int, n: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = layers * n * heads * dim
        if self._f32.numel() < size:
            self._f32 = torch.empty(size)
        if self._low.numel() < size or self._low.dtype != dtype:
            self._low = torch.empty(size, dtype=dtype)
            self._val = torch.empty(size, dtype=dtype)
        shape = (layers, n, heads, dim)
        return self._f32[:size].view(shape), self._low[:size].view(shape), self._val[:size].view(shape)


def device_sync(layers: list[Any]) -> Any:
    """What the loader runs after a load's writes: on CUDA, wait for them (the loader thread's
    stream), so a load reported done has its KV in the cache; on CPU the writes are done already."""
    cache = getattr(layers[0], "kv_cache", None) if layers else None
    if isinstance(cache, torch.Tensor) and cache.is_cuda:
        device = cache.device
        return lambda: torch.cuda.current_stream(device).synchronize()
    return None
