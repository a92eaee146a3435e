"""Bounded work per ingress: the one owner of the count of generation requests in flight.

`InflightLimit.acquire()` admits a request and returns its `Ticket`, or raises the 429
`overloaded` APIError (with Retry-After) when the limit is reached: the ingress answers at once
rather than queue without bound (the engines' own queues are bounded by Serve). Whatever ends
the request — completion, an error, the client going away mid-stream, a stream the server never
starts — calls `Ticket.release()`; it gives the slot back exactly once, however many paths call it.

The limit is the hard cap (`ingress.max_inflight_requests`) in `fixed` mode; in `adaptive` mode
(`ingress.admission`) it is a router.chat_admission.ChatLimiter's limit, held to a TTFT target
under the same cap. Tickets carry the latency signal: `first_token()` reports the request's TTFT;
a ticket still without a first token when it is `ttft_target_s` old is reported as a miss right
away (checked whenever a request arrives or reports); one released without a first token reports
what `released_sample` makes of its status. Each ticket reports at most once; refused requests
never report. The frontend only acquires tickets and hands them over.

Each sample carries its concurrency: the most requests seen sharing the pools with it, from its
admission to its report — this ingress's own in flight, and the pools' in flight as the directory
last told it (`note_pool`, from each turn's plan: every ingress's requests). The limiter predicts
the effect of one more request from it (router/chat_admission.py: headroom), so an ingress whose
requests ran while another ingress was idle does not take that quiet for headroom. The
directory's count lags by up to one report period, so "others" can briefly include requests of
this ingress that just ended: an error on the side of fewer admissions.

Refusals are cheap and tell the client when to come back:
  * `precheck()` refuses before any work on the request (the body is not parsed, nothing is
    rendered or tokenized) whenever `acquire()` would refuse now; `acquire()` stays the one
    authoritative check (requests of the same replica may have taken the last slot meanwhile).
  * Retry-After is this ingress's estimate of when a slot frees: the median duration of its
    recent completed requests (the last RECENT_DURATIONS 2xx; before any completed, the age of
    the oldest running one) divided by the current limit, rounded up, within [1,
    MAX_RETRY_AFTER_S] (1 with nothing running or done). A fixed 1 s made
    every refused client of a saturated ingress retry each second: on a 2-core machine that
    storm of 429s took CPU from the engines and slowed the requests that were admitted.
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from deployments.errors import overloaded
from deployments.metrics import AdmissionMetrics
from router.chat_admission import ChatAdmissionConfig, ChatLimiter, released_sample
from router.policy import TurnPlan

UNBOUNDED = 1 << 30
RECENT_DURATIONS = 32
MAX_RETRY_AFTER_S = 30


def status_of(exc: BaseException | None) -> int:
    """The HTTP status a request ended with: 200 without an exception, an APIError's own status,
    499 when the task was cancelled (the client went away), 500 otherwise."""
    if exc is None:
        return 200
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return 499
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else 500


class Ticket:
    """One admitted request's slot; `release()` is idempotent. Also a context manager (the status
    it releases with comes from the exception that left the block, if any)."""

    __slots__ = ("_limit", "_released", "_reported", "concurrency", "others", "started")

    def __init__(self, limit: InflightLimit, started: float, concurrency: int, others: int):
        self._limit = limit
        self._released = False
        self._reported = False
        self.started = started
        self.concurrency = concurrency  # the most requests seen sharing the pools with this one
        self.others = others  # the most of them other ingress replicas sent

    def _saw(self, own: int, pool: int) -> None:
        self.concurrency = max(self.concurrency, own, pool)
        self.others = max(self.others, pool - own)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def reported(self) -> bool:
        """Whether this request's TTFT sample (or miss) has been given to the limit."""
        return self._reported

    def first_token(self) -> None:
        """The first generated token reached the ingress: report the TTFT (once)."""
        self._limit._first_token(self)

    def release(self, status: int | None = None) -> None:
        """Give the slot back (once). status: how the request ended (None: unknown — a stream
        that was never started, i.e. the client went away)."""
        if not self._released:
            self._released = True
            self._limit._give_back(self, status)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release(status_of(exc))


