"""Real-time sessions over the WebSocket of the running application (Ray + Serve + vLLM):
ticks in order with bounded KV, clear errors for malformed frames, AIMD refusal at the cap."""
from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.e2e.colocated_app.conftest import REALTIME_CAP as CAP
from tests.e2e.conftest import SharedApp

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture
def ws_url(shared_app: SharedApp) -> str:
    return shared_app.url.replace("http://", "ws://") + "/v1/realtime"  # the folder's application (conftest.py)


def _start(ws: Any, **kw: Any) -> dict[str, Any]:
    ws.send(json.dumps({"type": "session.start", "max_tokens": 6, **kw}))
    return json.loads(ws.recv(timeout=120))


LINES = ["Hello, I need help with my order.", "It was supposed to arrive yesterday.", "The order number is 4471.",
         "Can you check where it is?", "Thanks, please also send me an email.", "Bye for now."]


def test_ticks_are_answered_in_order_with_bounded_kv(ws_url: str) -> None:
    with connect(ws_url, open_timeout=30) as ws:
        started = _start(ws, tick_ms=2000)
        assert started["type"] == "session.started" and started["window_tokens"] == 64
        outs = []
        for seq, line in enumerate(LINES):
            ws.send(json.dumps({"type": "input", "seq": seq, "text": line}))
            outs.append(json.loads(ws.recv(timeout=120)))
        assert [o["type"] for o in outs] == ["output"] * len(LINES), outs
        assert [o["seq"] for o in outs] == list(range(len(LINES)))
        assert all(o["text"] for o in outs)
        # after the first tick only the new tokens are computed; the prompt never exceeds S + W + new
        assert all(o["computed_tokens"] < o["prompt_tokens"] <= 16 + 64 + 40 for o in outs[2:])
        ws.send(json.dumps({"type": "session.end"}))
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=30)
        assert e.value.rcvd is not None and e.value.rcvd.code == 1000


def test_malformed_frames_get_an_error_and_a_close_code(ws_url: str) -> None:
    for frame, code, close in (("not json", "invalid_frame", 1007), (json.dumps({"type": "input"}), "invalid_frame", 1008),
                               (json.dumps({"type": "session.start", "max_tokens": 10_000}), "invalid_value", 1008)):
        with connect(ws_url, open_timeout=30) as ws:
            ws.send(frame)
            err = json.loads(ws.recv(timeout=30))
            assert err["type"] == "error" and err["code"] == code
            with pytest.raises(ConnectionClosed) as e:
                ws.recv(timeout=30)
            assert e.value.rcvd is not None and e.value.rcvd.code == close
    with connect(ws_url, open_timeout=30) as ws:  # a binary frame mid-session
        _start(ws)
        ws.send(b"\x00\x01")
        assert json.loads(ws.recv(timeout=30))["code"] == "invalid_frame"


def test_sessions_above_the_cap_are_refused_with_a_retry_hint(ws_url: str) -> None:
    held = [connect(ws_url, open_timeout=30) for _ in range(CAP)]
    try:
        for ws in held:
            assert _start(ws)["type"] == "session.started"
        with connect(ws_url, open_timeout=30) as ws:
            err = _start(ws)
            assert err["type"] == "error" and err["code"] == "session_limit" and err["retry_after_s"] > 0
            with pytest.raises(ConnectionClosed) as e:
                ws.recv(timeout=30)
            assert e.value.rcvd is not None and e.value.rcvd.code == 1013
    finally:
        for ws in held:
            ws.close()
    with connect(ws_url, open_timeout=30) as ws:  # room again once they left
        assert _start(ws)["type"] == "session.started"
