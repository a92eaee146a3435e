"""deployments/inflight.py: the one owner of the ingress's in-flight count. A ticket gives its
slot back exactly once, whichever path (or how many paths) release it."""
from __future__ import annotations

import asyncio
import math

import pytest

from deployments.errors import APIError
from deployments.inflight import InflightLimit, status_of
from deployments.metrics import RecordingMetrics
from router.chat_admission import ChatAdmissionConfig
from router.policy import TurnPlan


def test_acquire_up_to_the_limit_then_429_with_retry_after() -> None:
    limit = InflightLimit(2)
    tickets = [limit.acquire(), limit.acquire()]
    assert limit.inflight == 2 and not any(t.released for t in tickets)
    with pytest.raises(APIError) as e:
        limit.acquire()
    assert e.value.status == 429 and e.value.code == "overloaded" and e.value.headers == {"Retry-After": "1"}
    assert "limit 2" in e.value.message
    assert limit.inflight == 2  # a refusal takes no slot
    tickets[0].release()
    assert limit.inflight == 1
    limit.acquire()
    assert limit.inflight == 2


def test_a_double_release_gives_back_one_slot() -> None:
    limit = InflightLimit(2)
    first, second = limit.acquire(), limit.acquire()
    first.release()
    first.release()
    assert first.released and limit.inflight == 1  # not 0: the second request is still running
    second.release()
    assert limit.inflight == 0


def test_a_ticket_as_context_manager_releases_on_success_and_on_error() -> None:
    limit = InflightLimit(1)
    with limit.acquire() as ticket:
        assert limit.inflight == 1
    assert ticket.released and limit.inflight == 0
    with pytest.raises(RuntimeError), limit.acquire():
        raise RuntimeError("engine bug")
    assert limit.inflight == 0
    with limit.acquire() as ticket:
        ticket.release()  # released early by another path: leaving the block is a no-op
    assert limit.inflight == 0


def test_default_is_unbounded_and_a_limit_below_one_is_refused() -> None:
    limit = InflightLimit()
    for _ in range(1000):
        limit.acquire()
    assert limit.inflight == 1000
    with pytest.raises(ValueError):
        InflightLimit(0)


# ---- adaptive mode: the limit follows a TTFT target (router/chat_admission.py) --------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


ADAPTIVE = ChatAdmissionConfig(mode="adaptive", ttft_target_s=1.0, initial_limit=2, min_limit=1, multiplicative_factor=0.5,
                               control_period_s=1.0, window_s=10.0, min_samples=2)


def adaptive(cap: int = 8, **changes: object) -> tuple[InflightLimit, Clock, RecordingMetrics]:
    clock, metrics = Clock(), RecordingMetrics()
    return InflightLimit(cap, ADAPTIVE.model_copy(update=changes), clock=clock, metrics=metrics), clock, metrics


def test_an_adaptive_limit_refuses_beyond_its_current_limit_under_a_higher_cap() -> None:
    limit, _, metrics = adaptive(cap=8)
    assert limit.mode == "adaptive" and limit.limit == 2 and limit.cap == 8
    limit.acquire(), limit.acquire()
    with pytest.raises(APIError) as e:
        limit.acquire()
    assert e.value.status == 429 and e.value.code == "overloaded" and e.value.headers == {"Retry-After": "1"} and "limit 2" in e.value.message
    assert limit.inflight == 2 and metrics.admissions == {"admitted": 2, "refused": 1} and metrics.admission_limits == [2]
    fixed = InflightLimit(8, ChatAdmissionConfig(mode="fixed"))
    assert fixed.mode == "fixed" and [fixed.acquire() for _ in range(8)] and fixed.limit == 8


def test_tickets_report_their_ttft_once_at_the_first_token() -> None:
    limit, clock, _ = adaptive()
    ticket = limit.acquire()
    clock.t = 0.3
    ticket.first_token()
    ticket.first_token()  # a second first token is not a second sample
    clock.t = 5.0  # a long generation after a quick first token: still a 0.3 s sample
    ticket.release(200)
    assert limit.totals["samples"] == 1 and limit._ctl is not None and limit._ctl.window(5.0) == [0.3]


@pytest.mark.parametrize("status,sample", [(503, math.inf), (500, math.inf), (200, 0.4), (400, None), (499, None), (None, None)])
def test_a_ticket_released_without_a_first_token_reports_by_its_status(status: int | None, sample: float | None) -> None:
    limit, clock, _ = adaptive()
    ticket = limit.acquire()
    clock.t = 0.4
    ticket.release(status)
    assert limit._ctl is not None and limit._ctl.window(0.4) == ([] if sample is None else [sample])
    assert ticket.reported and limit.inflight == 0


def test_the_context_manager_releases_with_the_status_of_the_exception() -> None:
    assert (status_of(None), status_of(APIError(503, "x")), status_of(asyncio.CancelledError()), status_of(KeyError())) == (200, 503, 499, 500)
    limit, clock, _ = adaptive()
    with pytest.raises(APIError), limit.acquire():
        clock.t = 0.2
        raise APIError(503, "pool queue full")
    assert limit._ctl is not None and limit._ctl.window(0.2) == [math.inf]


