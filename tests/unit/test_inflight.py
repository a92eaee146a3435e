"""deployments/inflight.py: the one owner of the ingress's in-flight count. A ticket gives its
slot back exactly once, whichever path (or how many paths) release it."""
from __future__ import annotations

import pytest

from deployments.errors import APIError
from deployments.inflight import InflightLimit


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
