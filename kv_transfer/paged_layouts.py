"""Which paged-KV layout an attention backend uses, learned from its own cache write, and a reader
for it (captures read tokens out of the cache; writes always go through the backend's op).

Layouts known (a cache tensor per layer; N blocks, H KV heads, D head dim, bs block size):
- `cpu_runs`: vLLM's CPU backend, [N, H, bs, 2·D], each (block, head) one run whose in-run order
  depends on the kernel ISA; learned element by element (kv_transfer/paged_kv.py);
- `kv_first`: [2, N, bs, H, D] (FlashAttention: keys are cache[0], values cache[1]);
- `blocks_first`: [N, 2, bs, H, D] (FlashInfer, NHD);
- `blocks_first_hnd`: [N, 2, H, bs, D] (FlashInfer, HND).
Shape alone can be ambiguous (bs == H), so every candidate whose shape fits is probed: tokens
tagged by offset, head and dim (small integers, exact in bf16) are written through the backend's
op into a two-block scratch cache shaped like the real one, on its device, and read back with the
candidate's reader; the first candidate that reads back exactly what was written is the layout.
None does: UnsupportedLayout (the capture fails and its submitter recomputes).

Readers build their index tensors on the cache's device; they return [T, H, D] keys and values
on that device (the caller copies them to the host).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.paged_kv import PagedLayout, UnsupportedLayout, WriteFn, learn_layout, read_tokens

Reader = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class CacheLayout:
    """A learned layout: its name and how to read tokens (cache, slots) -> (keys, values) [T, H, D]."""

    name: str
    read: Reader


def _kv_first(cache: torch.Tensor, slots: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, o = slots // bs, slots % bs
    return cache[0, b, o], cache[1, b, o]


def _blocks_first(cache: torch.Tensor, slots: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, o = slots // bs, slots % bs
    return cache[b, 0, o], cache[b, 1, o]


def _blocks_first_hnd(cache: torch.Tensor, slots: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, o = slots // bs, slots % bs
    return cache[b, 0, :, o], cache[b, 1, :, o]  # advanced indices around a slice: [T, H, D]


def _candidates(shape: tuple[int, ...], bs: int, d: int) -> list[tuple[str, tuple[int, ...], int, Callable[..., tuple[torch.Tensor, torch.Tensor]]]]:
    """Pure: (name, scratch shape with two blocks, heads, reader) of every 5-D layout this shape fits."""
    out = []
    if len(shape) != 5 or shape[4] != d:
        return out
    if shape[0] == 2 and shape[2] == bs:
        out.append(("kv_first", (2, 2, bs, shape[3], d), shape[3], _kv_first))
    if shape[1] == 2 and shape[2] == bs:
        out.append(("blocks_first", (2, 2, bs, shape[3], d), shape[3], _blocks_first))
    if shape[1] == 2 and shape[3] == bs:
        out.append(("blocks_first_hnd", (2, 2, shape[2], bs, d), shape[2], _blocks_first_hnd))
    return out


def _probe_ok(write: WriteFn, scratch_shape: tuple[int, ...], reader: Callable[..., tuple[torch.Tensor, torch.Tensor]],
              bs: int, heads: int, d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tokens written into block 1 of a scratch cache read back exactly (three tag probes)."""
    slots = torch.arange(bs, 2 * bs, device=device)
    grids = torch.meshgrid(torch.arange(bs, device=device), torch.arange(heads, device=device),
                           torch.arange(d, device=device), indexing="ij")
    for tag in grids:  # by offset, by head, by dim: every element's (offset, head, dim) pinned down
        k, v = tag.to(dtype), (-(tag + 1)).to(dtype)
        scratch = torch.full(scratch_shape, float("nan"), dtype=dtype, device=device)
        try:
            write(k, v, scratch, slots)
            rk, rv = reader(scratch, slots, bs)
        except (RuntimeError, IndexError, ValueError):
            return False
        if rk.shape != k.shape or not (torch.equal(rk, k) and torch.equal(rv, v)):
            return False
    return True


def learn_cache_layout(write: WriteFn, kv_cache: torch.Tensor, block_size: int, head_dim: int,
                       dtype: torch.dtype) -> CacheLayout:
    """The layout of `kv_cache` (one layer's), from the backend's own `write` op."""
    shape = tuple(kv_cache.shape)
    if len(shape) == 4:
        runs: PagedLayout = learn_layout(write, block_size, head_dim, dtype)
        moved = PagedLayout(runs.block_size, runs.head_dim, runs.key_index.to(kv_cache.device),
                            runs.value_index.to(kv_cache.device))
        return CacheLayout("cpu_runs", lambda cache, slots: read_tokens(cache, slots, moved))
    for name, scratch_shape, heads, reader in _candidates(shape, block_size, head_dim):
        if _probe_ok(write, scratch_shape, reader, block_size, heads, head_dim, dtype, kv_cache.device):
            return CacheLayout(name, lambda cache, slots, _r=reader: _r(cache, slots, block_size))
    raise UnsupportedLayout(f"paged KV of shape {shape} (block size {block_size}, head dim {head_dim}) is none of the "
                            "known layouts, or the backend's write does not store tokens as they were written")
