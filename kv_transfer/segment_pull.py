"""SegmentPuller: an engine replica reads memory segments out of the memory store's arena over NIXL.

One NIXL agent per process (`process_puller()`), made on first use, with no progress thread of its
own: it completes its reads by polling. `read(refs, asked_at)` posts one READ of every extent a
request needs, each into a fresh tensor of this process, waits for it, and returns the segments
(views of those tensors; each segment owns its tensor). Blocking: call it from a worker thread.

Safety: the store keeps an extent unchanged for the ref's lease, counted from when it answered; the
reader counts from `asked_at`, taken before it asked, so its clock runs ahead of the store's. A read
that ends after LEASE_MARGIN of the lease is discarded (PullFailed), as is any failed, timed-out or
malformed one: the caller encodes those segments instead.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kv_transfer.segment_refs import SegmentRef, unpack
from kv_transfer.segments import KVSegment

logger = logging.getLogger("baton.kv_transfer")

LEASE_MARGIN = 0.8  # use at most this share of a lease
POLL_S = 0.0002
TIMEOUT_S = 5.0


class PullFailed(RuntimeError):
    """The segments could not be read (the caller encodes them instead)."""


@dataclass(frozen=True)
class PullResult:
    segments: tuple[KVSegment, ...]
    nbytes: int
    seconds: float


class SegmentPuller:
    def __init__(self, agent: Any, timeout_s: float = TIMEOUT_S, device: str = "cpu") -> None:
        self._agent = agent
        self._device = device  # where pulled segments land (a replica's own GPU on GPUs)
        self._timeout_s = timeout_s
        self._peers: set[str] = set()
        self._lock = threading.Lock()  # peers; NIXL's own calls are thread-safe (strict sync)

    @classmethod
    def create(cls, timeout_s: float = TIMEOUT_S, device: str = "cpu") -> SegmentPuller:
        from kv_transfer.nixl_agents import make_agent

        agent = make_agent(f"baton-pull-{uuid.uuid4().hex[:12]}", progress_thread=False, on_cpu=device == "cpu")
        return cls(agent, timeout_s, device)

    def knows(self, agent_name: str) -> bool:
        with self._lock:
            return agent_name in self._peers

    def add_peer(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._peers.add(name)
        return name

    def read(self, refs: Sequence[SegmentRef], asked_at: float) -> PullResult:
        """Read every ref (all from one peer) into this process; raises PullFailed."""
        if not refs:
            return PullResult((), 0, 0.0)
        peers = {r.agent for r in refs}
        if len(peers) != 1 or not self.knows(next(iter(peers))):
            raise PullFailed(f"refs name {sorted(peers)}; exactly one known peer expected")
        t0 = time.monotonic()
        dst = [torch.empty(r.nbytes, dtype=torch.uint8, device=self._device) for r in refs]
        remote = np.array([(r.addr, r.nbytes, r.device_id) for r in refs], dtype=np.uint64)
        reg = self._agent.register_memory(dst)
        handle = None
        try:
            local = self._agent.get_xfer_descs(dst)
            remote_descs = self._agent.get_xfer_descs(remote, refs[0].mem_type)
            if local is None or remote_descs is None:
                raise PullFailed("NIXL refused the descriptors")
            handle = self._agent.initialize_xfer("READ", local, remote_descs, refs[0].agent)
            state = self._agent.transfer(handle)
            deadline = t0 + self._timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise PullFailed(f"read of {len(refs)} segments timed out after {self._timeout_s} s")
                time.sleep(POLL_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise PullFailed(f"NIXL read ended in state {state}")
        except PullFailed:
            raise
        except Exception as e:  # any NIXL error: the caller encodes instead
            raise PullFailed(f"NIXL read failed: {type(e).__name__}: {e}") from e
        finally:
            if handle is not None:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - a handle still in flight is released by its agent later
                    logger.warning("NIXL transfer handle not released")
            self._agent.deregister_memory(reg)
        done = time.monotonic()
        lease = min(r.lease_s for r in refs)
        if done - asked_at > LEASE_MARGIN * lease:
            raise PullFailed(f"read ended {done - asked_at:.2f} s after the lookup; its lease is {lease} s")
        segs = tuple(unpack(d, r.layout) for d, r in zip(dst, refs, strict=True))
        return PullResult(segs, sum(r.nbytes for r in refs), done - t0)


_PULLER: SegmentPuller | None = None
_PULLER_FAILED = False
_PULLER_LOCK = threading.Lock()


def process_puller() -> SegmentPuller | None:
    """This process's puller, made on first call; None if NIXL cannot run here (logged once)."""
    global _PULLER, _PULLER_FAILED
    with _PULLER_LOCK:
        if _PULLER is None and not _PULLER_FAILED:
            from kv_transfer.nixl_agents import NixlUnavailable

            try:
                _PULLER = SegmentPuller.create()
            except NixlUnavailable as e:
                _PULLER_FAILED = True
                logger.warning("memory segments will come through Ray: %s", e)
        return _PULLER
