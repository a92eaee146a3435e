"""Counters of this process's segment connector, and the read-only snapshot the replica publishes.

Each side of the connector owns the counters of the work it does (kv_transfer/segment_connector.py):
the scheduler side counts injections it refused (`unavailable`), the worker side the loads and
captures it ran. vLLM builds the connector itself, so nobody can hand it a counters object or
read it back from the connector; each side takes a fresh one from `new_counters()`, which also
lists it here, and `segment_stats()` sums every listed one. Counters are never dropped from the
list, so the sums only grow for the life of the process (one engine per process; an engine that
is rebuilt in the same process adds to the totals, it does not reset them).

No vLLM or torch import: the replica and the benchmarks read `segment_stats()` cheaply.

Invariants (checked by SegmentStats): every count is non-negative, a load lays at least one
token, so injected_tokens >= injections, and prepared_loads counts a kind of load, so
prepared_loads <= injections.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SegmentStats:
    """Totals since the process started."""

    injections: int = 0  # loads that laid segments into the paged cache
    injected_tokens: int = 0  # prompt positions those loads supplied
    load_seconds: float = 0.0  # time spent laying segments into the paged cache
    # loads whose KV came rotated and cast from the pull path (kv_transfer/prepared.py); the other
    # injections were rotated and cast on the engine thread
    prepared_loads: int = 0
    # loads written on the connector's loader thread while the engine stepped other requests
    # (kv_transfer/segment_loader.py); the other injections were written on the engine thread
    background_loads: int = 0
    load_failures: int = 0  # loads that raised (their blocks were recomputed)
    unavailable: int = 0  # asked to inject, but the segments were missing or did not match
    captures: int = 0  # captures handed back to their submitter
    capture_failures: int = 0  # captures that failed (the submitter recomputes)

    def __post_init__(self) -> None:
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"segment counters cannot be negative: {negative}")
        if self.injected_tokens < self.injections:
            raise ValueError(f"{self.injections} injections but only {self.injected_tokens} injected tokens")
        if self.prepared_loads > self.injections or self.background_loads > self.injections:
            raise ValueError(f"{self.prepared_loads} prepared and {self.background_loads} background loads "
                             f"but only {self.injections} injections")

    def __add__(self, other: SegmentStats) -> SegmentStats:
        return SegmentStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, earlier: SegmentStats) -> SegmentStats:
        """What was counted since `earlier` (raises if `earlier` is not an earlier snapshot)."""
        return SegmentStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_report(self) -> dict[str, float]:
        """The replica's stats-report entries (`segment_<counter>`)."""
        return {f"segment_{f.name}": getattr(self, f.name) for f in fields(self)}


class SegmentCounters:
    """The mutable counters one connector side owns (thread-safe: the replica reads while the
    engine writes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = SegmentStats()

    def _add(self, **delta: float) -> None:
        with self._lock:
            self._stats = self._stats + SegmentStats(**delta)

    def injected(self, tokens: int, seconds: float, prepared: bool = False, background: bool = False) -> None:
        """A load laid `tokens` positions in `seconds`; prepared: from KV rotated in the pull path;
        background: on the loader thread."""
        if tokens <= 0:
            raise ValueError(f"an injection lays at least one token, got {tokens}")
        self._add(injections=1, injected_tokens=tokens, load_seconds=seconds, prepared_loads=int(prepared),
                  background_loads=int(background))

    def load_failed(self) -> None:
        self._add(load_failures=1)

    def refused(self) -> None:
        """An injection was asked for but its segments were missing or did not match."""
        self._add(unavailable=1)

    def captured(self) -> None:
        self._add(captures=1)

    def capture_failed(self) -> None:
        self._add(capture_failures=1)

    def snapshot(self) -> SegmentStats:
        with self._lock:
            return self._stats


_LOCK = threading.Lock()
_COUNTERS: list[SegmentCounters] = []


def new_counters() -> SegmentCounters:
    """Fresh counters for one connector side, counted in `segment_stats()` from now on."""
    counters = SegmentCounters()
    with _LOCK:
        _COUNTERS.append(counters)
    return counters


def segment_stats() -> SegmentStats:
    """This process's segment-connector totals (both sides, every connector built here)."""
    with _LOCK:
        listed = tuple(_COUNTERS)
    total = SegmentStats()
    for c in listed:
        total = total + c.snapshot()
    return total
