"""Reusable flat buffers for prepared injections (kv_transfer/prepared.py).

A k = 50 injection of SmolLM2 is two ~32 MB tensors per request. Allocations that large are
fresh mmaps, so every request paid their first-touch page faults (~20 ms of a ~45 ms prepare,
measured here) and returned the pages at its end. The pool keeps buffers of finished injections
and hands them to the next one: a buffer returns when the PreparedInjection viewing it is
garbage-collected (weakref.finalize), so no buffer is reused while anything still holds the
injection (a request in the engine, a submitter that sends it again).

Bounded: at most `capacity_bytes` of idle buffers are kept (the oldest are dropped first); a
request takes the smallest idle buffer that is large enough and at most `slack` times its need.
Thread-safe (prepares run in worker threads, finalizers in whichever thread drops the last
reference).
Invariant (check_integrity): the idle bytes are the sum of the idle buffers and never exceed the capacity.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

ROUND = 1 << 20  # elements a buffer's size is rounded up to, so nearby sizes share buffers


class BufferPool:
    def __init__(self, capacity_bytes: int = 256 << 20, slack: float = 1.5):
        if capacity_bytes < 0 or slack < 1.0:
            raise ValueError(f"capacity {capacity_bytes} must be >= 0 and slack {slack} >= 1")
        self._capacity = capacity_bytes
        self._slack = slack
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []  # oldest first
        self._idle_bytes = 0
        self.reused = 0
        self.allocated = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of at least `numel` elements of `dtype` (its contents are arbitrary)."""
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.dtype == dtype and numel <= b.numel() <= self._slack * numel + ROUND]
            if fits:
                buf = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))  # by index: tensors compare elementwise
                self._idle_bytes -= buf.nbytes
                self.reused += 1
                return buf
            self.allocated += 1
        return torch.empty(-(-numel // ROUND) * ROUND, dtype=dtype)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken from this pool; nothing may use it afterwards."""
        if buf.nbytes > self._capacity:
            return
        with self._lock:
            self._idle.append(buf)
            self._idle_bytes += buf.nbytes
            while self._idle_bytes > self._capacity:
                self._idle_bytes -= self._idle.pop(0).nbytes

    def give_when_dead(self, owner: Any, *bufs: torch.Tensor) -> None:
        """Return `bufs` once `owner` (the object that views them) is garbage-collected."""
        weakref.finalize(owner, self._give_all, bufs)

    def _give_all(self, bufs: tuple[torch.Tensor, ...]) -> None:
        for b in bufs:
            self.give(b)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(b.nbytes for b in self._idle)
            if total != self._idle_bytes or total > self._capacity:
                raise AssertionError(f"idle bytes {self._idle_bytes} (counted {total}), capacity {self._capacity}")
