"""Bounded input on WebSocket /v1/realtime (deployments/realtime_api.py): frame size (1009), lone
surrogates (1007, an error frame first, never a crash), and the per-user session cap (1008).
The receive timeout is realtime.idle_timeout_s (tests/unit/test_realtime_api.py, 4408).
Same fakes as test_realtime_api.py: the real app over a fake decode handle."""
from __future__ import annotations

import pytest
from test_realtime_api import START, assert_all_released, closed_with, error_then_close, make, started

from deployments.realtime_api import parse_frame


def test_a_frame_over_max_frame_bytes_is_refused_1009_before_it_is_parsed() -> None:
    c, rt, decode, _ = make(max_frame_bytes=1024)
    with c.websocket_connect("/v1/realtime") as ws:
        ws.send_text('{"type": "session.start", "instructions": "' + "x" * 2000 + '"}')
        frame, code = error_then_close(ws)
    assert frame["code"] == "frame_too_large" and "1024" in frame["message"] and code == 1009
    assert decode.opens == [] and rt.live == 0


def test_a_frame_too_large_mid_session_ends_it_and_releases_it() -> None:
    c, rt, decode, _ = make(max_frame_bytes=1024)
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_json({"type": "input", "seq": 0, "text": "y" * 1100})
        frame, code = error_then_close(ws)
    assert frame["code"] == "frame_too_large" and code == 1009
    assert decode.ticks == []
    assert_all_released(rt, decode)


def test_frame_size_counts_bytes_not_characters() -> None:
    with pytest.raises(ValueError, match="frame_too_large|at most"):
        parse_frame({"type": "websocket.receive", "text": '"' + "é" * 600 + '"'}, max_bytes=1024)  # 1202 bytes
    assert parse_frame({"type": "websocket.receive", "text": '{"type": "' + "é" * 500 + '"}'}, max_bytes=1024)


@pytest.mark.parametrize("frame", ['{"type": "session.start", "instructions": "\\ud800"}', '{"type": "session.start", "user": "\\udfff"}'])
def test_a_lone_surrogate_in_session_start_is_an_error_frame_and_1007(frame: str) -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        ws.send_text(frame)
        err, code = error_then_close(ws)
    assert err["code"] == "invalid_frame" and "surrogate" in err["message"] and code == 1007
    assert decode.opens == [] and rt.live == 0


def test_a_lone_surrogate_in_an_input_ends_the_session_cleanly() -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        started(ws)
        ws.send_text('{"type": "input", "seq": 0, "text": "hi \\udc00"}')
        err, code = error_then_close(ws)
    assert err["code"] == "invalid_frame" and code == 1007
    assert decode.ticks == []
    assert_all_released(rt, decode)


def test_one_user_holds_at_most_max_sessions_per_user() -> None:
    c, rt, decode, _ = make(max_sessions_per_user=2)
    alice = {**START, "user": "alice"}
    with c.websocket_connect("/v1/realtime") as a1, c.websocket_connect("/v1/realtime", headers={"x-baton-user": "alice"}) as a2:
        started(a1, alice)
        started(a2, START)  # named by the header: the same user
        with c.websocket_connect("/v1/realtime") as a3:
            a3.send_json(alice)
            err, code = error_then_close(a3)
        assert err["code"] == "too_many_sessions" and "max_sessions_per_user" in err["message"] and code == 1008
        with c.websocket_connect("/v1/realtime") as b, c.websocket_connect("/v1/realtime") as anon:
            started(b, {**START, "user": "bob"})  # another user is not held back
            started(anon, START)  # a session naming no user: only the AIMD cap bounds it
            b.send_json({"type": "session.end"})
            anon.send_json({"type": "session.end"})
            assert closed_with(b) == closed_with(anon) == 1000
        a1.send_json({"type": "session.end"})
        assert closed_with(a1) == 1000
        with c.websocket_connect("/v1/realtime") as a4:  # a slot of alice's is free again
            started(a4, alice)
            a4.send_json({"type": "session.end"})
            assert closed_with(a4) == 1000
    assert len(decode.opens) == 5 and rt.live == 0 and rt._per_user == {}
    assert sorted(c.session_id for c in decode.closes) == sorted(o.session_id for o in decode.opens)  # out of order


def test_a_key_bound_to_a_user_decides_whose_session_it_is() -> None:
    c, rt, decode, _ = make(keys={"ka": "alice"}, max_sessions_per_user=1)
    auth = {"authorization": "Bearer ka"}
    with c.websocket_connect("/v1/realtime", headers=auth) as ws:
        started(ws, START)  # names nobody: the key's user holds it
        with c.websocket_connect("/v1/realtime", headers=auth) as again:
            again.send_json({**START, "user": "alice"})
            err, code = error_then_close(again)
        assert err["code"] == "too_many_sessions" and code == 1008
    with c.websocket_connect("/v1/realtime", headers=auth) as ws:
        ws.send_json({**START, "user": "bob"})
        err, code = error_then_close(ws)
    assert err["code"] == "user_mismatch" and code == 1008
    assert_all_released(rt, decode)


@pytest.mark.parametrize("user", [123, "", "u" * 257])
def test_a_malformed_user_is_invalid_value(user: object) -> None:
    c, rt, decode, _ = make()
    with c.websocket_connect("/v1/realtime") as ws:
        ws.send_json({**START, "user": user})
        err, code = error_then_close(ws)
    assert err["code"] == "invalid_value" and code == 1008
    assert decode.opens == []
