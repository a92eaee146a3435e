"""deployments/realtime_api.py: WebSocket /v1/realtime over a fake decode handle (no Ray, no engine).

The app is the real one (build_openai_app(..., realtime=frontend)); the decode pool's handle is
FakeDecode: realtime_open/realtime_tick/realtime_close each have .remote(msg) that records the
message and answers as a replica does (a replica id, a TickResult, a bool), or raises.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from baton.engine.realtime.messages import (
    RealtimeClose,
    RealtimeOpen,
    RealtimeTick,
    TickResult,
)
from baton.engine.types import EngineRequestError, EngineUnavailable
from deployments.chat import PromptRenderer
from deployments.config import RealtimeConfig
from deployments.frontend import OpenAIFrontend
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from deployments.realtime_api import RealtimeFrontend, parse_frame
from router.admission import AdmissionConfig
from router.policy import TurnPlan
from tests.unit.fakes import FakeBackend, FakeDirectory, FakeTokenizer

REPLICA = "replica-7"
START = {"type": "session.start", "instructions": "be brief"}


class _Method:
    def __init__(self, fn: Callable[[Any], Any]):
        self._fn = fn

    def remote(self, msg: Any) -> Any:
        return self._fn(msg)


class _Done:
    """An already-finished response (what realtime_close returns; the frontend need not await it)."""

    def __init__(self, value: Any):
        self.value = value

    def __await__(self):
        if False:  # a generator that finishes at once with `value`
            yield
        return self.value


class FakeDecode:
    """The decode pool's handle. tick_errors: seq -> exception raised by realtime_tick;
    tick_failures: seq -> TickResult.error; open_error: raised by realtime_open."""

    def __init__(self, tick_errors: dict[int, BaseException] | None = None, tick_failures: dict[int, str] | None = None,
                 open_error: BaseException | None = None, tick_delay_s: float = 0.0):
        self.tick_errors = dict(tick_errors or {})
        self.tick_failures = dict(tick_failures or {})
        self.open_error = open_error
        self.tick_delay_s = tick_delay_s
        self.opens: list[RealtimeOpen] = []
        self.ticks: list[RealtimeTick] = []
        self.closes: list[RealtimeClose] = []
        self.realtime_open = _Method(self._open)
        self.realtime_tick = _Method(self._tick)
        self.realtime_close = _Method(self._close)

    def _open(self, msg: RealtimeOpen) -> Any:
        self.opens.append(msg)

        async def answer() -> str:
            if self.open_error is not None:
                raise self.open_error
            return REPLICA

        return answer()

    def _tick(self, msg: RealtimeTick) -> Any:
        self.ticks.append(msg)

        async def answer() -> TickResult:
            if self.tick_delay_s:
                await asyncio.sleep(self.tick_delay_s)
            if msg.seq in self.tick_errors:
                raise self.tick_errors[msg.seq]
            return TickResult(seq=msg.seq, text=f"reply {msg.seq}", token_ids=(3, 4), server_s=0.001,
                              prompt_tokens=10 + msg.seq, computed_tokens=5, kv_peak_tokens=40 + msg.seq,
                              replica=REPLICA, error=self.tick_failures.get(msg.seq))

        return answer()

    def _close(self, msg: RealtimeClose) -> Any:
        self.closes.append(msg)
        return _Done(True)


class RecordingRealtimeMetrics:
    def __init__(self) -> None:
        self.ticks: list[tuple[float, bool]] = []
        self.live: list[tuple[int, int]] = []
        self.refusals = 0
        self.cliff_actions: list[str] = []
        self.shed_sessions = 0

    def tick(self, seconds: float, late: bool) -> None:
        self.ticks.append((seconds, late))

    def sessions(self, live: int, cap: int) -> None:
        self.live.append((live, cap))

    def refused(self) -> None:
        self.refusals += 1

    def cliff(self, action: str) -> None:
        self.cliff_actions.append(action)

    def shed(self, sessions: int) -> None:
        self.shed_sessions += sessions


def make(decode: FakeDecode | None = None, *, keys: dict[str, str | None] | None = None, directory: Any = None,
         **cfg: Any) -> tuple[TestClient, RealtimeFrontend, FakeDecode, RecordingRealtimeMetrics]:
    decode = decode or FakeDecode()
    renderer = PromptRenderer(FakeTokenizer())
    config = RealtimeConfig(**{"max_tokens_per_tick": 16, "max_input_chars": 50, "tick_ms": 200, **cfg})
    metrics = RecordingRealtimeMetrics()
    rt = RealtimeFrontend(config, decode, directory, renderer, metrics)
    frontend = OpenAIFrontend(model_id="m", renderer=renderer, backend=FakeBackend(), max_model_len=64,
                              default_max_tokens=4, metrics=RecordingMetrics())

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    return TestClient(build_openai_app(frontend, health, api_keys=keys, realtime=rt)), rt, decode, metrics


def closed_with(ws: Any) -> int:
    """Read until the server closes; the close code."""
    with pytest.raises(WebSocketDisconnect) as e:
        while True:
            ws.receive_text()
    return e.value.code


def error_then_close(ws: Any) -> tuple[dict[str, Any], int]:
    frame = ws.receive_json()
    assert frame["type"] == "error", frame
    return frame, closed_with(ws)


def started(ws: Any, start: dict[str, Any] = START) -> dict[str, Any]:
    ws.send_json(start)
    frame = ws.receive_json()
    assert frame["type"] == "session.started", frame
    return frame


def assert_all_released(rt: RealtimeFrontend, decode: FakeDecode) -> None:
    assert rt.live == 0
    assert len(decode.closes) == len(decode.opens)
    assert all(c.target_replica == REPLICA for c in decode.closes)
    assert [c.session_id for c in decode.closes] == [o.session_id for o in decode.opens]


# ---- a session --------------------------------------------------------------------------------------


def test_session_start_then_outputs_in_order_then_end() -> None:
    c, rt, decode, metrics = make(sink_tokens=4, window_tokens=32)
    with c.websocket_connect("/v1/realtime") as ws:
        frame = started(ws, {**START, "max_tokens": 5, "tick_ms": 100, "deadline_ms": 150})
        assert frame["mode"] == "bounded" and frame["sink_tokens"] == 4 and frame["window_tokens"] == 32
        assert frame["tick_ms"] == 100 and frame["deadline_ms"] == 150
        assert frame["session_id"] == decode.opens[0].session_id
        assert rt.live == 1
        for seq in range(3):
            ws.send_json({"type": "input", "seq": seq, "text": f"word{seq} more"})
        outs = [ws.receive_json() for _ in range(3)]
        ws.send_json({"type": "session.end"})
        assert closed_with(ws) == 1000
    assert [o["type"] for o in outs] == ["output"] * 3
    assert [o["seq"] for o in outs] == [0, 1, 2]
    assert [o["text"] for o in outs] == ["reply 0", "reply 1", "reply 2"]
    assert [o["prompt_tokens"] for o in outs] == [10, 11, 12] and outs[0]["computed_tokens"] == 5
    assert [o["kv_tokens"] for o in outs] == [40, 41, 42]
    assert all(o["server_ms"] >= 0 for o in outs)
    (opened,) = decode.opens
    assert opened.max_tokens == 5 and opened.mode == "bounded" and opened.target_replica is None
    renderer = PromptRenderer(FakeTokenizer())
    assert opened.preamble_ids == tuple(renderer.text_tokens(
        renderer.chat_text([{"role": "system", "content": "be brief"}], add_generation_prompt=False)))
    assert [t.seq for t in decode.ticks] == [0, 1, 2]
    assert all(t.target_replica == REPLICA and t.session_id == opened.session_id for t in decode.ticks)
    assert decode.ticks[1].input_ids == tuple(renderer.text_tokens(renderer.turn_text("-", "word1 more")))
    assert len(metrics.ticks) == 3 and all(not late for _, late in metrics.ticks)
    assert_all_released(rt, decode)
    assert metrics.live[-1][0] == 0 and max(live for live, _ in metrics.live) == 1


def test_defaults_come_from_the_config() -> None:
    c, rt, decode, _ = make(mode="unbounded", max_tokens_per_tick=7, tick_ms=300)
    with c.websocket_connect("/v1/realtime") as ws:
        frame = started(ws, {"type": "session.start"})
        ws.send_json({"type": "session.end"})
        assert closed_with(ws) == 1000
    assert frame["mode"] == "unbounded" and frame["tick_ms"] == 300 and frame["deadline_ms"] == 300
    assert decode.opens[0].max_tokens == 7 and decode.opens[0].preamble_ids  # the default instructions
    assert_all_released(rt, decode)


def test_the_directory_pins_the_session_to_a_replica() -> None:
    directory = FakeDirectory([TurnPlan(decode_replica="replica-3", remote_prefill=False, reason="new")])
    c, rt, decode, _ = make(directory=directory)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_json({"type": "session.end"})
        assert closed_with(ws) == 1000
    assert decode.opens[0].target_replica == "replica-3"
    (route_args,) = directory.called("route")
    assert route_args[0] == decode.opens[0].session_id and route_args[2] == len(decode.opens[0].preamble_ids)
    # a server-made id: never in the ownership store; placed away from decoders near their KV cliff (realtime.cliff)
    assert directory.kwargs[0] == ("route", {"owned": False, "cliff_horizon_s": 30.0})
    assert_all_released(rt, decode)


def test_a_client_that_hangs_up_releases_its_session() -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_json({"type": "input", "seq": 0, "text": "hi"})
        assert ws.receive_json()["type"] == "output"
    assert_all_released(rt, decode)


def test_a_disconnect_message_is_a_disconnect_not_a_bad_frame() -> None:
    with pytest.raises(WebSocketDisconnect) as e:
        parse_frame({"type": "websocket.disconnect", "code": 1001})
    assert e.value.code == 1001


# ---- idle sessions ------------------------------------------------------------------------------------


def test_a_session_idle_for_idle_timeout_is_closed_4408_and_released() -> None:
    c, rt, decode, metrics = make(idle_timeout_s=0.05)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_json({"type": "input", "seq": 0, "text": "hi"})
        assert ws.receive_json()["type"] == "output"
        assert rt.live == 1
        frame, code = error_then_close(ws)  # then the client sends nothing
    assert frame["code"] == "idle_timeout" and "0.05 s" in frame["message"]
    assert code == 4408
    assert len(decode.ticks) == 1
    assert_all_released(rt, decode)  # the engine-side session closed, the admission slot free
    assert metrics.live[-1][0] == 0


def test_a_slow_engine_is_not_an_idle_client() -> None:
    decode = FakeDecode(tick_delay_s=0.1)  # a tick longer than the idle timeout
    c, rt, _, _ = make(decode, idle_timeout_s=0.05)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_json({"type": "input", "seq": 0, "text": "hi"})
        ws.send_json({"type": "session.end"})
        assert ws.receive_json()["type"] == "output"
        assert closed_with(ws) == 1000
    assert_all_released(rt, decode)


def test_a_connection_that_never_starts_a_session_is_closed_4408() -> None:
    c, rt, decode, _ = make(idle_timeout_s=0.05)
    with c.websocket_connect("/v1/realtime") as ws:
        frame, code = error_then_close(ws)
    assert frame["code"] == "idle_timeout" and code == 4408
    assert decode.opens == [] and rt.live == 0


# ---- bad frames ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("send", [lambda ws: ws.send_text("not json {"), lambda ws: ws.send_bytes(b'{"type": "session.start"}')])
def test_a_first_frame_that_is_not_json_text_closes_1007(send: Callable[[Any], None]) -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        send(ws)
        frame, code = error_then_close(ws)
    assert frame["code"] == "invalid_frame" and code == 1007
    assert decode.opens == [] and rt.live == 0


@pytest.mark.parametrize("send", [lambda ws: ws.send_text("[1, 2"), lambda ws: ws.send_bytes(b"\x00\x01")])
def test_a_later_frame_that_is_not_json_text_closes_1007(send: Callable[[Any], None]) -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        send(ws)
        frame, code = error_then_close(ws)
    assert frame["code"] == "invalid_frame" and code == 1007
    assert_all_released(rt, decode)


@pytest.mark.parametrize(
    "first, code",
    [
        ({"type": "input", "seq": 0, "text": "hi"}, "invalid_frame"),
        ([1, 2, 3], "invalid_frame"),
        ({"no_type": 1}, "invalid_frame"),
        ({**START, "max_tokens": 17}, "invalid_value"),
        ({**START, "max_tokens": 0}, "invalid_value"),
        ({**START, "max_tokens": True}, "invalid_value"),
        ({**START, "max_tokens": "4"}, "invalid_value"),
        ({**START, "mode": "bogus"}, "invalid_value"),
        ({**START, "instructions": "x" * 51}, "invalid_value"),
        ({**START, "instructions": 5}, "invalid_value"),
        ({**START, "tick_ms": 5}, "invalid_value"),
        ({**START, "deadline_ms": 600_001}, "invalid_value"),
    ],
)
def test_a_bad_session_start_is_refused_with_1008(first: Any, code: str) -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        ws.send_text(json.dumps(first))
        frame, close = error_then_close(ws)
    assert frame["code"] == code and frame["message"]
    assert close == 1008
    assert decode.opens == [] and rt.live == 0


@pytest.mark.parametrize(
    "frame, code",
    [
        ({"type": "input", "seq": 1, "text": "y" * 51}, "invalid_value"),
        ({"type": "input", "seq": 1, "text": 3}, "invalid_value"),
        ({"type": "input", "text": "no seq"}, "invalid_value"),
        ({"type": "input", "seq": -1, "text": "hi"}, "invalid_value"),
        ({"type": "session.start"}, "invalid_frame"),
    ],
)
def test_a_bad_frame_mid_session_closes_1008_and_releases_the_session(frame: dict[str, Any], code: str) -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_json({"type": "input", "seq": 0, "text": "fine"})
        assert ws.receive_json()["seq"] == 0
        ws.send_json(frame)
        err, close = error_then_close(ws)
    assert err["code"] == code and close == 1008
    assert len(decode.ticks) == 1  # the bad frame reached no engine
    assert_all_released(rt, decode)


# ---- admission ------------------------------------------------------------------------------------------


def test_sessions_over_the_cap_are_refused_with_1013_and_a_retry_hint() -> None:
    c, rt, decode, metrics = make(admission=AdmissionConfig(initial_cap=1, retry_after_s=3.5))
    with c.websocket_connect("/v1/realtime") as first:
        started(first)
        with c.websocket_connect("/v1/realtime") as second:
            second.send_json(START)
            frame, code = error_then_close(second)
        assert frame["code"] == "session_limit" and frame["retry_after_s"] == 3.5
        assert code == 1013
        assert rt.live == 1 and len(decode.opens) == 1 and metrics.refusals == 1
        first.send_json({"type": "input", "seq": 0, "text": "still here"})
        assert first.receive_json()["type"] == "output"  # the admitted session is unaffected
        first.send_json({"type": "session.end"})
        assert closed_with(first) == 1000
    assert_all_released(rt, decode)
    with c.websocket_connect("/v1/realtime") as again:  # room again once the first has left
        started(again)
    assert_all_released(rt, decode)
    assert len(decode.opens) == 2


# ---- engine answers ---------------------------------------------------------------------------------------


def test_a_rejected_tick_is_an_error_frame_and_the_session_goes_on() -> None:
    decode = FakeDecode(tick_errors={1: EngineRequestError("session 'x' is not open on this replica")})
    c, rt, _, _ = make(decode)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        frames = []
        for seq in range(3):
            ws.send_json({"type": "input", "seq": seq, "text": "hi"})
            frames.append(ws.receive_json())
        ws.send_json({"type": "session.end"})
        assert closed_with(ws) == 1000
    assert [f["type"] for f in frames] == ["output", "error", "output"]
    assert frames[1]["code"] == "tick_rejected" and frames[1]["seq"] == 1 and "not open" in frames[1]["message"]
    assert [f.get("seq") for f in frames] == [0, 1, 2]
    assert_all_released(rt, decode)


def test_a_failed_tick_is_an_error_frame_and_a_miss_for_admission_control() -> None:
    decode = FakeDecode(tick_failures={1: "engine rejected the prompt"})
    c, rt, _, metrics = make(decode)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        frames = []
        for seq in range(3):
            ws.send_json({"type": "input", "seq": seq, "text": "hi"})
            frames.append(ws.receive_json())
    assert [f["type"] for f in frames] == ["output", "error", "output"]
    assert frames[1]["code"] == "tick_failed" and frames[1]["seq"] == 1
    window = rt.controller.window(time.monotonic())
    assert len(window) == 3
    assert sum(math.isinf(x) for x in window) == 1  # the client got no reply: +inf, not a fast tick
    assert len(metrics.ticks) == 3
    assert_all_released(rt, decode)


@pytest.mark.parametrize("error", [EngineUnavailable("engine died"), RuntimeError("ray blew up"), KeyError("x")])
def test_an_engine_failure_closes_1011_without_an_unhandled_exception(error: BaseException) -> None:
    decode = FakeDecode(tick_errors={1: error})
    c, rt, _, _ = make(decode)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_json({"type": "input", "seq": 0, "text": "hi"})
        assert ws.receive_json()["type"] == "output"
        ws.send_json({"type": "input", "seq": 1, "text": "hi"})
        frame, code = error_then_close(ws)
    assert frame["code"] == "engine_unavailable" and code == 1011
    assert_all_released(rt, decode)


def test_a_failed_open_closes_1011_and_frees_the_slot() -> None:
    decode = FakeDecode(open_error=EngineUnavailable("no replica"))
    c, rt, _, metrics = make(decode)
    with c.websocket_connect("/v1/realtime") as ws:
        ws.send_json(START)
        frame, code = error_then_close(ws)
    assert frame["code"] == "engine_unavailable" and code == 1011
    assert rt.live == 0 and decode.closes == []  # nothing was opened, nothing to close
    assert metrics.live[-1][0] == 0


def test_a_slow_tick_counts_as_late_for_the_server_metric() -> None:
    decode = FakeDecode(tick_delay_s=0.05)
    c, rt, _, metrics = make(decode)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws, {**START, "tick_ms": 10, "deadline_ms": 20})
        ws.send_json({"type": "input", "seq": 0, "text": "hi"})
        out = ws.receive_json()
    assert out["type"] == "output" and out["server_ms"] >= 50
    assert metrics.ticks[0][0] >= 0.05 and metrics.ticks[0][1] is True
    assert_all_released(rt, decode)


# ---- client send timestamps (sent_at) ---------------------------------------------------------------------


def test_sent_at_puts_the_queueing_before_the_read_into_the_latency() -> None:
    c, rt, decode, metrics = make()
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws, {**START, "tick_ms": 100, "deadline_ms": 200})
        ws.send_json({"type": "input", "seq": 0, "text": "hi", "sent_at": time.time() - 0.5})  # queued 0.5 s on the client's side
        queued = ws.receive_json()
        ws.send_json({"type": "input", "seq": 1, "text": "hi"})  # without sent_at: from the read, as before
        plain = ws.receive_json()
        ws.send_json({"type": "input", "seq": 2, "text": "hi", "sent_at": time.time() + 0.5})  # within the 1 s clock skew
        skewed = ws.receive_json()
    assert queued["queued_ms"] >= 500 and queued["server_ms"] < 500  # server_ms stays the server's own time
    assert "queued_ms" not in plain and skewed["queued_ms"] == 0.0
    (lat0, late0), (lat1, late1), (lat2, late2) = metrics.ticks
    assert lat0 >= 0.5 and late0 is True  # past the 200 ms deadline only because of the queueing
    assert lat1 < 0.2 and not late1 and lat2 < 0.2 and not late2
    assert max(rt.controller.window(time.monotonic())) >= 0.5  # the AIMD controller sees it too
    assert_all_released(rt, decode)


@pytest.mark.parametrize("sent_at", ["yesterday", True, [1.0], 10 ** 400, "future", "past"],
                         ids=["text", "bool", "list", "huge int", "30 s ahead", "an hour behind"])
def test_a_bad_sent_at_is_an_error_frame_and_closes_1008(sent_at: Any) -> None:
    c, rt, decode, _ = make(idle_timeout_s=60.0)
    value = {"future": time.time() + 30.0, "past": time.time() - 3600.0}.get(sent_at, sent_at) if isinstance(sent_at, str) else sent_at
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_text(json.dumps({"type": "input", "seq": 0, "text": "hi", "sent_at": value}))
        err, close = error_then_close(ws)
    assert err["code"] == "invalid_value" and "sent_at" in err["message"] and close == 1008
    assert decode.ticks == []  # the frame reached no engine
    assert_all_released(rt, decode)


def test_a_nan_sent_at_closes_1008() -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_text('{"type": "input", "seq": 0, "text": "hi", "sent_at": NaN}')  # Python's json reads it as a float
        frame, code = error_then_close(ws)
    assert frame["code"] == "invalid_value" and code == 1008
    assert_all_released(rt, decode)


# ---- the KV cliff at admission (realtime.cliff) --------------------------------------------------------------


def cliff_directory(eta: float | None) -> FakeDirectory:
    return FakeDirectory([TurnPlan(decode_replica=REPLICA, remote_prefill=False, reason="new", cliff_eta_s=eta)])


def test_a_session_is_refused_when_its_decoder_is_about_to_hit_the_cliff() -> None:
    from router.cliff import CliffAdmissionConfig

    c, rt, decode, metrics = make(directory=cliff_directory(5.0), cliff=CliffAdmissionConfig(action="refuse", horizon_s=30.0,
                                                                                               retry_after_s=7.0))
    with c.websocket_connect("/v1/realtime") as ws:
        ws.send_json(START)
        frame, code = error_then_close(ws)
    assert frame["code"] == "cliff_ahead" and frame["retry_after_s"] == 7.0 and "5.0 s" in frame["message"]
    assert code == 1013 and decode.opens == [] and rt.live == 0
    assert metrics.cliff_actions == ["refuse"]


def test_with_warn_the_session_is_admitted_and_told() -> None:
    c, rt, decode, metrics = make(directory=cliff_directory(5.0))  # the default action: warn
    with c.websocket_connect("/v1/realtime") as ws:
        frame = started(ws)
        ws.send_json({"type": "session.end"})
        assert closed_with(ws) == 1000
    assert frame["warning"]["code"] == "cliff_ahead" and metrics.cliff_actions == ["warn"]
    assert len(decode.opens) == 1
    assert_all_released(rt, decode)


@pytest.mark.parametrize("eta", [None, 120.0])
def test_a_distant_or_absent_cliff_admits_silently(eta: float | None) -> None:
    from router.cliff import CliffAdmissionConfig

    c, rt, decode, metrics = make(directory=cliff_directory(eta), cliff=CliffAdmissionConfig(action="refuse"))
    with c.websocket_connect("/v1/realtime") as ws:
        frame = started(ws)
    assert "warning" not in frame and metrics.cliff_actions == []
    assert decode.opens[0].tick_s == pytest.approx(0.2)  # the session's period reaches the replica (its growth rate)
    assert_all_released(rt, decode)


# ---- API keys ------------------------------------------------------------------------------------------------


def test_with_api_keys_a_websocket_needs_the_bearer_key() -> None:
    c, rt, decode, _ = make(keys={"k": None})
    with pytest.raises(WebSocketDisconnect) as e, c.websocket_connect("/v1/realtime") as ws:
        ws.receive_json()
    assert e.value.code == 1008
    with pytest.raises(WebSocketDisconnect) as e, c.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer wrong"}) as ws:
        ws.receive_json()
    assert e.value.code == 1008
    assert decode.opens == [] and rt.live == 0
    with c.websocket_connect("/v1/realtime", headers={"Authorization": "Bearer k"}) as ws:
        started(ws)
        ws.send_json({"type": "input", "seq": 0, "text": "hi"})
        assert ws.receive_json()["type"] == "output"
    assert len(decode.opens) == 1
    assert_all_released(rt, decode)