class InflightLimit:
    """At most `limit` requests admitted and not yet released (`limit` <= `cap`, the hard cap)."""

    def __init__(self, limit: int = UNBOUNDED, admission: ChatAdmissionConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, metrics: AdmissionMetrics | None = None):
        if limit < 1:
            raise ValueError(f"the in-flight limit must be at least 1, not {limit}")
        self._cap = limit
        self._clock = clock
        self._metrics = metrics
        self._inflight = 0
        self._pool_queueing = False
        self._pool_in_flight = 0
        self._pending: dict[Ticket, float] = {}  # admitted, not yet reported; in admission order
        self._durations: deque[float] = deque(maxlen=RECENT_DURATIONS)  # seconds, completed (2xx) requests
        self._running: dict[Ticket, None] = {}  # admitted and not released, oldest first
        self.totals = {"admitted": 0, "refused": 0, "samples": 0, "overdue": 0}
        adaptive = admission is not None and admission.mode == "adaptive"
        self._ctl = ChatLimiter(admission, limit, clock()) if adaptive and admission is not None else None
        self.mode = "adaptive" if self._ctl is not None else "fixed"
        if metrics is not None:
            metrics.admission_limit(self.limit)

    @property
    def limit(self) -> int:
        return self._ctl.limit if self._ctl is not None else self._cap

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def inflight(self) -> int:
        return self._inflight

    def note_pool(self, plan: TurnPlan) -> None:
        """The directory's latest view of the pools, from a turn's plan: whether every live decoder
        reports waiting requests, and how many requests the pools serve (all ingresses')."""
        self._pool_queueing = plan.pool_queueing
        self._pool_in_flight = plan.pool_in_flight
        for ticket in self._pending:  # the requests awaiting their first token share the pools with these
            ticket._saw(self._inflight, plan.pool_in_flight)

    def acquire(self) -> Ticket:
        """A ticket for one request, or APIError 429 `overloaded` (with Retry-After) when full."""
        now = self._clock()
        if not self._room(now):
            self._refuse()
        self._count("admitted")
        self._inflight += 1
        ticket = Ticket(self, now, max(self._inflight, self._pool_in_flight), max(0, self._pool_in_flight - self._inflight))
        self._running[ticket] = None
        if self._ctl is not None:
            for other in self._pending:
                other._saw(self._inflight, 0)
            self._pending[ticket] = now
        return ticket

    def precheck(self) -> None:
        """Raise the 429 that acquire() would raise now, before any work on the request is done;
        admits nothing (acquire() must still be called)."""
        if not self._room(self._clock()):
            self._refuse()

    def retry_after_s(self) -> int:
        """When a refused client should come back (see the module docstring)."""
        if self._durations:
            duration = statistics.median(self._durations)
        elif self._running:  # nothing completed yet: the oldest running request's age is a lower bound
            duration = self._clock() - next(iter(self._running)).started
        else:
            return 1
        per_slot = duration / max(1, self.limit)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(per_slot)))

    def _room(self, now: float) -> bool:
        if self._ctl is not None:
            self._control(now)
            # a refused client is demand until the Retry-After it is about to be told runs out
            return self._ctl.admit(self._inflight, now, self.retry_after_s())
        return self._inflight < self._cap

    def _refuse(self) -> None:
        self._count("refused")
        raise overloaded(f"{self._inflight} requests in flight at this ingress (limit {self.limit}); retry shortly",
                         retry_after_s=self.retry_after_s())

    def snapshot(self) -> dict[str, Any]:
        """For /baton/stats: mode, current limit, hard cap, in flight, and the counts so far."""
        return {"mode": self.mode, "limit": self.limit, "cap": self._cap, "inflight": self._inflight,
                "pool_queueing": self._pool_queueing, "pool_in_flight": self._pool_in_flight, "retry_after_s": self.retry_after_s(), **self.totals}

    # ---- the tickets' side (only Ticket calls these) --------------------------------------------

    def _first_token(self, ticket: Ticket) -> None:
        if self._ctl is not None and self._pending.pop(ticket, None) is not None:
            now = self._clock()
            self._report(ticket, now - ticket.started, now)
            self._control(now)

    def _give_back(self, ticket: Ticket, status: int | None) -> None:  # once per ticket
        self._inflight -= 1
        del self._running[ticket]
        if status is not None and 200 <= status < 300:
            self._durations.append(max(0.0, self._clock() - ticket.started))
        if self._ctl is not None and self._pending.pop(ticket, None) is not None:
            now = self._clock()
            sample = released_sample(now - ticket.started, status, self._ctl.config.ttft_target_s)
            if sample is not None:
                self._report(ticket, sample, now)
            else:
                ticket._reported = True
            self._control(now)

    # ---- control -------------------------------------------------------------------------------

    def _report(self, ticket: Ticket, sample: float, now: float) -> None:
        assert self._ctl is not None
        ticket._reported = True
        self.totals["samples"] += 1
        self._ctl.observe(sample, now, max(ticket.concurrency, self._inflight, 1), ticket.others)

    def _control(self, now: float) -> None:
        """Overdue tickets become misses, then the control law runs (it acts once per period)."""
        assert self._ctl is not None
        cutoff = now - self._ctl.config.ttft_target_s
        while self._pending:
            ticket, started = next(iter(self._pending.items()))
            if started >= cutoff:
                break
            del self._pending[ticket]
            self.totals["overdue"] += 1
            self._report(ticket, math.inf, now)
        decision = self._ctl.update(now, self._inflight, self._pool_queueing)
        if self._metrics is not None and decision.reason != "period_not_elapsed":
            self._metrics.admission_limit(self._ctl.limit)  # each evaluation: a gauge set once at start can be missed by the export

    def _count(self, outcome: str) -> None:
        self.totals[outcome] += 1
        if self._metrics is not None:
            self._metrics.admission(outcome)
