"""baton/engine/realtime/manager.py: RealtimeSessions over a fake engine runner (no vLLM, no Ray).

FakeRunner mirrors EngineRunner.generate + the segment connector around one request:
- injection: offered to process_segments() under the request id (as the runner does), and
  checked as the connector checks it (the segments must hold the prompt's first tokens);
- capture: one KVSegment per range (tiny real tensors, token ids = prompt[a:b]) returned as a
  CaptureResult on the finished delta (`delta.capture`), or a failed one when told to (the
  runner reports "no capture" as a failed CaptureResult too);
- the runner owns the key: it discards it on every exit (finished, error, cancelled), so the
  manager never touches the process table.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from baton.engine.realtime.manager import RealtimeSessions, UnknownSession
from baton.engine.realtime.messages import RealtimeOpen, RealtimeTick
from baton.engine.types import (
    EngineRequestError,
    EngineStats,
    EngineUnavailable,
    GenerationDelta,
    GenerationRequest,
)
from kv_transfer.segments import CaptureResult, KVSegment, process_segments


def seg(ids: tuple[int, ...]) -> KVSegment:
    k = torch.tensor(ids, dtype=torch.float32).view(1, len(ids), 1, 1).expand(1, len(ids), 1, 2).contiguous()
    return KVSegment(tuple(ids), k, k.clone())  # 2 layers' worth of floats per token: 16 bytes/token


BYTES_PER_TOKEN = 16


@dataclass
class Call:
    request: GenerationRequest
    injection: tuple[KVSegment, ...] | None
    capture: tuple[tuple[int, int], ...]


@dataclass
class FakeRunner:
    reply_len: int = 2
    capacity: int = 1000
    error: BaseException | None = None  # raised after offering the injection, before any delta
    capture_mode: str = "ok"  # ok | error | none (the connector saw no capture)
    delay_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    stats: EngineStats = field(default_factory=lambda: EngineStats(kv_usage=0.0, kv_capacity_tokens=1000))
    _ids: Any = field(default_factory=lambda: itertools.count(500))

    async def generate(self, req: GenerationRequest, injection: tuple[KVSegment, ...] | None = None,
                       capture: tuple[tuple[int, int], ...] = ()):
        self.calls.append(Call(req, injection, tuple(capture)))
        table = process_segments()
        prompt = req.prompt_token_ids
        try:
            if injection:
                inj = table.offer(req.request_id, injection)
                assert prompt[: inj.end] == inj.token_ids, "connector: injected KV does not match the prompt"
                assert inj.end < len(prompt)
            if self.error is not None:
                raise self.error
            for i in range(self.reply_len):
                await asyncio.sleep(self.delay_s)
                self.stats = EngineStats(kv_usage=(len(prompt) + i + 1) / self.capacity, kv_capacity_tokens=self.capacity)
                tid = next(self._ids)
                last = i == self.reply_len - 1
                result = None
                if last and capture:  # the connector saved the prompt's KV before the request ended
                    if self.capture_mode == "ok":
                        result = CaptureResult(segments=tuple(seg(prompt[a:b]) for a, b in capture))
                    elif self.capture_mode == "error":
                        result = CaptureResult(error="no free staging buffer")
                    else:
                        result = CaptureResult(error="the connector saw no capture")
                # like vLLM, the engine counts connector-loaded tokens as cached
                injected = sum(sg.num_tokens for sg in injection) if injection else 0
                yield GenerationDelta(text=f"w{tid} ", token_ids=(tid,), prompt_tokens=len(prompt), cached_tokens=injected,
                                      finished=last, finish_reason="length" if last else None, capture=result)
        finally:
            table.discard(req.request_id)


@pytest.fixture(autouse=True)
def empty_segment_table():
    assert len(process_segments()) == 0
    yield
    leftover = len(process_segments())
    for key in list(process_segments()._injections) + list(process_segments()._captures):  # keep other tests clean
        process_segments().discard(key)
    assert leftover == 0, "a tick left segments in the process table"


def opened(runner: FakeRunner, mode: str = "bounded", s: int = 2, w: int = 6, sid: str = "a",
           preamble: tuple[int, ...] = (1, 2, 3, 4), max_tokens: int = 2) -> RealtimeSessions:
    rs = RealtimeSessions(runner)
    rs.open(RealtimeOpen(session_id=sid, mode=mode, preamble_ids=preamble, sink_tokens=s, window_tokens=w, max_tokens=max_tokens))  # type: ignore[arg-type]
    return rs


def tick(rs: RealtimeSessions, seq: int, ids: tuple[int, ...], sid: str = "a"):
    return asyncio.run(rs.tick(RealtimeTick(sid, seq, ids)))


def state(rs: RealtimeSessions, sid: str = "a"):
    return rs._live[sid].state


# ---- ticks ----------------------------------------------------------------------------------------


def test_ticks_compose_prompts_inject_and_report_in_order() -> None:
    runner = FakeRunner(reply_len=2)
    rs = opened(runner)
    r0 = tick(rs, 0, (10, 11))
    r1 = tick(rs, 1, (12,))
    r2 = tick(rs, 2, (13,))
    assert [r.seq for r in (r0, r1, r2)] == [0, 1, 2]
    assert all(r.error is None for r in (r0, r1, r2))
    assert r0.token_ids == (500, 501) and r0.text == "w500 w501 "
    assert r1.token_ids == (502, 503)
    c0, c1, c2 = runner.calls
    assert c0.request.prompt_token_ids == (1, 2, 3, 4, 10, 11) and c0.injection is None
    assert c0.capture == ((0, 2), (2, 6))
    assert r0.prompt_tokens == 6 and r0.computed_tokens == 6
    # tick 1: sink (1,2) and window (3,4,10,11) injected; the last reply and the input computed
    assert c1.request.prompt_token_ids == (1, 2, 3, 4, 10, 11, 500, 501, 12)
    assert [s.token_ids for s in c1.injection] == [(1, 2), (3, 4, 10, 11)]
    assert c1.capture == ((2, 9),)
    assert r1.computed_tokens == 3 and r1.prompt_tokens == 9
    # tick 2: window = last 6 of (3,4,10,11,500,501,12)
    assert [s.token_ids for s in c2.injection] == [(1, 2), (4, 10, 11, 500, 501, 12)]
    assert c2.request.prompt_token_ids == (1, 2, 4, 10, 11, 500, 501, 12, 502, 503, 13)
    req = c2.request
    assert req.sampling.max_tokens == 2 and req.sampling.temperature == 0.0
    assert len({c.request.request_id for c in runner.calls}) == 3
    assert len({c.request.cache_salt for c in runner.calls}) == 3  # a salt per bounded tick
    st = state(rs)
    st.check_integrity()
    assert st.pending == (504, 505) and st.ticks == 3


def test_kv_peak_comes_from_the_engine_stats() -> None:
    runner = FakeRunner(reply_len=3, capacity=1000)
    rs = opened(runner)
    r = tick(rs, 0, (10, 11))
    assert r.kv_peak_tokens == 6 + 3  # prompt + 3 generated, read from kv_usage * capacity
    assert r.server_s >= 0


def test_concurrent_ticks_of_one_session_run_one_at_a_time_in_order() -> None:
    runner = FakeRunner(reply_len=2, delay_s=0.001)
    rs = opened(runner)

    async def both():
        return await asyncio.gather(rs.tick(RealtimeTick("a", 0, (10,))), rs.tick(RealtimeTick("a", 1, (11,))))

    r0, r1 = asyncio.run(both())
    assert (r0.seq, r1.seq) == (0, 1)
    second = runner.calls[1].request.prompt_token_ids
    assert second[-3:] == r0.token_ids + (11,)  # the second tick saw the first one's reply


def test_unbounded_sends_history_with_one_salt_and_no_segments() -> None:
    runner = FakeRunner(reply_len=1)
    rs = opened(runner, mode="unbounded")
    lengths = []
    for i in range(4):
        r = tick(rs, i, (10 + i,))
        assert r.error is None
        lengths.append(r.prompt_tokens)
    assert all(c.injection is None and c.capture == () for c in runner.calls)
    assert len({c.request.cache_salt for c in runner.calls}) == 1
    assert lengths == [5, 7, 9, 11]
    assert runner.calls[-1].request.prompt_token_ids == (1, 2, 3, 4, 10, 500, 11, 501, 12, 502, 13)
    assert rs.held_kv_bytes() == 0


# ---- sessions -------------------------------------------------------------------------------------


def test_unknown_session_and_duplicate_open() -> None:
    runner = FakeRunner()
    rs = opened(runner)
    with pytest.raises(UnknownSession):
        tick(rs, 0, (1,), sid="nope")
    with pytest.raises(EngineRequestError, match="already open"):
        rs.open(RealtimeOpen(session_id="a", mode="bounded", preamble_ids=(9,), sink_tokens=1, window_tokens=2, max_tokens=1))
    assert len(rs) == 1 and runner.calls == []


def test_close_frees_the_session_and_its_kv() -> None:
    runner = FakeRunner()
    rs = opened(runner)
    tick(rs, 0, (10, 11))
    assert rs.held_kv_bytes() > 0
    assert rs.close("a") is True
    assert rs.close("a") is False
    assert len(rs) == 0 and rs.held_kv_bytes() == 0
    with pytest.raises(UnknownSession):
        tick(rs, 1, (12,))


def test_held_kv_bytes_counts_sink_and_window_of_every_session() -> None:
    runner = FakeRunner(reply_len=2)
    rs = opened(runner, s=2, w=6)
    rs.open(RealtimeOpen(session_id="b", mode="bounded", preamble_ids=(7, 8, 9), sink_tokens=1, window_tokens=3, max_tokens=2))
    assert rs.held_kv_bytes() == 0
    tick(rs, 0, (10, 11))
    tick(rs, 0, (20,), sid="b")
    a, b = state(rs, "a"), state(rs, "b")
    assert len(a.sink) + len(a.window) == 2 + 4 and len(b.sink) + len(b.window) == 1 + 3
    assert rs.held_kv_bytes() == (6 + 4) * BYTES_PER_TOKEN
    for i in range(1, 6):
        tick(rs, i, (30 + i,))
    assert rs.held_kv_bytes() == (2 + 6 + 4) * BYTES_PER_TOKEN  # constant once the window is full


def test_idle_sessions_expire_when_another_opens() -> None:
    rs = RealtimeSessions(FakeRunner(), idle_timeout_s=0.001)
    rs.open(RealtimeOpen(session_id="old", mode="bounded", preamble_ids=(1,), sink_tokens=1, window_tokens=2, max_tokens=1))
    import time

    time.sleep(0.01)
    rs.open(RealtimeOpen(session_id="new", mode="bounded", preamble_ids=(1,), sink_tokens=1, window_tokens=2, max_tokens=1))
    assert set(rs._live) == {"new"}


# ---- failures -------------------------------------------------------------------------------------


@pytest.mark.parametrize("capture_mode", ["error", "none"])
def test_failed_capture_keeps_serving_and_the_next_tick_recomputes(capture_mode: str) -> None:
    runner = FakeRunner(reply_len=2)
    rs = opened(runner)
    tick(rs, 0, (10, 11))
    runner.capture_mode = capture_mode
    r1 = tick(rs, 1, (12,))
    assert r1.error is None and r1.token_ids == (502, 503)  # the client still gets its reply
    st = state(rs)
    assert st.sink_kv is None and st.window_kv is None and rs.held_kv_bytes() == 0
    runner.capture_mode = "ok"
    r2 = tick(rs, 2, (13,))
    c2 = runner.calls[2]
    assert c2.injection is None
    assert c2.request.prompt_token_ids == (1, 2, 4, 10, 11, 500, 501, 12, 502, 503, 13)
    assert r2.computed_tokens == r2.prompt_tokens == 11
    assert c2.capture == ((0, 2), (2, 11))
    assert c2.request.cache_salt not in {c.request.cache_salt for c in runner.calls[:2]}
    tick(rs, 3, (14,))
    assert runner.calls[3].injection is not None  # recovered: injecting again
    state(rs).check_integrity()


@pytest.mark.parametrize("error", [EngineRequestError("prompt too long"), EngineUnavailable("engine died")])
def test_engine_error_sets_the_result_error_and_leaves_the_state(error: Exception) -> None:
    runner = FakeRunner(reply_len=2)
    rs = opened(runner)
    tick(rs, 0, (10, 11))
    before = state(rs)
    runner.error = error
    r = tick(rs, 1, (12,))
    assert r.error == str(error) and r.seq == 1
    assert runner.calls[1].injection is not None and len(process_segments()) == 0  # the offer was dropped
    assert r.token_ids == () and r.text == ""
    assert state(rs) == before
    runner.error = None
    tick(rs, 2, (13,))
    failed, retried = runner.calls[1], runner.calls[2]
    # the failed tick's input was not consumed: the next one continues from the same state
    assert retried.request.prompt_token_ids == failed.request.prompt_token_ids[:-1] + (13,)


def test_an_unexpected_runner_error_propagates_and_leaves_nothing_behind() -> None:
    runner = FakeRunner(reply_len=2)
    rs = opened(runner)
    tick(rs, 0, (10, 11))
    before = state(rs)
    runner.error = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        tick(rs, 1, (12,))
    assert state(rs) == before
    assert not rs._live["a"].lock.locked()
    assert len(process_segments()) == 0


def test_a_cancelled_tick_leaves_nothing_in_the_segment_table() -> None:
    runner = FakeRunner(reply_len=5)
    rs = opened(runner)
    tick(rs, 0, (10, 11))
    runner.delay_s = 0.05

    async def cancel_mid_tick():
        t = asyncio.ensure_future(rs.tick(RealtimeTick("a", 1, (12,))))
        await asyncio.sleep(0.02)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(cancel_mid_tick())
    assert runner.calls[1].injection is not None  # it had offered sink + window
    assert len(process_segments()) == 0
    assert len(runner.calls) == 2 and state(rs).ticks == 1  # the cancelled tick changed nothing


def test_nothing_is_left_in_the_segment_table_after_many_ticks() -> None:
    runner = FakeRunner(reply_len=3)
    rs = opened(runner, s=2, w=5)
    for i in range(30):
        if i == 10:
            runner.capture_mode = "error"
        if i == 11:
            runner.capture_mode = "ok"
        r = tick(rs, i, (100 + i,))
        assert r.error is None
        assert len(process_segments()) == 0
        st = state(rs)
        st.check_integrity()
        assert len(st.window) <= 5
