"""Adaptive admission of chat / completion requests at one ingress, pure: the clock is injected.

What the target is about: time to first token (TTFT) as the ingress sees it — from admission to
the first generated token coming back from the engine pools. Chat requests ask for any number of
output tokens, so whole-request latency mixes the load (queueing, prefill contention) with the
request's own length; TTFT is where overload shows up (the first token waits for a queue slot and
for prefill) and it does not depend on max_tokens. One sample per admitted request:

    first token arrived                              -> its TTFT
    still no first token ttft_target_s after admission -> +inf at once (a miss; the request is
                                                         "overdue" and already late whatever
                                                         happens next, so it is not awaited)
    ended with no token (`released_sample`):
        2xx (empty output)                           -> elapsed time
        client gone (499, or a stream never started) -> elapsed if already past the target, else none
        other 4xx (the request's own fault)          -> none: not a load signal
        429 / 5xx (pool queue full, engine lost ...) -> +inf (a miss)

Refused requests were never admitted and give no sample. Each admitted request gives at most one.

Control law (`update(now, inflight)`, at most once per `control_period_s`), AIMD as the real-time
controller in router/admission.py, over the samples of the window (observed at t with
t >= now - window_s and t >= the last reset; the window is reset whenever the limit changes, a
drain-hold is taken, or a period did not bind (whatever its samples), so a decision only looks at
requests observed under the current limit, and a growth only at requests observed while it held
demand back —
TTFTs of an ingress with room to spare, such as requests sent one at a time before a burst, say
nothing about the latency at the limit):

    samples < min_samples                       -> hold  too_few_samples
    q = nearest-rank `percentile` of the window (default p99; with few samples that is the max)
    q > target and inflight > limit             -> hold  draining (the last decrease has not bitten)
    q > target                                  -> limit = max(min_limit, floor(limit * factor))
    q <= target and limit not binding           -> hold  not_binding
    q <= target and pool_queueing               -> hold  pool_queueing
    q <= target and limit == cap                -> hold  at_limit
    c * (limit + step + o_peak) > target        -> hold  no_headroom   (growth_headroom only)
    q <= target                                 -> limit = min(cap, limit + additive_step)

Headroom: when TTFT grows in proportion to the requests sharing the engines (a CPU or GPU shared
by every admitted prefill), a sample's TTFT over its concurrency n (the most requests seen
sharing the pools with it, every ingress's; at least 1) is its cost per request, and c is the
`percentile` of those costs over the window. Each sample also carries `others`: the most
requests of other ingress replicas seen in the pools during it; o_peak is the largest in the
window. At a limit of limit + step this ingress can have limit + step requests in flight beside
the others' o_peak, so TTFT would reach about c * (limit + step + o_peak); with
`growth_headroom` the limit grows only while that is still on target, so it settles just under
the knee of the latency curve instead of probing over it once per cycle (the classic AIMD
sawtooth, `growth_headroom: false`, runs one period per cycle over the target: a whole-run p99
just above it). Where TTFT is flat in the load (a GPU below its knee) c is far under the target
and the check never binds. With one ingress (others 0) and samples taken at the limit, this is
q * (limit + step) / limit. With several ingress replicas sharing the pools, an ingress whose
requests ran while another was briefly idle does not take that quiet for headroom: the other's
requests, seen at any moment of the window, count at their peak.

Binding: there is demand the limit holds back — a request was refused in the period, or a
refused client is still waiting out the Retry-After it was given (`admit(..., waits_s=)`).
A full limit is not enough: at a limit of 1 every request fills it, and a client sending one
request at a time would raise the limit with no demand for a second (then the first burst runs
over the target). An idle ingress never raises its limit. `pool_queueing` is the
directory's view (every live decoder reports requests waiting): more admitted requests would only
wait in the engines' queues, so the limit does not grow then (it can still shrink).

Invariants (`check_integrity`): min_limit <= limit <= cap; window samples sorted by time, none
before the last reset, none negative, every concurrency >= 1 and every `others` >= 0.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ChatAdmissionConfig(BaseModel):
    """`ingress.admission` (YAML). fixed: at most ingress.max_inflight_requests in flight (the
    default); adaptive: a limit in [min_limit, max_inflight_requests] held to a TTFT target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["fixed", "adaptive"] = Field("fixed", description="fixed: the hard cap alone; adaptive: AIMD on TTFT under the cap")
    ttft_target_s: float = Field(2.0, gt=0, description="time to first token the admitted requests are held to (at `percentile`)")
    percentile: float = Field(0.99, gt=0, le=1, description="quantile of the window's TTFTs compared with the target")
    initial_limit: int = Field(4, ge=1, description="limit at start (clipped to [min_limit, max_inflight_requests])")
    min_limit: int = Field(1, ge=1, description="the limit never falls below this")
    additive_step: int = Field(1, ge=1, description="added per period when binding, on target, and the pool is not queueing")
    multiplicative_factor: float = Field(0.5, gt=0, lt=1, description="limit <- floor(limit * factor) when over target")
    control_period_s: float = Field(1.0, gt=0, description="the law runs at most once per this many seconds")
    window_s: float = Field(20.0, gt=0, description="TTFT samples older than this are dropped")
    min_samples: int = Field(3, ge=1, description="samples needed in the window before the limit moves")
    growth_headroom: bool = Field(
        True, description="grow only while q * (limit + step) / limit stays on target (TTFT proportional to load); "
        "false: grow whenever on target (AIMD probing over the target once per cycle)")

    @model_validator(mode="after")
    def _bounds(self) -> ChatAdmissionConfig:
        if self.min_limit > self.initial_limit:
            raise ValueError(f"need min_limit <= initial_limit, got {self.min_limit} > {self.initial_limit}")
        if self.window_s < self.control_period_s:
            raise ValueError(f"window_s ({self.window_s}) must be >= control_period_s ({self.control_period_s})")
        return self


