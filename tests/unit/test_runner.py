"""baton/engine/runner.py: EngineRunner's concurrency over a fake engine (no model, no vLLM engine).

The engine is tests/unit/fake_engine.py's FakeEngine (the slice of vLLM's LLMEngine the runner
drives), the segment table a RecordingTable that logs offer / take_capture / discard in one log
with the engine's calls. Every await that could hang is bounded by asyncio.wait_for.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from baton.engine.args import EngineSpec
from baton.engine.runner import EngineRunner
from baton.engine.types import EngineRequestError, EngineUnavailable, GenerationDelta, GenerationRequest, SamplingSpec
from kv_transfer.segment_connector import PARAMS_KEY
from kv_transfer.segments import CaptureResult
from tests.unit.fake_engine import FakeEngine, RecordingTable, seg

SPEC = EngineSpec(engine_kwargs={}, env={}, model_path="fake")
WAIT_S = 5.0  # a bound for things that take milliseconds; reaching it means a hang


def make(tokens: int = 3) -> tuple[EngineRunner, FakeEngine, RecordingTable]:
    log: list[tuple[str, str]] = []
    engine = FakeEngine(tokens, log)
    table = RecordingTable(log)
    engine.table = table
    return EngineRunner(SPEC, engine_factory=lambda spec: engine, segment_table=table), engine, table


def request(rid: str = "r1", prompt: tuple[int, ...] = (5, 6, 7, 8), max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingSpec(max_tokens=max_tokens))


async def collect(runner: EngineRunner, req: GenerationRequest, **kw: Any) -> list[GenerationDelta]:
    async def run() -> list[GenerationDelta]:
        return [d async for d in runner.generate(req, **kw)]

    return await asyncio.wait_for(run(), WAIT_S)


async def until(pred: Callable[[], bool]) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < WAIT_S, "condition not reached"
        await asyncio.sleep(0.002)


def wait_until(pred: Callable[[], bool]) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < WAIT_S, "condition not reached"
        time.sleep(0.002)


# ---- serving --------------------------------------------------------------------------------------


def test_a_request_streams_its_tokens_and_finishes() -> None:
    runner, engine, table = make(tokens=3)
    try:
        deltas = asyncio.run(collect(runner, request(max_tokens=3)))
        assert "".join(d.text for d in deltas) == " t1 t2 t3"
        assert [t for d in deltas for t in d.token_ids] == [101, 102, 103]
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert all(d.capture is None for d in deltas)  # nothing beyond tokens travels to the ingress
        prompt, params = engine.added["r1"]
        assert prompt == {"prompt_token_ids": [5, 6, 7, 8]} and params.max_tokens == 3
        assert table.log == [("add", "r1")]  # no injection, no capture: the table is not touched
        # stats are the engine thread's periodic snapshot: it catches up within one idle wait
        wait_until(lambda: runner.stats.in_flight == 0)
        assert runner.stats.healthy
    finally:
        runner.shutdown()
    assert engine.shut_down.is_set()


def test_the_first_delta_says_when_the_engine_added_the_request_and_stepped_its_first_token() -> None:
    runner, _, _ = make(tokens=3)
    try:
        before = time.time()
        deltas = asyncio.run(collect(runner, request(max_tokens=3)))
        after = time.time()
    finally:
        runner.shutdown()
    t = deltas[0].timing
    assert t is not None and t.engine_added is not None and t.engine_first is not None
    assert before <= t.engine_added <= t.engine_first <= after
    assert all(d.timing is None for d in deltas[1:])  # the first delta only


def test_cancelling_the_consumer_aborts_the_request() -> None:
    runner, engine, _ = make(tokens=10_000)

    async def go() -> None:
        gen = runner.generate(request())
        first = await asyncio.wait_for(gen.__anext__(), WAIT_S)
        assert not first.finished
        await gen.aclose()
        await until(lambda: ("abort", "r1") in engine.log)
        await until(lambda: runner.stats.in_flight == 0)
        assert not engine.has_unfinished_requests()

    try:
        asyncio.run(go())
        assert runner.stats.healthy
    finally:
        runner.shutdown()


def test_a_duplicate_request_id_is_refused_and_the_first_request_is_unharmed() -> None:
    runner, engine, _ = make(tokens=2)
    engine.paused.set()

    async def go() -> list[GenerationDelta]:
        first = asyncio.ensure_future(collect(runner, request("same")))
        await until(lambda: "same" in engine.added)
        with pytest.raises(EngineRequestError, match="duplicate request id"):
            await collect(runner, request("same"))
        engine.paused.clear()
        return await first

    try:
        assert asyncio.run(go())[-1].finished
    finally:
        runner.shutdown()


def test_a_request_the_engine_rejects_fails_alone() -> None:
    runner, engine, _ = make()
    engine.reject = ValueError("max_tokens must be at least 1")
    try:
        with pytest.raises(EngineRequestError, match="max_tokens must be at least 1"):
            asyncio.run(collect(runner, request()))
        engine.reject = None
        assert asyncio.run(collect(runner, request("r2")))[-1].finished
        assert runner.stats.healthy
    finally:
        runner.shutdown()


# ---- shutdown, crash, races ---------------------------------------------------------------------


def test_shutdown_fails_every_waiting_stream_and_refuses_later_requests() -> None:
    runner, engine, _ = make()
    engine.paused.set()

    async def go() -> None:
        tasks = [asyncio.ensure_future(collect(runner, request(f"r{i}"))) for i in range(3)]
        await until(lambda: len(engine.added) == 3)
        runner.shutdown()
        for t in tasks:
            with pytest.raises(EngineUnavailable, match="engine shut down"):
                await t
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="engine shut down"):
            await collect(runner, request("late"))
        assert time.monotonic() - t0 < WAIT_S / 2  # at once, not after a wait (generous for a loaded machine)

    asyncio.run(go())
    assert not runner.stats.healthy and runner.stats.reason == "engine shut down"
    assert engine.shut_down.is_set() and "late" not in engine.added
    runner.shutdown()  # twice is harmless


def test_a_shutdown_behind_a_stuck_step_still_frees_callers_and_refuses_new_requests() -> None:
    runner, engine, _ = make()
    engine.paused.set()

    async def go() -> None:
        waiting = asyncio.ensure_future(collect(runner, request("r0")))
        await until(lambda: "r0" in engine.added)
        engine.stepping.clear()
        engine.unstuck.clear()
        await until(engine.stepping.is_set)  # the engine thread is inside a step that does not return
        runner.shutdown(timeout_s=0.05)
        assert not runner.stats.healthy and runner.stats.reason == "engine shut down"
        with pytest.raises(EngineUnavailable, match="engine shut down"):
            await waiting
        with pytest.raises(EngineUnavailable, match="engine shut down"):  # refused at once, while the thread still runs
            await asyncio.wait_for(collect(runner, request("late")), 0.5)
        engine.unstuck.set()
        await until(engine.shut_down.is_set)  # the step returned: the thread stops and shuts the engine down

    try:
        asyncio.run(go())
    finally:
        engine.unstuck.set()
    assert "late" not in engine.added


def test_an_engine_crash_fails_every_stream_and_marks_the_runner_unhealthy() -> None:
    runner, engine, _ = make()
    engine.paused.set()

    async def go() -> None:
        tasks = [asyncio.ensure_future(collect(runner, request(f"r{i}"))) for i in range(3)]
        await until(lambda: len(engine.added) == 3)
        engine.crash = RuntimeError("device lost")
        for t in tasks:
            with pytest.raises(EngineUnavailable, match="engine failed: RuntimeError: device lost"):
                await t
        with pytest.raises(EngineUnavailable, match="device lost"):
            await collect(runner, request("late"))

    asyncio.run(go())
    assert not runner.stats.healthy and "device lost" in runner.stats.reason
    assert engine.shut_down.wait(WAIT_S)  # the engine thread shuts it down right after failing the streams
    runner.shutdown()
    assert "device lost" in runner.stats.reason  # the first reason stays


async def _race_shutdown(runner: EngineRunner, n: int) -> list[Any]:
    loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(collect(runner, request(f"r{i}"))) for i in range(n)]
    stopper = loop.run_in_executor(None, runner.shutdown)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
    await stopper
    return results


def test_requests_racing_a_shutdown_never_hang() -> None:
    for _ in range(10):
        runner, _, _ = make(tokens=2)
        results = asyncio.run(_race_shutdown(runner, 20))
        for r in results:  # each one either finished or was refused/failed: none left waiting
            assert isinstance(r, EngineUnavailable) or (isinstance(r, list) and r[-1].finished), r
        assert not runner.stats.healthy


# ---- the start watchdog -------------------------------------------------------------------------


def test_a_stuck_build_fails_the_start_and_the_late_engine_is_shut_down() -> None:
    release = threading.Event()
    late = FakeEngine()

    def stuck_factory(spec: EngineSpec) -> FakeEngine:
        release.wait(WAIT_S)
        return late

    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable, match=r"engine build did not finish within 0.05s"):
        EngineRunner(SPEC, engine_factory=stuck_factory, start_timeout_s=0.05)
    assert time.monotonic() - t0 < WAIT_S / 2  # the watchdog, not the build (WAIT_S), ended the wait
    release.set()
    wait_until(late.shut_down.is_set)
    assert late.added == {} and late.log == [("shutdown", "")]  # never served


def test_a_failed_build_fails_the_start_with_its_reason() -> None:
    def failing(spec: EngineSpec) -> Any:
        raise OSError("no model at /models/x")

    with pytest.raises(EngineUnavailable, match="engine failed to start: OSError: no model at /models/x"):
        EngineRunner(SPEC, engine_factory=failing, start_timeout_s=WAIT_S)


# ---- segment keys: offered, taken and discarded by the runner, each exactly once -----------------


def test_an_injection_is_offered_then_discarded_once() -> None:
    runner, engine, table = make()
    inj = (seg((5, 6)),)
    try:
        assert asyncio.run(collect(runner, request("inj"), injection=inj))[-1].finished
        params = engine.added["inj"][1].extra_args["kv_transfer_params"]
        assert params[PARAMS_KEY] == {"key": "inj", "inject_end": 2}
        assert [op for op, key in table.log if key == "inj"] == ["offer", "add", "discard"]
        assert len(table) == 0
    finally:
        runner.shutdown()


def test_a_capture_comes_back_on_the_finished_delta_and_its_key_is_discarded_once() -> None:
    runner, engine, table = make(tokens=1)
    try:
        deltas = asyncio.run(collect(runner, request("cap", prompt=(5, 6, 7, 8)), injection=(seg((5,)),), capture=((1, 3),)))
        assert all(d.capture is None for d in deltas[:-1])
        result = deltas[-1].capture
        assert result is not None and result.error is None and [s.token_ids for s in result.segments] == [(6, 7)]
        assert engine.added["cap"][1].extra_args["kv_transfer_params"][PARAMS_KEY] == {"key": "cap", "inject_end": 1, "capture": [[1, 3]]}
        assert [op for op, key in table.log if key == "cap"] == ["offer", "add", "take_capture", "discard"]
        assert len(table) == 0
        segs = asyncio.run(asyncio.wait_for(runner.capture("helper", (5, 6, 7), ((0, 2),)), WAIT_S))
        assert [s.token_ids for s in segs] == [(5, 6)]
        assert engine.added["helper"][1].max_tokens == 1 and table.count("discard", "helper") == 1
    finally:
        runner.shutdown()


@pytest.mark.parametrize("mode,reason", [("error", "no free staging buffer"), ("none", "the connector saw no capture")])
def test_a_failed_capture_is_reported_and_its_key_discarded_once(mode: str, reason: str) -> None:
    runner, engine, table = make(tokens=1)
    engine.capture_mode = mode
    try:
        deltas = asyncio.run(collect(runner, request("cap"), capture=((0, 2),)))
        assert deltas[-1].capture == CaptureResult(error=reason)
        with pytest.raises(EngineRequestError, match=reason):
            asyncio.run(asyncio.wait_for(runner.capture("helper", (5, 6, 7), ((0, 2),)), WAIT_S))
        assert table.count("discard", "cap") == 1 and table.count("discard", "helper") == 1 and len(table) == 0
    finally:
        runner.shutdown()


def test_a_capture_the_engine_rejects_discards_its_key_once() -> None:
    runner, engine, table = make()
    engine.reject = ValueError("prompt too long")
    try:
        with pytest.raises(EngineRequestError, match="prompt too long"):
            asyncio.run(collect(runner, request("cap"), injection=(seg((5,)),), capture=((0, 2),)))
        assert [op for op, key in table.log if key == "cap"] == ["offer", "discard"]
        assert len(table) == 0
    finally:
        runner.shutdown()


def test_a_cancelled_injection_is_discarded_once_after_the_engine_aborted_it() -> None:
    runner, engine, table = make(tokens=10_000)

    async def go() -> None:
        gen = runner.generate(request("inj"), injection=(seg((5, 6)),), capture=((0, 4),))
        await asyncio.wait_for(gen.__anext__(), WAIT_S)
        await gen.aclose()
        await until(lambda: table.count("discard", "inj") == 1)

    try:
        asyncio.run(go())
        ops = [op for op, key in table.log if key == "inj"]
        assert ops == ["offer", "add", "abort", "discard"]  # no step can capture after the discard
        assert len(table) == 0
    finally:
        runner.shutdown()
    assert table.count("discard", "inj") == 1


@pytest.mark.parametrize("stop", ["shutdown", "crash"])
def test_shutdown_and_crash_discard_every_waiting_request_key_once(stop: str) -> None:
    runner, engine, table = make()
    engine.paused.set()

    async def go() -> None:
        tasks = [asyncio.ensure_future(collect(runner, request(f"r{i}"), injection=(seg((5,)),), capture=((0, 2),)))
                 for i in range(3)]
        await until(lambda: len(engine.added) == 3)
        if stop == "shutdown":
            runner.shutdown()
        else:
            engine.crash = RuntimeError("device lost")
        for t in tasks:
            with pytest.raises(EngineUnavailable):
                await t

    asyncio.run(go())
    runner.shutdown()
    assert [table.count("discard", f"r{i}") for i in range(3)] == [1, 1, 1]
    assert len(table) == 0
