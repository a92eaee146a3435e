"""ExtentAllocator: first-fit allocation of aligned byte ranges in one fixed-size arena.

Pure bookkeeping (no memory of its own): the memory store's arena (memory_store/arena.py) asks it
where a segment goes. Sizes are rounded up to `align`. Free ranges are kept sorted and coalesced.

Invariant (check_integrity): allocated and free ranges are aligned, disjoint, and tile
[0, capacity) exactly; no two free ranges touch.
"""
from __future__ import annotations

import bisect

ALIGN = 4096


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if capacity < align:
            raise ValueError(f"capacity must hold at least one {align}-byte unit, got {capacity}")
        self.align = align
        self.capacity = capacity - capacity % align
        self._free_starts: list[int] = [0]  # sorted starts of free ranges
        self._free_len: dict[int, int] = {0: self.capacity}
        self._used: dict[int, int] = {}  # start -> length of allocated ranges

    def size_of(self, nbytes: int) -> int:
        """Bytes an allocation of `nbytes` takes (rounded up to the alignment)."""
        return -(-max(nbytes, 1) // self.align) * self.align

    def alloc(self, nbytes: int) -> int | None:
        """Start of a free range of size_of(nbytes) bytes, now allocated; None if none is free."""
        size = self.size_of(nbytes)
        for i, start in enumerate(self._free_starts):
            length = self._free_len[start]
            if length < size:
                continue
            del self._free_len[start]
            if length == size:
                del self._free_starts[i]
            else:
                self._free_starts[i] = start + size
                self._free_len[start + size] = length - size
            self._used[start] = size
            return start
        return None

    def free(self, start: int) -> None:
        """Return an allocated range; raises KeyError for a start that is not allocated."""
        size = self._used.pop(start)
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts) and self._free_starts[i] == start + size:  # merge with the next
            size += self._free_len.pop(self._free_starts.pop(i))
        if i > 0 and (prev := self._free_starts[i - 1]) + self._free_len[prev] == start:  # and the previous
            self._free_len[prev] += size
            return
        self._free_starts.insert(i, start)
        self._free_len[start] = size

    def length(self, start: int) -> int:
        return self._used[start]

    def __contains__(self, start: int) -> bool:
        """Whether an allocated range starts at `start`."""
        return start in self._used

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def largest_free(self) -> int:
        return max(self._free_len.values(), default=0)

    def check_integrity(self) -> None:
        ranges = sorted([(s, n, "used") for s, n in self._used.items()] + [(s, n, "free") for s, n in self._free_len.items()])
        if self._free_starts != sorted(self._free_len):
            raise AssertionError("free-range index out of order or out of sync")
        pos = 0
        last = ""
        for start, length, kind in ranges:
            if start != pos or length <= 0 or start % self.align or length % self.align:
                raise AssertionError(f"range {start}+{length} ({kind}) breaks the tiling at {pos}")
            if kind == last == "free":
                raise AssertionError(f"free ranges touch at {start}: not coalesced")
            pos, last = start + length, kind
        if pos != self.capacity:
            raise AssertionError(f"ranges end at {pos}, capacity is {self.capacity}")