Action = Literal["increase", "decrease", "hold"]
Reason = Literal["overshoot", "on_target", "too_few_samples", "not_binding", "pool_queueing", "no_headroom", "draining",
                 "at_limit", "period_not_elapsed"]


@dataclass(frozen=True)
class LimitDecision:
    """One call of update(). quantile_s is None when the window was not evaluated or empty."""

    at: float
    action: Action
    reason: Reason
    limit_before: int
    limit_after: int
    quantile_s: float | None
    samples: int
    binding: bool


def nearest_rank(values: list[float], q: float) -> float:
    """The smallest value >= a fraction q of the values (values non-empty, q in (0, 1]); +inf-safe."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def released_sample(elapsed_s: float, status: int | None, target_s: float) -> float | None:
    """The TTFT sample of a request released before its first token (see the module docstring).
    status None: the stream was never started (the client went away): treated as 499."""
    if status is not None and 200 <= status < 300:
        return elapsed_s
    if status is None or status == 499:
        return elapsed_s if elapsed_s > target_s else None
    if 400 <= status < 500 and status != 429:
        return None
    return math.inf


class ChatLimiter:
    """Owns the adaptive in-flight limit and the TTFT window; see the module docstring."""

    def __init__(self, config: ChatAdmissionConfig, cap: int, now: float = 0.0) -> None:
        if cap < config.min_limit:
            raise ValueError(f"the hard cap ({cap}) is below min_limit ({config.min_limit})")
        self.config = config
        self.cap = cap
        self.limit = max(config.min_limit, min(cap, config.initial_limit))
        self._samples: list[tuple[float, float, int, int]] = []  # (observed_at, ttft_s, concurrency, others), by time
        self._window_start = now
        self._period_start = now
        self._binding = False  # a refusal since the last evaluation
        self._demand_until = -math.inf  # a refused client waits out its Retry-After until then

    # ---- inputs ---------------------------------------------------------------------------------

    def admit(self, inflight: int, now: float = -math.inf, waits_s: float = 0.0) -> bool:
        """May one more request start while `inflight` are in flight? A refusal marks the limit
        binding, and keeps it so until now + waits_s (the Retry-After the refused client is told).
        Does not change the limit."""
        if inflight < 0:
            raise ValueError(f"inflight must be >= 0, got {inflight}")
        room = inflight < self.limit
        if not room:
            self._binding = True
            self._demand_until = max(self._demand_until, now + waits_s)
        return room

    def observe(self, ttft_s: float, now: float, concurrency: int = 1, others: int = 0) -> None:
        """One admitted request's TTFT sample (+inf: a miss), observed at `now`; concurrency: the
        most requests seen sharing the engines with it (>= 1); others: the most of them sent by
        other ingress replicas (>= 0; see the module docstring)."""
        if math.isnan(ttft_s) or ttft_s < 0:
            raise ValueError(f"a TTFT sample must be >= 0, got {ttft_s}")
        if concurrency < 1 or others < 0:
            raise ValueError(f"need concurrency >= 1 and others >= 0, got {concurrency}, {others}")
        if now < self._window_start:
            return  # observed under a previous limit
        bisect.insort(self._samples, (now, ttft_s, concurrency, others))

    # ---- control law ----------------------------------------------------------------------------

    def window(self, now: float) -> list[float]:
        """The samples currently in the window (drops the expired ones)."""
        self._prune(now)
        return [s for _, s, _, _ in self._samples]

    def headroom(self) -> tuple[float, int] | None:
        """(c, o_peak) over the window as pruned by the last window() call (None when empty): the
        `percentile` of TTFT per sharing request, and the most other ingresses' requests seen."""
        if not self._samples:
            return None
        costs = [s / n for _, s, n, _ in self._samples]
        return nearest_rank(costs, self.config.percentile), max(o for _, _, _, o in self._samples)

    def update(self, now: float, inflight: int, pool_queueing: bool = False) -> LimitDecision:
        """Run the law if a control period has elapsed since the last evaluation."""
        before, binding = self.limit, self._binding or now <= self._demand_until
        if now - self._period_start < self.config.control_period_s:
            return LimitDecision(now, "hold", "period_not_elapsed", before, before, None, len(self._samples), binding)
        values = self.window(now)
        q = nearest_rank(values, self.config.percentile) if values else None
        action, reason = self._decide(q, len(values), binding, inflight, pool_queueing)
        if action == "decrease":
            self.limit = max(self.config.min_limit, math.floor(self.limit * self.config.multiplicative_factor))
        elif action == "increase":
            self.limit = min(self.cap, self.limit + self.config.additive_step)
        if action != "hold" or reason in ("draining", "not_binding") or (reason == "too_few_samples" and not binding):
            self._window_start = now
            self._samples.clear()
        self._period_start = now
        self._binding = False
        return LimitDecision(now, action, reason, before, self.limit, q, len(values), binding)

    def _decide(self, q: float | None, samples: int, binding: bool, inflight: int, pool_queueing: bool) -> tuple[Action, Reason]:
        cfg = self.config
        if q is None or samples < cfg.min_samples:
            return "hold", "too_few_samples"
        if q > cfg.ttft_target_s:
            if inflight > self.limit:
                return "hold", "draining"
            if self.limit <= cfg.min_limit:
                return "hold", "at_limit"
            return "decrease", "overshoot"
        if not binding:
            return "hold", "not_binding"
        if pool_queueing:
            return "hold", "pool_queueing"
        if self.limit >= self.cap:
            return "hold", "at_limit"
        if cfg.growth_headroom:
            head = self.headroom()
            assert head is not None  # samples >= min_samples >= 1
            cost, others = head
            if cost * (self.limit + cfg.additive_step + others) > cfg.ttft_target_s:
                return "hold", "no_headroom"
        return "increase", "on_target"

    def _prune(self, now: float) -> None:
        cut = bisect.bisect_left(self._samples, (max(self._window_start, now - self.config.window_s), -math.inf, 0, 0))
        del self._samples[:cut]

    def check_integrity(self) -> None:
        if not self.config.min_limit <= self.limit <= self.cap:
            raise AssertionError(f"limit {self.limit} outside [{self.config.min_limit}, {self.cap}]")
        times = [t for t, _, _, _ in self._samples]
        if times != sorted(times):
            raise AssertionError("window samples not sorted by time")
        if times and times[0] < self._window_start:
            raise AssertionError(f"sample at {times[0]} predates the window start {self._window_start}")
        if any(s < 0 for _, s, _, _ in self._samples):
            raise AssertionError("negative TTFT in the window")
        if any(n < 1 or o < 0 for _, _, n, o in self._samples):
            raise AssertionError("a sample's concurrency below 1 or its others below 0")
