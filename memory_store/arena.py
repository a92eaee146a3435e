"""SegmentArena: the memory store's encoded KV in one NIXL-registered buffer.

Every cached segment is one extent of a single buffer (host DRAM, or GPU memory when the store
runs on a GPU), laid out by kv_transfer/segment_refs.py. The buffer is registered with a NIXL agent
once, so an engine replica reads exactly the extents a request needs, by address, straight into its
own memory (kv_transfer/segment_pull.py): no pickling, no Ray object store on the hot path.

Leases make that safe. `lease(entry)` hands out a SegmentRef and promises the extent stays as it is
for `lease_s`; an entry removed from the cache meanwhile (evicted, its fact deleted) has its extent
freed only once every lease on it has run out. A reader that finishes after its lease (measured on
its own clock, from before it asked) discards what it read.

Without NIXL (`register=False`, or no agent could start) the arena still holds the bytes and `load`
copies a segment out (the Ray path). Not thread-safe: the memory store calls it under its lock.

Invariant (check_integrity): the allocator tiles the buffer; every live entry and every extent
waiting out a lease is allocated, and nothing allocated is neither.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.segment_refs import SegmentLayout, SegmentRef, pack, unpack
from kv_transfer.segments import KVSegment
from memory_store.extents import ExtentAllocator

logger = logging.getLogger("baton.memory")

LEASE_S = 30.0


@dataclass(frozen=True)
class ArenaEntry:
    """A segment held in the arena (what the store's SegmentCache holds): its extent and layout."""

    offset: int
    nbytes: int  # the extent's length: what the cache's byte budget counts
    layout: SegmentLayout


class SegmentArena:
    def __init__(self, capacity_bytes: int, *, device: str = "cpu", register: bool = True, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self._alloc = ExtentAllocator(capacity_bytes)
        self._buf = torch.empty(self._alloc.capacity, dtype=torch.uint8, device=device)  # host pages are taken as used
        self._lease_s = lease_s
        self._clock = clock
        self._live: dict[int, ArenaEntry] = {}
        self._leased_until: dict[int, float] = {}  # offset -> when its last lease ends
        self._waiting: dict[int, float] = {}  # removed entries' extents still leased: offset -> free after
        self.agent_name = ""
        self._agent = None
        self._mem_type = "VRAM" if self._buf.is_cuda else "DRAM"
        self._device_id = max(self._buf.get_device(), 0)
        if register:
            self._register()

    def _register(self) -> None:
        from kv_transfer.nixl_agents import make_agent

        name = f"baton-memory-{uuid.uuid4().hex[:12]}"  # a restarted store is a new peer
        try:
            agent = make_agent(name, progress_thread=True, on_cpu=not self._buf.is_cuda)
            agent.register_memory(self._buf)
        except Exception as e:  # noqa: BLE001 - NixlUnavailable or a registration error: the Ray path still serves
            logger.warning("memory arena not served over NIXL (%s); segments go through Ray", e)
            return
        self._agent, self.agent_name = agent, name
        logger.info("memory arena: %d MiB %s registered with NIXL as %s", self._alloc.capacity >> 20, self._mem_type, name)

    # ---- peers ---------------------------------------------------------------------------------
    @property
    def serves_refs(self) -> bool:
        return self._agent is not None

    def agent_metadata(self) -> bytes:
        if self._agent is None:
            raise RuntimeError("the arena is not registered with NIXL")
        return bytes(self._agent.get_agent_metadata())

    # ---- segments ------------------------------------------------------------------------------
    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` could be stored once every live entry were removed (extents waiting
        out a lease stay taken)."""
        return self._alloc.size_of(nbytes) <= self._alloc.capacity - self.waiting_bytes

    def extent_bytes(self, nbytes: int) -> int:
        """Length of the extent a segment of `nbytes` takes (what its ArenaEntry.nbytes will be)."""
        return self._alloc.size_of(nbytes)

    def put(self, seg: KVSegment) -> ArenaEntry | None:
        """Copy `seg` into a free extent; None when no free extent is large enough (the caller
        evicts and retries, or does not cache it)."""
        SegmentLayout.of(seg)  # a segment the layout refuses raises here, before anything is allocated
        self._reap()
        nbytes = seg.nbytes
        offset = self._alloc.alloc(nbytes)
        if offset is None:
            return None
        try:
            layout = pack(seg, self._buf[offset : offset + nbytes])
        except Exception:
            self._alloc.free(offset)
            raise
        entry = ArenaEntry(offset, self._alloc.length(offset), layout)
        self._live[offset] = entry
        return entry

    def load(self, entry: ArenaEntry) -> KVSegment:
        """A copy of the entry's segment (for callers in another process without NIXL)."""
        self._check_live(entry)
        seg = unpack(self._buf[entry.offset : entry.offset + entry.layout.nbytes], entry.layout)
        return KVSegment(seg.token_ids, seg.keys.clone(), seg.values.clone())

    def lease(self, entry: ArenaEntry) -> SegmentRef:
        """A reference to read the entry by; its extent stays unchanged for lease_s from now."""
        self._check_live(entry)
        if self._agent is None:
            raise RuntimeError("the arena is not registered with NIXL")
        until = self._clock() + self._lease_s
        self._leased_until[entry.offset] = max(until, self._leased_until.get(entry.offset, 0.0))
        return SegmentRef(self.agent_name, self._buf.data_ptr() + entry.offset, self._device_id, self._mem_type,
                          entry.layout, self._lease_s)

    def release(self, entry: ArenaEntry) -> None:
        """The cache dropped `entry`: free its extent now, or when its last lease ends."""
        if self._live.get(entry.offset) is not entry:
            return  # released already
        del self._live[entry.offset]
        until = self._leased_until.pop(entry.offset, 0.0)
        if until > self._clock():
            self._waiting[entry.offset] = until
        else:
            self._alloc.free(entry.offset)

    def _reap(self) -> None:
        now = self._clock()
        for offset in [o for o, until in self._waiting.items() if until <= now]:
            del self._waiting[offset]
            self._alloc.free(offset)

    def _check_live(self, entry: ArenaEntry) -> None:
        if self._live.get(entry.offset) is not entry:
            raise KeyError("the entry is not in the arena (released)")

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    def live_offsets(self) -> set[int]:
        return set(self._live)

    @property
    def waiting_bytes(self) -> int:
        """Bytes of removed entries still held for a reader's lease (a lease that has ended counts
        as free: the next put reclaims it)."""
        now = self._clock()
        return sum(self._alloc.length(o) for o, until in self._waiting.items() if until > now)

    def check_integrity(self) -> None:
        self._alloc.check_integrity()
        held = set(self._live) | set(self._waiting)
        if set(self._live) & set(self._waiting):
            raise AssertionError("an extent is both live and waiting out a lease")
        allocated = {o for o in held if o in self._alloc}
        if allocated != held or self._alloc.used_bytes != sum(self._alloc.length(o) for o in held):
            raise AssertionError("allocated extents and the arena's entries disagree")
        if not set(self._leased_until) <= set(self._live):
            raise AssertionError("a lease names an extent that is not live")
        for o, e in self._live.items():
            if e.offset != o or e.nbytes != self._alloc.length(o) or e.layout.nbytes > e.nbytes:
                raise AssertionError(f"entry at {o} does not match its extent")
