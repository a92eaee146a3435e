"""ExtentAllocator (memory_store/extents.py): aligned first-fit, coalescing frees, integrity check."""
from __future__ import annotations

import random

import pytest

from memory_store.extents import ALIGN, ExtentAllocator

A = 64  # a small alignment keeps the numbers readable


def test_alloc_rounds_up_to_align_and_free_returns_space() -> None:
    x = ExtentAllocator(10 * A, align=A)
    assert (x.capacity, x.align, x.used_bytes, x.largest_free) == (640, 64, 0, 640)
    assert [x.size_of(n) for n in (0, 1, 63, 64, 65, 128, -5)] == [64, 64, 64, 64, 128, 128, 64]
    s0 = x.alloc(1)
    s1 = x.alloc(65)
    s2 = x.alloc(64)
    assert (s0, s1, s2) == (0, 64, 192)
    assert [x.length(s) for s in (s0, s1, s2)] == [64, 128, 64]
    assert (x.used_bytes, x.largest_free) == (256, 384)
    x.check_integrity()
    x.free(s1)
    assert (x.used_bytes, x.largest_free) == (128, 384)
    with pytest.raises(KeyError):
        x.length(s1)
    x.check_integrity()


def test_default_alignment_is_4096() -> None:
    x = ExtentAllocator(3 * ALIGN)
    assert ALIGN == 4096 and x.align == 4096
    assert x.alloc(1) == 0 and x.alloc(4097) == 4096 and x.used_bytes == 3 * 4096
    assert x.alloc(1) is None


def test_first_fit_takes_the_lowest_hole_that_is_large_enough() -> None:
    x = ExtentAllocator(10 * A, align=A)
    s = [x.alloc(A) for _ in range(6)]  # 0..320
    assert s == [0, 64, 128, 192, 256, 320]
    x.free(64)  # hole of 1 unit at 64
    x.free(192)
    x.free(256)  # hole of 2 units at 192
    assert x.alloc(2 * A) == 192  # the 1-unit hole at 64 is skipped
    assert x.alloc(A) == 64  # the lowest hole that fits
    assert x.alloc(A) == 384  # the tail
    x.check_integrity()


def test_free_coalesces_with_previous() -> None:
    x = ExtentAllocator(4 * A, align=A)
    a, b, c, d = (x.alloc(A) for _ in range(4))
    x.free(a)
    x.free(b)  # merges into the free range before it
    assert x._free_starts == [0] and x._free_len == {0: 128}
    assert x.largest_free == 128
    x.check_integrity()
    assert x.alloc(2 * A) == 0


def test_free_coalesces_with_next() -> None:
    x = ExtentAllocator(4 * A, align=A)
    a, b, c, d = (x.alloc(A) for _ in range(4))
    x.free(c)
    x.free(b)  # merges with the free range after it
    assert x._free_starts == [64] and x._free_len == {64: 128}
    x.check_integrity()
    assert x.alloc(2 * A) == 64


def test_free_coalesces_with_both_sides() -> None:
    x = ExtentAllocator(5 * A, align=A)
    a, b, c, d, e = (x.alloc(A) for _ in range(5))
    x.free(b)
    x.free(d)
    assert x._free_starts == [64, 192]
    x.free(c)  # joins 64..128, 128..192 and 192..256
    assert x._free_starts == [64] and x._free_len == {64: 192}
    x.check_integrity()
    x.free(a)
    x.free(e)
    assert x._free_starts == [0] and x._free_len == {0: 320} and x.used_bytes == 0
    x.check_integrity()


def test_tail_free_range_coalesces_with_a_freed_neighbour() -> None:
    x = ExtentAllocator(4 * A, align=A)
    a = x.alloc(A)
    b = x.alloc(A)  # tail 128..256 stays free
    x.free(b)
    assert x._free_len == {64: 192}
    x.free(a)
    assert x._free_len == {0: 256}
    x.check_integrity()


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    x = ExtentAllocator(4 * A, align=A)
    assert x.alloc(5 * A) is None
    assert x.alloc(3 * A) == 0
    assert x.alloc(2 * A) is None  # one unit left
    assert x.used_bytes == 192 and x.largest_free == 64
    assert x.alloc(A) == 192
    assert x.alloc(1) is None and x.largest_free == 0
    x.check_integrity()


