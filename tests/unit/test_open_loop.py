"""bench overhead's open loop: seeded arrivals, the offered rate, the bare engine as a zero-cost
server (fake engine), and the HTTP client's timing from the scheduled arrival."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import pytest

from baton.bench import open_loop
from baton.bench.open_loop import bare_open_loop, offered_rate, poisson_arrivals


def test_arrivals_are_seeded_sorted_and_start_at_zero():
    a = poisson_arrivals(200, 4.0)
    assert a == poisson_arrivals(200, 4.0)
    assert a != poisson_arrivals(200, 4.0, seed=1)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.2)  # mean gap 1/rate


@pytest.mark.parametrize("n, rate", [(0, 1.0), (5, 0.0), (5, -1.0)])
def test_arrivals_reject_bad_arguments(n, rate):
    with pytest.raises(ValueError):
        poisson_arrivals(n, rate)


def test_offered_rate():
    assert offered_rate(0.5, 0.6) == pytest.approx(1.2)
    for bad in ((0.0, 0.5), (1.0, 0.0), (1.0, 1.0)):
        with pytest.raises(ValueError):
            offered_rate(*bad)


@dataclass
class _Out:
    request_id: str
    finished: bool
    outputs: list = field(default_factory=list)


@dataclass
class _Tokens:
    token_ids: list


class _FakeEngine:
    """Each step takes STEP_S; a request gets its first token in the first step after it was added
    and finishes in the next."""

    STEP_S = 0.03

    def __init__(self):
        self.added: dict[str, float] = {}
        self.steps_seen: dict[str, int] = {}

    def add_request(self, rid, prompt, params):
        self.added[rid] = time.monotonic()
        self.steps_seen[rid] = 0

    def has_unfinished_requests(self):
        return bool(self.steps_seen)

    def step(self):
        time.sleep(self.STEP_S)
        outs = []
        for rid in list(self.steps_seen):
            self.steps_seen[rid] += 1
            done = self.steps_seen[rid] == 2
            outs.append(_Out(rid, done, [_Tokens([1])]))
            if done:
                del self.steps_seen[rid]
        return outs


def test_bare_open_loop_adds_on_arrival_and_times_from_it():
    engine = _FakeEngine()
    arrivals = [0.0, 0.01, 0.2, 0.21, 0.5]
    t0 = time.monotonic()
    timings, wall = bare_open_loop(engine, None, [[1]] * 5, arrivals, max_tokens=2, tag="x")
    assert len(timings) == 5
    for i, at in enumerate(arrivals):
        assert engine.added[f"x{i}"] >= t0 + at - 1e-3  # never before its arrival
    # the request arriving 10 ms into the first step waits for it: TTFT > one step, timed from its arrival
    ttfts = sorted(t.ttft_s for t in timings)
    assert ttfts[0] >= _FakeEngine.STEP_S - 1e-3
    assert max(ttfts) >= 1.5 * _FakeEngine.STEP_S
    assert wall >= arrivals[-1]


def test_bare_open_loop_needs_one_arrival_per_prompt():
    with pytest.raises(ValueError):
        bare_open_loop(_FakeEngine(), None, [[1], [2]], [0.0], max_tokens=1)


def _sse_app(delay_s: float, fail: bool = False):
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(delay_s)
        if fail:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        body = 'data: {"choices":[{"text":"hi"}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, headers={"server-timing": "total;dur=5.00"}, content=body.encode())
    return handler


def test_http_open_loop_times_from_the_scheduled_arrival(monkeypatch):
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(_sse_app(0.02)), timeout=kw.get("timeout")))
    arrivals = [0.0, 0.05, 0.1]
    timings, wall, hops = asyncio.run(open_loop.http_open_loop("http://x/v1/completions", [[1], [2], [3]], arrivals, max_tokens=1))
    assert len(timings) == 3 and wall >= 0.1
    assert all(0.02 <= t.ttft_s < 0.5 for t in timings)
    assert all(h["total"] == pytest.approx(0.005) and h["outside"] == pytest.approx(t.ttft_s - 0.005) for t, h in zip(timings, hops, strict=True))


def test_http_open_loop_raises_on_a_failed_request(monkeypatch):
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(_sse_app(0.0, fail=True))))
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(open_loop.http_open_loop("http://x/v1/completions", [[1]], [0.0], max_tokens=1))


def test_closed_loop_keeps_concurrency_and_times_from_each_add():
    from baton.bench.overhead import _bare_loop

    engine = _FakeEngine()
    timings, wall = _bare_loop(engine, None, [[1]] * 5, max_tokens=2, concurrency=2, tag="c")
    assert len(timings) == 5 and set(engine.added) == {f"c{i}" for i in range(5)}
    # two at a time: each request's first token one step after it was added, done the next
    assert all(_FakeEngine.STEP_S - 1e-3 <= t.ttft_s < t.e2e_s for t in timings)
    assert all(t.e2e_s >= 2 * _FakeEngine.STEP_S - 1e-3 for t in timings)
    assert wall >= 6 * _FakeEngine.STEP_S - 1e-3  # 5 requests, 2 at a time, 2 steps each: 3 rounds
    # timed from each add, not from the loop's start (the last one was added 4 steps in)
    assert max(t.ttft_s for t in timings) < 0.5 * wall
