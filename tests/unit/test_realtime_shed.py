"""Shedding at the ingress (deployments/realtime_api.py, realtime.admission.overload: shed): when a
tick's controller update cuts the cap below the live sessions, the newest are closed at their next
tick boundary with the shed_overload error frame and 1013, their slots freed once; under drain
nothing is closed. The sessions run on fake sockets (queues) against the fake decode handle of
test_realtime_api.py, on one event loop; over gRPC the same close is RESOURCE_EXHAUSTED."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from deployments.chat import PromptRenderer
from deployments.config import RealtimeConfig
from deployments.realtime_api import RealtimeFrontend
from deployments.realtime_frames import CLOSE_NORMAL, CLOSE_TRY_LATER
from router.admission import AdmissionConfig
from tests.unit.fakes import FakeTokenizer
from tests.unit.test_realtime_api import START, FakeDecode, RecordingRealtimeMetrics

# every tick (10 ms in the fake engine) overshoots a 1 ms target; a period elapses between steps
ADMISSION = dict(target_p99_ms=1.0, initial_cap=3, min_cap=2, control_period_s=0.05, window_s=1.0, min_samples=1, retry_after_s=2.5)
PERIOD_S = 0.06


class FakeSocket:
    """A client's socket: what the client sends waits in `inbox`; what the server sends lands in
    `frames`, its close in `closed` (code, reason)."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.closed: tuple[int, str | None] | None = None

    async def accept(self) -> None:
        return None

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send_json(self, data: Any) -> None:
        self.frames.put_nowait(data)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason)

    def send(self, data: dict[str, Any]) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(data)})

    async def next_frame(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.frames.get(), 2.0)


def frontend(overload: str) -> tuple[RealtimeFrontend, FakeDecode, RecordingRealtimeMetrics]:
    decode = FakeDecode(tick_delay_s=0.01)
    metrics = RecordingRealtimeMetrics()
    cfg = RealtimeConfig(max_tokens_per_tick=16, max_input_chars=50, tick_ms=200,
                         admission=AdmissionConfig(**ADMISSION, overload=overload))  # type: ignore[arg-type]
    return RealtimeFrontend(cfg, decode, None, PromptRenderer(FakeTokenizer()), metrics), decode, metrics


async def open_sessions(rt: RealtimeFrontend, n: int) -> tuple[list[FakeSocket], list[asyncio.Task[None]]]:
    """n sessions started one after another (admitted in order: the last is the newest)."""
    socks, tasks = [], []
    for _ in range(n):
        ws = FakeSocket()
        tasks.append(asyncio.create_task(rt.serve(ws)))
        ws.send(START)
        assert (await ws.next_frame())["type"] == "session.started"
        socks.append(ws)
    return socks, tasks


async def tick(ws: FakeSocket, seq: int) -> dict[str, Any]:
    ws.send({"type": "input", "seq": seq, "text": "hi"})
    return await ws.next_frame()


async def end(socks: list[FakeSocket], tasks: list[asyncio.Task[None]]) -> None:
    for ws, t in zip(socks, tasks, strict=True):
        if not t.done():
            ws.send({"type": "session.end"})
    await asyncio.wait_for(asyncio.gather(*tasks), 2.0)


def test_under_shed_the_newest_session_gets_the_error_frame_and_1013_and_its_slot_back_once() -> None:
    async def main() -> None:
        rt, decode, metrics = frontend("shed")
        (a, b, c), tasks = await open_sessions(rt, 3)
        await asyncio.sleep(PERIOD_S)
        out = await tick(a, 0)  # this tick's update: p99 10 ms > 1 ms, cap 3 -> 2, one session over it
        assert out["type"] == "output" and out["seq"] == 0  # the session that triggered it keeps its reply
        frame = await c.next_frame()  # c, the newest, waiting for its client's next input: closed now
        assert frame["type"] == "error" and frame["code"] == "shed_overload"
        assert (frame["cap"], frame["live_sessions"], frame["retry_after_s"]) == (2, 3, 2.5)
        await asyncio.wait_for(tasks[2], 2.0)
        assert c.closed is not None and c.closed[0] == CLOSE_TRY_LATER == 1013
        # its slot was freed exactly once: two sessions hold the two slots of the new cap
        assert rt.live == 2 and rt.controller.cap == 2 and metrics.shed_sessions == 1
        assert rt.snapshot() == {"live_sessions": 2, "cap": 2, "overload": "shed", "sessions_shed_total": 1}
        assert [cl.session_id for cl in decode.closes] == [decode.opens[2].session_id]  # its engine-side session closed
        # the older sessions go on; at the floor (min_cap 2) nothing more is shed
        await asyncio.sleep(PERIOD_S)
        assert (await tick(b, 0))["type"] == "output" and (await tick(a, 1))["type"] == "output"
        assert rt.controller.cap == 2 and metrics.shed_sessions == 1
        await end([a, b], tasks[:2])
        assert a.closed == (CLOSE_NORMAL, None) and b.closed == (CLOSE_NORMAL, None)
        assert rt.live == 0 and len(decode.closes) == len(decode.opens) == 3
        rt._sessions.check_integrity()
        rt.controller.check_integrity()

    asyncio.run(main())


