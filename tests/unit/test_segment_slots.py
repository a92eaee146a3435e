"""The vLLM-touching pure helpers of the segment connector, in one file:
- `slots_for`: prompt positions → paged-cache slots through a block table;
- paged_kv.learn_layout against vLLM's real CPU cache-write kernel (each ISA this CPU has): the
  learned layout must read back exactly what the kernel wrote. No engine is started."""
from __future__ import annotations

import pytest
import torch

from kv_transfer.paged_kv import learn_layout, read_tokens
from kv_transfer.segment_meta import slots_for


def test_slots_follow_the_block_table() -> None:
    blocks, bs = [7, 2, 9], 4
    assert slots_for(blocks, bs, 0, 4) == (28, 29, 30, 31)
    assert slots_for(blocks, bs, 3, 6) == (31, 8, 9)  # crosses from block 7 into block 2
    assert slots_for(blocks, bs, 8, 12) == (36, 37, 38, 39)
    assert slots_for(blocks, bs, 5, 5) == ()
    assert slots_for(blocks, bs, 0, 12) == tuple(b * bs + o for b in blocks for o in range(bs))


def test_positions_past_the_block_table_raise() -> None:
    with pytest.raises(IndexError):
        slots_for([1], 4, 2, 5)


def _cpu_writer(isa: str):
    """What vllm/v1/attention/backends/cpu_attn.py do_kv_cache_update does, for one ISA."""
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("vLLM build without the CPU attention kernels")

    def write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        nb, h, bs, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view((nb, h, bs * 2, -1)).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    return write


@pytest.mark.parametrize("isa,dtype,block_size", [("vec", torch.bfloat16, 32), ("vec16", torch.bfloat16, 16),
                                                  ("vec", torch.float32, 32), ("amx", torch.bfloat16, 32)])
def test_learned_layout_reads_what_the_cpu_kernel_wrote(isa: str, dtype: torch.dtype, block_size: int) -> None:
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    write, d = _cpu_writer(isa), 64
    layout = learn_layout(write, block_size, d, dtype)
    cache = torch.zeros(3, 2, block_size, 2 * d, dtype=dtype)
    slots = torch.tensor([0, block_size + 3, 3 * block_size - 1, 5], dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 2, d, generator=g).to(dtype), torch.randn(4, 2, d, generator=g).to(dtype)
    write(k, v, cache, slots)
    rk, rv = read_tokens(cache, slots, layout)
    assert torch.equal(rk, k) and torch.equal(rv, v)
