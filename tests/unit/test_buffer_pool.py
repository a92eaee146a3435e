"""BufferPool (kv_transfer/buffer_pool.py): prepared injections reuse the buffers of collected
ones, never those of a live one; the idle bytes stay bounded."""
from __future__ import annotations

import gc

import pytest
import torch
from test_prepared_injection import SEGS, SPEC

from kv_transfer.buffer_pool import ROUND, BufferPool
from kv_transfer.prepared import prepare
from kv_transfer.rope import Rotator


def test_a_given_buffer_is_taken_again_by_a_request_it_fits() -> None:
    pool = BufferPool()
    a = pool.take(1000, torch.bfloat16)
    assert a.numel() == ROUND and pool.allocated == 1
    pool.give(a)
    assert pool.take(900, torch.float32) is not a  # another dtype
    assert pool.take(1200, torch.bfloat16) is a and pool.reused == 1
    pool.give(a)
    assert pool.take(3 * ROUND, torch.bfloat16) is not a  # too small
    pool.check_integrity()


def test_a_much_larger_buffer_is_not_spent_on_a_small_request() -> None:
    pool = BufferPool(slack=1.5)
    big = pool.take(8 * ROUND, torch.bfloat16)
    pool.give(big)
    assert pool.take(2 * ROUND, torch.bfloat16) is not big
    assert pool.take(7 * ROUND, torch.bfloat16) is big


def test_idle_bytes_stay_within_capacity_dropping_the_oldest() -> None:
    one = ROUND * 2  # bytes of a bf16 buffer of ROUND elements
    pool = BufferPool(capacity_bytes=2 * one)
    bufs = [pool.take(ROUND, torch.bfloat16) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 2 * one
    taken = [pool.take(ROUND, torch.bfloat16) for _ in range(3)]
    assert taken[0] is bufs[1] and taken[1] is bufs[2] and taken[2] is not bufs[0]  # the oldest was dropped
    pool.check_integrity()
    pool.give(torch.empty(4 * ROUND, dtype=torch.bfloat16))  # larger than the capacity: not kept
    assert pool.idle_bytes <= 2 * one
    with pytest.raises(ValueError):
        BufferPool(slack=0.5)
    with pytest.raises(ValueError):
        pool.take(0, torch.bfloat16)


def test_a_prepared_injection_gives_its_buffers_back_only_once_collected() -> None:
    pool, rot = BufferPool(), Rotator(SPEC)
    plain = prepare(SEGS, rot, torch.bfloat16)
    live = prepare(SEGS, rot, torch.bfloat16, pool)
    assert torch.equal(live.keys, plain.keys) and torch.equal(live.values, plain.values)
    assert live.keys.is_contiguous() and pool.idle_bytes == 0
    other = prepare(SEGS, rot, torch.bfloat16, pool)  # while `live` lives: new buffers
    assert pool.allocated == 4 and pool.reused == 0
    assert other.keys.data_ptr() != live.keys.data_ptr()
    ptr = live.keys.data_ptr()
    del live
    gc.collect()
    assert pool.idle_bytes > 0
    again = prepare(SEGS, rot, torch.bfloat16, pool)
    assert pool.reused == 2 and ptr in (again.keys.data_ptr(), again.values.data_ptr())
    assert torch.equal(again.keys, plain.keys) and torch.equal(again.values, plain.values)
    assert torch.equal(other.keys, plain.keys)  # untouched by the reuse