def test_a_request_without_a_first_token_past_the_target_is_a_miss_at_once() -> None:
    limit, clock, _ = adaptive(cap=8, initial_limit=4)
    slow = [limit.acquire(), limit.acquire()]
    clock.t = 1.5  # both admitted 1.5 s ago, no first token: overdue
    with pytest.raises(APIError):  # two misses (min_samples 2), a period elapsed: 4 -> 2 before either finished
        limit.acquire()
    assert limit.totals["overdue"] == 2 and all(t.reported for t in slow) and limit.limit == 2
    clock.t = 3.0
    slow[0].first_token()  # already counted: no second sample
    slow[0].release(200), slow[1].release(200)
    assert limit.totals["samples"] == 2


def test_refused_requests_report_nothing_and_the_limit_grows_back_under_target() -> None:
    limit, clock, metrics = adaptive(cap=4)
    admitted = []
    for step in range(1, 4):  # each period: requests arrive until one is refused; the admitted answer in 0.2 s
        tickets = []
        while len(tickets) < 10:
            try:
                tickets.append(limit.acquire())
            except APIError:
                break
        admitted.append(len(tickets))
        clock.t += 0.2
        for t in tickets:
            t.first_token()
            t.release(200)
        clock.t = float(step)
        assert limit.totals["refused"] == step
    assert admitted == [2, 3, 4] and limit.totals["samples"] == 2 + 3 + 4
    assert metrics.admission_limits == [2, 3, 4] and metrics.admissions == {"admitted": 9, "refused": 3}
    clock.t = 4.0
    assert len([limit.acquire() for _ in range(4)]) == 4 and limit.limit == 4  # the cap holds


@pytest.mark.parametrize("queueing", [True, False])
def test_the_pool_queueing_hint_holds_growth(queueing: bool) -> None:
    limit, clock, _ = adaptive(cap=8)
    limit.note_pool(TurnPlan("d0", remote_prefill=False, reason="new", pool_queueing=queueing))
    tickets = [limit.acquire(), limit.acquire()]
    clock.t = 0.2
    for t in tickets:
        t.first_token()
    with pytest.raises(APIError):
        limit.acquire()  # a third client: refused, so the limit binds
    clock.t = 1.0
    assert limit.snapshot()["pool_queueing"] is queueing
    if queueing:  # the law runs: on target and binding, but every decoder is queueing
        with pytest.raises(APIError):
            limit.acquire()
        assert limit.limit == 2
    else:
        limit.acquire()
        assert limit.limit == 3


def test_retry_after_is_the_median_completed_duration_per_slot() -> None:
    now = [0.0]
    limit = InflightLimit(2, clock=lambda: now[0])
    assert limit.retry_after_s() == 1  # nothing completed yet
    for duration in (4.0, 9.0, 5.0):  # median 5 s over 2 slots: a slot frees every 2.5 s
        t = limit.acquire()
        now[0] += duration
        t.release(200)
    assert limit.retry_after_s() == 3
    failed = limit.acquire()
    now[0] += 1000.0
    failed.release(503)  # only completed (2xx) requests time the service
    assert limit.retry_after_s() == 3
    busy = [limit.acquire(), limit.acquire()]
    with pytest.raises(APIError) as e:
        limit.acquire()
    assert e.value.headers == {"Retry-After": "3"}
    for t in busy:
        t.release(200)


def test_retry_after_stays_within_its_bounds() -> None:
    now = [0.0]
    limit = InflightLimit(1, clock=lambda: now[0])
    t = limit.acquire()
    now[0] += 3600.0
    t.release(200)
    assert limit.retry_after_s() == 30
    quick = InflightLimit(4, clock=lambda: now[0])
    t = quick.acquire()
    t.release(200)  # 0 s
    assert quick.retry_after_s() == 1


def test_precheck_refuses_exactly_when_acquire_would_and_admits_nothing() -> None:
    limit = InflightLimit(1)
    limit.precheck()
    assert limit.inflight == 0 and limit.totals["admitted"] == 0
    held = limit.acquire()
    with pytest.raises(APIError) as e:
        limit.precheck()
    assert e.value.status == 429 and "Retry-After" in e.value.headers
    assert limit.totals == {"admitted": 1, "refused": 1, "samples": 0, "overdue": 0}  # a refusal is counted once
    held.release(200)
    limit.precheck()
    assert limit.inflight == 0


def test_before_anything_completed_retry_after_is_the_oldest_running_age_per_slot() -> None:
    now = [0.0]
    limit = InflightLimit(2, clock=lambda: now[0])
    first = limit.acquire()
    now[0] = 3.0
    limit.acquire()
    now[0] = 8.5  # the oldest has run 8.5 s, and still runs: a slot frees in >= 8.5 / 2 s
    assert limit.retry_after_s() == 5
    first.release(200)
    assert limit.retry_after_s() == 5  # now the one completed duration (8.5 s) over 2 slots


def test_samples_carry_the_pools_concurrency_and_the_other_ingresses_share() -> None:
    """Two requests here; the directory's plans say the pools serve 5 (3 from other ingresses):
    the TTFT samples tell the limiter so (router/chat_admission.py: headroom)."""
    limit, clock, _ = adaptive(cap=8)
    a, b = limit.acquire(), limit.acquire()
    limit.note_pool(TurnPlan("d0", remote_prefill=False, reason="new", pool_in_flight=5))
    assert (a.concurrency, a.others) == (5, 3) and (b.concurrency, b.others) == (5, 3)
    limit.note_pool(TurnPlan("d0", remote_prefill=False, reason="new", pool_in_flight=2))  # quieter later: the peak stays
    clock.t = 0.3
    a.first_token()
    b.first_token()
    assert limit._ctl is not None and limit._ctl.headroom() == (0.3 / 5, 3)
    assert limit.snapshot()["pool_in_flight"] == 2
