"""The state an EngineRunner shares between its callers and its engine thread, under one lock:
its lifecycle, its published stats, and the table of open streams (one per request).

Lifecycle:
    starting -> running -> stopping (shutdown asked) -> stopped (the engine thread left its loop)
    starting -> stopped (the build failed, or the start watchdog fired)
    running  -> stopped (a step raised: the engine is dead)
Invariants (each transition and each table change holds the lock):
- a stream is registered only while running; `stop` clears the table and fails every stream
  with EngineUnavailable, so no stream is left waiting on an engine that will not feed it;
- `stats.healthy` is True only while running; a runner that left running never serves again,
  and the first reason it stopped serving is the one reported.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from baton.engine.types import EngineRequestError, EngineStats, EngineUnavailable

STARTING, RUNNING, STOPPING, STOPPED = "starting", "running", "stopping", "stopped"


@dataclass(eq=False)
class Stream:
    """Where the engine thread puts one request's deltas (or its error) for its caller's loop."""

    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue

    def deliver(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass


class StreamTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = STARTING
        self._streams: dict[str, Stream] = {}
        self._stats = EngineStats(healthy=False, reason="engine starting")

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def state(self) -> str:
        return self._state

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, stats: EngineStats) -> bool:
        """starting -> running. False when the runner left starting meanwhile (the watchdog fired)."""
        with self._lock:
            if self._state != STARTING:
                return False
            self._state, self._stats = RUNNING, stats
            return True

    def give_up_start(self, reason: str) -> bool:
        """The start watchdog: starting -> stopped. True when running (the build won the race)."""
        with self._lock:
            if self._state == STARTING:
                self._state, self._stats = STOPPED, EngineStats(healthy=False, reason=reason)
            return self._state == RUNNING

    def stopping(self, reason: str) -> None:
        """running -> stopping: refuse new streams now; the open ones end when the engine stops."""
        with self._lock:
            if self._state == RUNNING:
                self._state, self._stats = STOPPING, EngineStats(healthy=False, reason=reason)

    def stop(self, reason: str) -> None:
        """-> stopped, for good: every open stream gets EngineUnavailable."""
        with self._lock:
            if self._state in (STARTING, RUNNING):  # stopping and stopped keep the first reason
                self._stats = EngineStats(healthy=False, reason=reason)
            self._state = STOPPED
        self.fail_all()

    def unless_stopped(self, action: Callable[[], None]) -> bool:
        """Run `action` under the lock unless stopped (what the engine thread does after `stop` is
        then certain to see it). Returns whether it ran."""
        with self._lock:
            if self._state == STOPPED:
                return False
            action()
            return True

    def publish(self, stats: EngineStats) -> None:
        with self._lock:
            if self._state == RUNNING:  # never overwrite the reason the runner stopped serving
                self._stats = stats

    # ---- streams -----------------------------------------------------------------------------
    def register(self, request_id: str) -> Stream:
        """A stream for a new request on the running loop. Raises EngineUnavailable unless running,
        EngineRequestError when the id is already open."""
        stream = Stream(loop=asyncio.get_running_loop(), out=asyncio.Queue())
        with self._lock:
            if self._state != RUNNING:
                raise EngineUnavailable(self._stats.reason or "engine is not running")
            if request_id in self._streams:
                raise EngineRequestError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
        return stream

    def is_open(self, request_id: str, stream: Stream) -> bool:
        with self._lock:
            return self._streams.get(request_id) is stream

    def close(self, request_id: str, stream: Stream) -> bool:
        """Remove this stream (not a later one with the same id). Returns whether it was open."""
        with self._lock:
            if self._streams.get(request_id) is not stream:
                return False
            del self._streams[request_id]
            return True

    def send(self, request_id: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.deliver(item)

    def finish(self, request_id: str, item: Any) -> None:
        """Deliver the last item of a request (finished delta or error) and close its stream."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.deliver(item)

    def fail_all(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            reason = self._stats.reason or "engine is not running"
        for s in streams:
            s.deliver(EngineUnavailable(reason))
