"""Bounded work per ingress: the one owner of the count of generation requests in flight.

`InflightLimit.acquire()` admits a request and returns its `Ticket`, or raises the 429
`overloaded` APIError (with Retry-After) when the limit is reached: the ingress answers at once
rather than queue without bound (the engines' own queues are bounded by Serve). Whatever ends
the request — completion, an error, the client going away mid-stream, a stream the server never
starts — calls `Ticket.release()`; it gives the slot back exactly once, however many paths call it.

Nothing else changes the count: the limit can become adaptive (e.g. to a latency target) behind
this one object without touching the frontend.
"""
from __future__ import annotations

from types import TracebackType

from deployments.errors import overloaded

UNBOUNDED = 1 << 30


class Ticket:
    """One admitted request's slot; `release()` is idempotent. Also a context manager."""

    __slots__ = ("_limit", "_released")

    def __init__(self, limit: InflightLimit):
        self._limit = limit
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limit._give_back()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class InflightLimit:
    """At most `limit` requests admitted and not yet released."""

    def __init__(self, limit: int = UNBOUNDED):
        if limit < 1:
            raise ValueError(f"the in-flight limit must be at least 1, not {limit}")
        self._limit = limit
        self._inflight = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def inflight(self) -> int:
        return self._inflight

    def acquire(self) -> Ticket:
        """A ticket for one request, or APIError 429 `overloaded` (Retry-After: 1) when full."""
        if self._inflight >= self._limit:
            raise overloaded(f"{self._inflight} requests in flight at this ingress (limit {self._limit}); retry shortly")
        self._inflight += 1
        return Ticket(self)

    def _give_back(self) -> None:  # only Ticket.release calls this, once per ticket
        self._inflight -= 1
