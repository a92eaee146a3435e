"""The frames of WebSocket /v1/realtime (deployments/realtime_api.py): close codes, the frame
parser and the field checks, each failure a FrameError that names its error code and close code."""
from __future__ import annotations

import math
from typing import Any

from starlette.websockets import WebSocketDisconnect

from deployments.request_body import InvalidJSON, decode_json

CLOSE_NORMAL, CLOSE_BAD_DATA, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_INTERNAL, CLOSE_TRY_LATER = 1000, 1007, 1008, 1009, 1011, 1013
CLOSE_IDLE = 4408  # the client sent nothing for idle_timeout_s


class FrameError(ValueError):
    def __init__(self, code: str, message: str, close: int = CLOSE_POLICY):
        super().__init__(message)
        self.code, self.close = code, close


def parse_frame(msg: dict[str, Any], max_bytes: int | None = None) -> dict[str, Any]:
    """A WebSocket receive() message → a JSON object, or FrameError (1009: over max_bytes; 1007:
    not JSON text). The client hanging up is WebSocketDisconnect (receive() returns it as a
    message), not a bad frame."""
    if msg.get("type") == "websocket.disconnect":
        raise WebSocketDisconnect(msg.get("code", 1000), msg.get("reason"))
    text = msg.get("text")
    size = len(text.encode("utf-8", "surrogatepass")) if text is not None else len(msg.get("bytes") or b"")
    if max_bytes is not None and size > max_bytes:
        raise FrameError("frame_too_large", f"a frame is at most {max_bytes} bytes (this one: {size})", CLOSE_TOO_BIG)
    if text is None:
        raise FrameError("invalid_frame", "frames must be JSON text, not binary", CLOSE_BAD_DATA)
    try:
        data = decode_json(text)
    except InvalidJSON as e:
        raise FrameError("invalid_frame", f"frame is not valid JSON: {e}", CLOSE_BAD_DATA) from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise FrameError("invalid_frame", "a frame is a JSON object with a string `type`")
    return data


def int_field(data: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = data.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FrameError("invalid_value", f"`{key}` must be an integer in [{lo}, {hi}]")
    return v


def queued_s(data: dict[str, Any], read_at: float, skew_s: float, max_s: float) -> float | None:
    """Seconds between the client's `sent_at` (Unix seconds) and the server reading the frame at
    `read_at` (time.time()); None without sent_at; FrameError for a value the clocks cannot explain."""
    v = data.get("sent_at")
    if v is None:
        return None
    try:
        sent = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:
        sent = math.nan
    if not math.isfinite(sent) or not -skew_s <= read_at - sent <= max_s:
        raise FrameError("invalid_value", f"`sent_at` must be the client's send time in Unix seconds, at most {skew_s:g} s ahead of "
                         f"the server's clock and {max_s:g} s behind it")
    return max(0.0, read_at - sent)
