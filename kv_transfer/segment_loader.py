"""Asynchronous segment loads: the writes of a request's injected KV run on one background
thread while the engine goes on stepping its other requests (kv_transfer/segment_worker.py).

vLLM's protocol for an asynchronous load (the scheduler side answered
`get_num_new_matched_tokens` with load_async=True): the request waits in WAITING_FOR_REMOTE_KVS
with its blocks allocated and not yet cached; the worker reports the request id in
`finished_recving` once its KV is in those blocks, and the scheduler then schedules it. A load
that failed is reported the same way, with its blocks among `invalid_block_ids` of the same
output, so vLLM recomputes them (kv_load_failure_policy="recompute"). A request aborted while its
load runs keeps its blocks until that report (vLLM delays freeing them), so a write never lands in
blocks that were given to another request.

Invariant (check_integrity): every submitted load is exactly one of running or done-unreported,
until `drain` reports it, once.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

logger = logging.getLogger("baton.kv_transfer.segments")


@dataclass(frozen=True)
class Drained:
    """What `drain` hands vLLM: the requests whose loads ended, and the blocks of those that failed."""

    finished: frozenset[str]
    failed_blocks: frozenset[int]


class AsyncLoader:
    """One background thread runs loads in submission order; `drain` collects the ended ones."""

    def __init__(self, after_load: Callable[[], None] | None = None) -> None:
        """after_load: run on the loading thread once a load's writes are issued, before the load
        counts as done (on CUDA: wait for the copy stream, so "done" means the KV is there)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-segment-load")
        self._after_load = after_load
        self._lock = threading.Lock()
        self._running: dict[str, frozenset[int]] = {}  # request id → its load's blocks
        self._done: dict[str, frozenset[int]] = {}  # request id → blocks that failed (empty: loaded)
        self.submitted = 0
        self.failed = 0

    def submit(self, request_id: str, blocks: frozenset[int], load: Callable[[], None]) -> None:
        """Run `load` in the background; a request has at most one load in flight."""
        with self._lock:
            if request_id in self._running or request_id in self._done:
                raise ValueError(f"request {request_id} already has a segment load in flight")
            self._running[request_id] = blocks
            self.submitted += 1
        future = self._pool.submit(self._run, load)
        future.add_done_callback(lambda f: self._ended(request_id, f))

    def _run(self, load: Callable[[], None]) -> None:
        load()
        if self._after_load is not None:
            self._after_load()

    def _ended(self, request_id: str, future: Future[None]) -> None:
        error = future.exception()
        with self._lock:
            blocks = self._running.pop(request_id)
            if error is not None:
                self.failed += 1
            self._done[request_id] = blocks if error is not None else frozenset()
        if error is not None:
            logger.error("segment load for %s failed; its blocks will be recomputed", request_id,
                         exc_info=(type(error), error, error.__traceback__))

    def drain(self) -> Drained:
        """The loads that ended since the last drain (each reported once)."""
        with self._lock:
            done, self._done = self._done, {}
        failed = frozenset(b for blocks in done.values() for b in blocks)
        return Drained(frozenset(done), failed)

    @property
    def in_flight(self) -> int:
        """Loads submitted and not yet drained."""
        with self._lock:
            return len(self._running) + len(self._done)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no load is running (tests and shutdown). Returns False on timeout."""
        marker = self._pool.submit(lambda: None)  # the pool's one thread runs it after every earlier load
        try:
            marker.result(timeout=timeout_s)
        except TimeoutError:
            return False
        return True

    def check_integrity(self) -> None:
        with self._lock:
            both = set(self._running) & set(self._done)
            if both:
                raise AssertionError(f"requests both loading and done: {sorted(both)}")
            if self.submitted < len(self._running) + len(self._done) or self.failed > self.submitted:
                raise AssertionError(f"counts: {self.submitted} submitted, {self.failed} failed, "
                                     f"{len(self._running)} running, {len(self._done)} done")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
