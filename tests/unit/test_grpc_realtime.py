"""gRPC `Realtime` (deployments/grpc_realtime.py): the WebSocket protocol's frames over a
bidirectional stream, served by the same RealtimeFrontend over the fake decode handle of
test_realtime_api.py, on a real in-process gRPC server: the session, its close as a status, the
session cap as RESOURCE_EXHAUSTED with retry-after, keys from metadata."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from deployments import grpc_realtime
from deployments.chat import PromptRenderer
from deployments.chat_service import ChatService
from deployments.config import RealtimeConfig
from deployments.frontend import OpenAIFrontend
from deployments.grpc_api import GrpcFrontend
from deployments.grpc_gen import baton_pb2 as pb
from deployments.grpc_realtime import Close, close_status
from deployments.grpc_status import retry_info_seconds
from deployments.metrics import RecordingMetrics
from deployments.realtime_api import RealtimeFrontend
from deployments.realtime_frames import CLOSE_BAD_DATA, CLOSE_IDLE, CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_TOO_BIG, CLOSE_TRY_LATER
from router.admission import AdmissionConfig
from tests.unit.fakes import FakeBackend, FakeTokenizer
from tests.unit.grpc_fixtures import stub_for
from tests.unit.test_realtime_api import REPLICA, START, FakeDecode

KEYS = {"opkey": None, "anakey": "ana"}


def make(keys: dict[str, str | None] | None = None, **cfg: Any) -> tuple[GrpcFrontend, RealtimeFrontend, FakeDecode]:
    decode = FakeDecode()
    renderer = PromptRenderer(FakeTokenizer())
    rt = RealtimeFrontend(RealtimeConfig(**{"max_tokens_per_tick": 16, "max_input_chars": 50, "tick_ms": 200, **cfg}), decode, None, renderer)
    frontend = OpenAIFrontend(model_id="m", renderer=renderer, backend=FakeBackend(), max_model_len=64, default_max_tokens=4,
                              metrics=RecordingMetrics())
    return GrpcFrontend(ChatService(frontend), keys, rt), rt, decode


class Session:
    """One Realtime call: send frames, read frames, then the status."""

    def __init__(self, call: Any):
        self.call = call

    async def send(self, data: dict[str, Any] | str) -> None:
        await self.call.write(pb.RealtimeFrame(json=data if isinstance(data, str) else json.dumps(data)))

    async def recv(self) -> dict[str, Any]:
        msg = await self.call.read()
        assert msg is not grpc.aio.EOF, "the stream ended"
        return json.loads(msg.json)

    async def status(self) -> tuple[grpc.StatusCode, str, dict[str, Any]]:
        rest = []
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                rest.append(msg)
        except grpc.aio.AioRpcError:  # how read() reports a failed status once the messages are read
            pass
        assert not rest, rest
        return await self.call.code(), await self.call.details(), dict(await self.call.trailing_metadata() or ())


async def session(g: GrpcFrontend, metadata: Any = ()) -> AsyncIterator[Session]:
    async with stub_for(g) as stub:
        yield Session(stub.Realtime(metadata=metadata))


def drive(g: GrpcFrontend, script: Any, metadata: Any = ()) -> Any:
    async def main() -> Any:
        async for s in session(g, metadata):
            return await script(s)

    return asyncio.run(main())


def test_a_session_over_grpc_is_the_websocket_session() -> None:
    g, rt, decode = make(sink_tokens=4, window_tokens=32)

    async def script(s: Session) -> Any:
        await s.send({**START, "max_tokens": 5})
        started = await s.recv()
        outs = []
        for seq in range(3):
            await s.send({"type": "input", "seq": seq, "text": f"word{seq} more"})
            outs.append(await s.recv())
        await s.send({"type": "session.end"})
        return started, outs, await s.status()

    started, outs, (code, _, _) = drive(g, script)
    assert started["type"] == "session.started" and started["sink_tokens"] == 4 and started["session_id"] == decode.opens[0].session_id
    assert [(o["type"], o["seq"], o["text"]) for o in outs] == [("output", i, f"reply {i}") for i in range(3)]
    assert code == grpc.StatusCode.OK
    assert rt.live == 0 and [c.session_id for c in decode.closes] == [o.session_id for o in decode.opens]
    assert all(c.target_replica == REPLICA for c in decode.closes)


def test_a_client_that_ends_its_stream_ends_the_session() -> None:
    g, rt, decode = make()

    async def script(s: Session) -> Any:
        await s.send(START)
        await s.recv()
        await s.send({"type": "input", "seq": 0, "text": "hi"})
        out = await s.recv()
        await s.call.done_writing()
        return out, await s.status()

    out, (code, _, _) = drive(g, script)
    assert out["text"] == "reply 0" and code == grpc.StatusCode.OK and rt.live == 0 and len(decode.closes) == 1


def test_bad_frames_end_with_an_error_frame_and_invalid_argument() -> None:
    g, rt, _ = make()

    async def script(s: Session) -> Any:
        await s.send("not json")
        return await s.recv(), await s.status()

    frame, (code, details, meta) = drive(g, script)
    assert frame["type"] == "error" and frame["code"] == "invalid_frame"
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == frame["message"] and json.loads(meta["baton-error"])["close"] == CLOSE_BAD_DATA
    assert rt.live == 0


def test_the_session_cap_is_resource_exhausted_with_retry_after() -> None:
    g, rt, _ = make(admission=AdmissionConfig(initial_cap=1, retry_after_s=3.5))

    async def main() -> Any:
        async with stub_for(g) as stub:
            first, second = Session(stub.Realtime()), Session(stub.Realtime())
            await first.send(START)
            await first.recv()
            await second.send(START)
            refused = await second.recv(), await second.status()
            await first.send({"type": "session.end"})
            return refused, await first.status()

    (frame, (code, _, meta)), (first_code, _, _) = asyncio.run(main())
    assert frame["code"] == "session_limit" and frame["retry_after_s"] == 3.5
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and meta["retry-after"] == "4" and retry_info_seconds(list(meta.items())) == 4
    assert first_code == grpc.StatusCode.OK and rt.live == 0


def test_a_refused_call_reads_the_first_frame_and_a_silent_client_is_refused_anyway(monkeypatch: pytest.MonkeyPatch) -> None:
    g, _, _ = make()
    off = GrpcFrontend(g._chat)  # no real-time frontend: the deployment has `realtime` off
    monkeypatch.setattr(grpc_realtime, "FIRST_FRAME_WAIT_S", 0.05)

    async def writes_first(s: Session) -> Any:
        await s.send(START)
        return await s.recv(), await s.status()

    async def silent(s: Session) -> Any:
        return await s.recv(), await s.status()

    for script in (writes_first, silent):
        frame, (code, details, _) = drive(off, script)
        assert frame["code"] == "realtime_unavailable" and code == grpc.StatusCode.NOT_FOUND and details == frame["message"]


def test_keys_from_metadata_decide_the_sessions_user() -> None:
    g, rt, _ = make(keys=KEYS, max_sessions_per_user=1)

    async def unauthenticated(s: Session) -> Any:
        # the usual client: its session.start written at once. The call is refused at its start; the
        # server reads that frame first, so the write never races the call's end (which grpc's client
        # reports as INTERNAL: 1 run in ~10 before it did)
        await s.send(START)
        return await s.recv(), await s.status()

    async def refused(s: Session) -> Any:
        await s.send(START)
        return await s.recv(), await s.status()

    for _ in range(20):  # the race was 1 in ~10
        frame, (code, _, _) = drive(g, unauthenticated, [("authorization", "Bearer nope")])
        assert frame["code"] == "invalid_api_key" and code == grpc.StatusCode.UNAUTHENTICATED
    frame, (code, _, _) = drive(g, refused, [("authorization", "Bearer anakey"), ("x-baton-user", "bob")])
    assert frame["code"] == "user_mismatch" and code == grpc.StatusCode.PERMISSION_DENIED

    async def ok(s: Session) -> Any:
        await s.send({**START, "user": "ana"})
        started = await s.recv()
        await s.send({"type": "session.end"})
        return started, await s.status()

    started, (code, _, _) = drive(g, ok, [("authorization", "Bearer anakey")])
    assert started["type"] == "session.started" and code == grpc.StatusCode.OK and rt.live == 0


def test_close_codes_map_to_statuses() -> None:
    assert close_status(Close(CLOSE_NORMAL), None).code == grpc.StatusCode.OK
    assert close_status(Close(CLOSE_TOO_BIG), {"code": "frame_too_large", "message": "big"}).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert close_status(Close(CLOSE_INTERNAL), {"code": "engine_unavailable", "message": "x"}).code == grpc.StatusCode.UNAVAILABLE
    assert close_status(Close(CLOSE_IDLE), {"code": "idle_timeout", "message": "x"}).code == grpc.StatusCode.DEADLINE_EXCEEDED
    s = close_status(Close(CLOSE_TRY_LATER), {"code": "session_limit", "message": "full", "retry_after_s": 0.2})
    assert s.code == grpc.StatusCode.RESOURCE_EXHAUSTED and dict(s.trailing)["retry-after"] == "1"
    assert close_status(Close(1008), {"code": "too_many_sessions", "message": "x"}).code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_sent_at_works_over_grpc_and_a_bad_one_is_invalid_argument() -> None:
    g, rt, decode = make()

    async def script(s: Session) -> Any:
        await s.send(START)
        await s.recv()
        await s.send({"type": "input", "seq": 0, "text": "hi", "sent_at": time.time() - 0.25})
        out = await s.recv()
        await s.send({"type": "input", "seq": 1, "text": "hi", "sent_at": "now"})
        err = await s.recv()
        return out, err, await s.status()

    out, err, (code, _, _) = drive(g, script)
    assert out["type"] == "output" and out["queued_ms"] >= 250
    assert err["code"] == "invalid_value" and code == grpc.StatusCode.INVALID_ARGUMENT
    assert rt.live == 0 and len(decode.ticks) == 1