def test_a_shed_session_mid_tick_gets_its_reply_first_then_the_close() -> None:
    async def main() -> None:
        rt, decode, metrics = frontend("shed")
        socks, tasks = await open_sessions(rt, 3)
        await asyncio.sleep(PERIOD_S)
        newest = socks[2]
        out = await tick(newest, 0)  # its own tick cuts the cap and sheds it: the reply still comes, whole
        assert out["type"] == "output" and out["text"] == "reply 0"
        frame = await newest.next_frame()
        assert frame["code"] == "shed_overload"
        await asyncio.wait_for(tasks[2], 2.0)
        assert newest.closed is not None and newest.closed[0] == 1013
        assert len(decode.ticks) == 1 and rt.live == 2 and metrics.shed_sessions == 1
        await end(socks[:2], tasks[:2])
        assert rt.live == 0 and len(decode.closes) == 3

    asyncio.run(main())


def test_under_drain_the_cut_closes_nobody() -> None:
    async def main() -> None:
        rt, decode, metrics = frontend("drain")
        socks, tasks = await open_sessions(rt, 3)
        await asyncio.sleep(PERIOD_S)
        assert (await tick(socks[0], 0))["type"] == "output"
        assert rt.controller.cap == 2 and rt.live == 3  # over the cap: the three tick on
        for i, ws in enumerate(socks):
            assert (await tick(ws, 1 + i))["type"] == "output"
        assert metrics.shed_sessions == 0 and all(not t.done() for t in tasks)
        assert rt.snapshot()["sessions_shed_total"] == 0
        await end(socks, tasks)
        assert rt.live == 0 and all(ws.closed == (CLOSE_NORMAL, None) for ws in socks)

    asyncio.run(main())


@pytest.mark.parametrize("overload", ["drain", "shed"])
def test_the_config_takes_the_overload_mode_and_nothing_else(overload: str) -> None:
    from pydantic import ValidationError

    assert RealtimeConfig(admission={"overload": overload}).admission.overload == overload  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        RealtimeConfig(admission={"overload": "evict"})  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        RealtimeConfig(admission={"overload": overload, "shed_order": "oldest"})  # type: ignore[arg-type]


def test_over_grpc_a_shed_session_ends_resource_exhausted_with_the_code_and_retry_after() -> None:
    from deployments.chat_service import ChatService
    from deployments.frontend import OpenAIFrontend
    from deployments.grpc_api import GrpcFrontend
    from deployments.metrics import RecordingMetrics
    from tests.unit.fakes import FakeBackend
    from tests.unit.grpc_fixtures import stub_for
    from tests.unit.test_grpc_realtime import Session

    rt, _, metrics = frontend("shed")
    renderer = PromptRenderer(FakeTokenizer())
    chat = OpenAIFrontend(model_id="m", renderer=renderer, backend=FakeBackend(), max_model_len=64, default_max_tokens=4,
                          metrics=RecordingMetrics())
    g = GrpcFrontend(ChatService(chat), None, rt)

    async def main() -> Any:
        async with stub_for(g) as stub:
            calls = [Session(stub.Realtime()) for _ in range(3)]
            for s in calls:
                await s.send(START)
                assert (await s.recv())["type"] == "session.started"
            await asyncio.sleep(PERIOD_S)
            await calls[0].send({"type": "input", "seq": 0, "text": "hi"})
            assert (await calls[0].recv())["type"] == "output"
            shed_frame, status = await calls[2].recv(), await calls[2].status()
            for s in calls[:2]:
                await s.send({"type": "session.end"})
                assert (await s.status())[0] == grpc.StatusCode.OK
            return shed_frame, status

    frame, (code, _, meta) = asyncio.run(main())
    assert frame["code"] == "shed_overload" and frame["retry_after_s"] == 2.5
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and meta["retry-after"] == "2"
    assert json.loads(meta["baton-error"]) == {"code": "shed_overload", "message": frame["message"], "close": 1013}
    assert rt.live == 0 and metrics.shed_sessions == 1