def test_free_of_an_unknown_or_freed_start_raises_key_error() -> None:
    x = ExtentAllocator(4 * A, align=A)
    s = x.alloc(2 * A)
    with pytest.raises(KeyError):
        x.free(64)  # inside an allocation, not its start
    with pytest.raises(KeyError):
        x.free(128)  # a free range
    x.free(s)
    with pytest.raises(KeyError):
        x.free(s)  # twice
    x.check_integrity()
    assert x.used_bytes == 0


def test_constructor_validation_and_capacity_rounding_down() -> None:
    for bad_align in (0, -64, 3, 48, 100):
        with pytest.raises(ValueError, match="power of two"):
            ExtentAllocator(1024, align=bad_align)
    with pytest.raises(ValueError, match="capacity"):
        ExtentAllocator(63, align=64)
    with pytest.raises(ValueError, match="capacity"):
        ExtentAllocator(0, align=64)
    x = ExtentAllocator(64 * 3 + 63, align=64)
    assert x.capacity == 192 and x.largest_free == 192
    assert ExtentAllocator(1, align=1).capacity == 1
    x.check_integrity()


def _model_first_fit(units: list[bool], n: int) -> int | None:
    """The lowest index of n consecutive free units (True = used)."""
    run = 0
    for i, used in enumerate(units):
        run = 0 if used else run + 1
        if run == n:
            return i - n + 1
    return None


def test_random_alloc_free_matches_a_unit_model() -> None:
    rng = random.Random(1234)
    nunits = 64
    x = ExtentAllocator(nunits * A + 17, align=A)
    units = [False] * nunits
    live: dict[int, int] = {}  # start -> units
    allocs = frees = fails = 0
    for _ in range(2000):
        if live and rng.random() < 0.45:
            start = rng.choice(sorted(live))
            n = live.pop(start)
            x.free(start)
            for u in range(start // A, start // A + n):
                units[u] = False
            frees += 1
        else:
            nbytes = rng.randint(0, 9 * A)
            n = max(1, -(-nbytes // A))
            want = _model_first_fit(units, n)
            got = x.alloc(nbytes)
            if want is None:
                assert got is None
                fails += 1
            else:
                assert got == want * A
                assert x.length(got) == n * A
                live[got] = n
                for u in range(want, want + n):
                    units[u] = True
                allocs += 1
        x.check_integrity()
        assert x.used_bytes == sum(live.values()) * A == sum(units) * A
    assert allocs > 500 and frees > 500 and fails > 10  # every path was exercised
    for start in list(live):
        x.free(start)
    assert x.used_bytes == 0 and x._free_len == {0: nunits * A}
    x.check_integrity()


def _three_way() -> ExtentAllocator:
    x = ExtentAllocator(6 * A, align=A)
    for _ in range(3):
        x.alloc(A)
    x.free(64)  # free: 64..128 and 192..384; used: 0, 128
    x.check_integrity()
    return x


def test_check_integrity_detects_a_gap() -> None:
    x = _three_way()
    del x._used[128]
    with pytest.raises(AssertionError, match="tiling"):
        x.check_integrity()


def test_check_integrity_detects_an_overlap() -> None:
    x = _three_way()
    x._used[0] = 2 * A  # now overlaps the free range at 64
    with pytest.raises(AssertionError, match="tiling"):
        x.check_integrity()


def test_check_integrity_detects_misalignment() -> None:
    x = _three_way()
    x._used[0] = 32
    x._used[32] = 32
    with pytest.raises(AssertionError, match="tiling"):
        x.check_integrity()


def test_check_integrity_detects_uncoalesced_free_ranges() -> None:
    x = _three_way()
    x.free(128)  # coalesced properly: one free range 64..384
    assert x._free_len == {64: 320}
    x.check_integrity()
    x._free_len = {64: 128, 192: 192}
    x._free_starts = [64, 192]
    with pytest.raises(AssertionError, match="coalesced"):
        x.check_integrity()


def test_check_integrity_detects_an_out_of_sync_index() -> None:
    x = _three_way()
    x._free_starts.reverse()
    with pytest.raises(AssertionError, match="index"):
        x.check_integrity()
    x = _three_way()
    x._free_starts.pop()
    with pytest.raises(AssertionError, match="index"):
        x.check_integrity()


def test_check_integrity_detects_a_short_tiling() -> None:
    x = _three_way()
    x._free_len[192] -= A
    with pytest.raises(AssertionError, match="capacity"):
        x.check_integrity()
