"""Reading and writing single tokens of vLLM's paged KV cache, whatever its in-block layout.

Writes go through the attention backend's own op (`layer.impl.do_kv_cache_update`), which is
layout independent. Reads need the layout: vLLM's CPU backend keeps each (block, head) as one
contiguous run of block_size·2·D elements, keys first then values, but the order *inside* a run
depends on the kernel ISA (vec, vec16, amx…) and is not a public contract. So the layout is
learned once from the backend itself: write probe tokens whose elements encode their own
(offset, dim) through the real op into a one-block scratch cache, and read back where each
element landed. The result is a gather index per run; a read is then one `index_select`.

Region map of one (block, head) run of the CPU cache, shape [num_blocks, H, block_size, 2·D]:

    run = kv_cache[block, head].flatten()          # block_size·2·D elements
    keys   at run[key_index[offset, dim]]    (learned; vLLM's CPU kernels put keys in the first
    values at run[value_index[offset, dim]]   half and values in the second, but that too is learned)

Other cache shapes raise UnsupportedLayout (capture then fails and the caller recomputes).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class UnsupportedLayout(RuntimeError):
    """The paged cache's shape is not one this module knows how to read."""


@dataclass(frozen=True)
class PagedLayout:
    """Where each (offset-in-block, dim) element of a key / value lives inside a (block, head) run."""

    block_size: int
    head_dim: int
    key_index: torch.Tensor  # int64 [block_size, D] → position in the run
    value_index: torch.Tensor  # int64 [block_size, D]

    def check_integrity(self) -> None:
        n = self.block_size * self.head_dim
        both = torch.cat((self.key_index.flatten(), self.value_index.flatten()))
        if both.numel() != 2 * n or torch.unique(both).numel() != 2 * n:
            raise AssertionError("paged layout is not a permutation of the block run")
        if int(both.min()) < 0 or int(both.max()) >= 2 * n:
            raise AssertionError("paged layout points outside the block run")


def learn_layout(write: WriteFn, block_size: int, head_dim: int, dtype: torch.dtype) -> PagedLayout:
    """Learn the in-block layout from the backend's write op.

    `write(k[T,1,D], v[T,1,D], cache[1,1,block_size,2D], slots[T])` must be the backend's own
    cache write. Two probes into a NaN-filled scratch run: first keys tagged with their offset
    and values with −(offset+1) (so a run position tells key from value, whichever order or
    interleaving the backend uses), then both tagged with their dim. All tags are small integers,
    exact in bf16/fp16 for block_size, head_dim ≤ 256, so every run position is tagged with its
    (key or value, offset, dim)."""
    n = block_size * head_dim
    offsets = torch.arange(block_size, dtype=torch.float).repeat_interleave(head_dim).view(block_size, 1, head_dim)
    dims = torch.arange(head_dim, dtype=torch.float).repeat(block_size).view(block_size, 1, head_dim)
    slots = torch.arange(block_size, dtype=torch.long)

    def probe(k_tag: torch.Tensor, v_tag: torch.Tensor) -> torch.Tensor:
        cache = torch.full((1, 1, block_size, 2 * head_dim), float("nan"), dtype=dtype)
        write(k_tag.to(dtype), v_tag.to(dtype), cache, slots)
        return cache.flatten().to(torch.float)

    by_offset, by_dim = probe(offsets, -(offsets + 1)), probe(dims, dims)
    if bool(torch.isnan(by_offset).any() or torch.isnan(by_dim).any()):
        raise UnsupportedLayout("the backend's write did not fill the whole block run")
    is_value = by_offset < 0
    offset = torch.where(is_value, -by_offset - 1, by_offset)
    if int(is_value.sum()) != n or not bool(((offset >= 0) & (offset < block_size) & (by_dim >= 0) & (by_dim < head_dim)).all()):
        raise UnsupportedLayout("the backend's write did not store the probe tokens as written")
    code = (offset * head_dim + by_dim).long()  # (offset, dim) → one id per key / value element
    pos = torch.arange(2 * n)
    key_index = torch.full((n,), -1, dtype=torch.long)
    value_index = torch.full((n,), -1, dtype=torch.long)
    key_index[code[~is_value]] = pos[~is_value]
    value_index[code[is_value]] = pos[is_value]
    layout = PagedLayout(block_size, head_dim, key_index.view(block_size, head_dim), value_index.view(block_size, head_dim))
    layout.check_integrity()
    return layout


def check_cache_shape(kv_cache: torch.Tensor, layout: PagedLayout) -> None:
    if kv_cache.dim() != 4 or kv_cache.shape[2] != layout.block_size or kv_cache.shape[3] != 2 * layout.head_dim:
        raise UnsupportedLayout(
            f"paged KV of shape {tuple(kv_cache.shape)} is not [blocks, heads, {layout.block_size}, {2 * layout.head_dim}]"
        )


def read_tokens(kv_cache: torch.Tensor, slots: torch.Tensor, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [T, H, D] of the tokens at `slots` (slot = block · block_size + offset).

    Reads only the T·H·D elements asked for (one flat index per element); copying each token's
    whole (block, head) run first would move 2·block_size times more memory."""
    check_cache_shape(kv_cache, layout)
    blocks, offsets = slots // layout.block_size, slots % layout.block_size
    heads = kv_cache.shape[1]
    k_in_run = layout.key_index[offsets][:, None, :]  # [T, 1, D]
    v_in_run = layout.value_index[offsets][:, None, :]
    if not kv_cache.is_contiguous():  # a strided view: gather within copies of the runs
        runs = kv_cache.flatten(2)[blocks]  # [T, H, 2·block_size·D]
        return (torch.gather(runs, 2, k_in_run.expand(-1, heads, -1)),
                torch.gather(runs, 2, v_in_run.expand(-1, heads, -1)))
    run = 2 * layout.block_size * layout.head_dim
    flat = kv_cache.view(-1)
    base = ((blocks[:, None] * heads + torch.arange(heads, device=kv_cache.device)[None, :]) * run)[:, :, None]  # [T, H, 1]
    return flat[base + k_in_run], flat[base + v_in_run]


def layer_writer(layer: Any) -> WriteFn:
    """The backend's own cache write for one attention layer."""

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        layer.impl.do_kv_cache_update(layer, k, v, cache, slots)

    return write
