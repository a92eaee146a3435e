"""The gRPC `Realtime` stream as the socket RealtimeFrontend.serve talks to, so real-time
sessions have one implementation and one protocol (deployments/realtime_api.py) on both
transports: each RealtimeFrame carries one JSON frame of the WebSocket protocol, and the
WebSocket close becomes the RPC's status.

    close                                    gRPC status
    1000 (session.end, client half-close)    OK
    1007 bad data, 1008 bad fields           INVALID_ARGUMENT (frame code too_many_sessions:
                                             RESOURCE_EXHAUSTED; user_mismatch: PERMISSION_DENIED)
    1009 frame too large                     RESOURCE_EXHAUSTED (as 413)
    1011 engine failed                       UNAVAILABLE
    1013 session cap (AIMD), or shed         RESOURCE_EXHAUSTED + retry-after / RetryInfo from retry_after_s
         (shed_overload, overload: shed)     (baton-error names the frame's code: session_limit / shed_overload)
    4408 idle timeout                        DEADLINE_EXCEEDED

A shed session (deployments/realtime_sessions.py) ends through the same path: its tick loop sends
the `shed_overload` error frame and closes 1013, so nothing here is specific to shedding.

A failing session's `error` frame is its last message, sent after the status is set (Serve carries
a replica's status on its messages). RealtimeFrontend sends that frame and closes without
suspending in between (this socket's send_json and close never suspend), so when the stream takes
an error frame off the outbox, the close that follows it is already there.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from deployments.grpc_gen import baton_pb2 as pb
from deployments.grpc_status import DETAILS_KEY, ERROR_KEY, RETRY_AFTER, GrpcStatus, StatusContext, retry_details
from deployments.realtime_frames import CLOSE_BAD_DATA, CLOSE_IDLE, CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_TRY_LATER

logger = logging.getLogger("baton.realtime")

_BY_CLOSE = {
    CLOSE_BAD_DATA: grpc.StatusCode.INVALID_ARGUMENT,
    CLOSE_POLICY: grpc.StatusCode.INVALID_ARGUMENT,
    CLOSE_TOO_BIG: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CLOSE_INTERNAL: grpc.StatusCode.UNAVAILABLE,
    CLOSE_TRY_LATER: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CLOSE_IDLE: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_BY_FRAME_CODE = {"too_many_sessions": grpc.StatusCode.RESOURCE_EXHAUSTED, "user_mismatch": grpc.StatusCode.PERMISSION_DENIED,
                  "invalid_api_key": grpc.StatusCode.UNAUTHENTICATED}
FIRST_FRAME_WAIT_S = 2.0  # how long a refused call waits for the client's first frame (first_frame_read)


@dataclass(frozen=True)
class Close:
    code: int
    reason: str = ""


def close_status(close: Close, frame: dict[str, Any] | None) -> GrpcStatus:
    """The status of a session that ended with `close`, after its last `error` frame (None: none)."""
    if close.code == CLOSE_NORMAL:
        return GrpcStatus(grpc.StatusCode.OK, "")
    frame = frame or {}
    code = _BY_FRAME_CODE.get(str(frame.get("code")), _BY_CLOSE.get(close.code, grpc.StatusCode.INTERNAL))
    message = str(frame.get("message") or close.reason or f"session closed ({close.code})")
    trailing: list[tuple[str, str | bytes]] = [(ERROR_KEY, json.dumps({"code": frame.get("code"), "message": message, "close": close.code}))]
    retry = frame.get("retry_after_s")
    if isinstance(retry, (int, float)) and not isinstance(retry, bool):
        seconds = max(1, round(retry))
        trailing += [(RETRY_AFTER, str(seconds)), (DETAILS_KEY, retry_details(code, message, seconds))]
    return GrpcStatus(code, message, tuple(trailing))


class FrameSocket:
    """The WebSocket face RealtimeFrontend.serve uses (accept, receive, send_json, close, headers)
    over a gRPC request stream and an outbox the RPC's response stream drains."""

    def __init__(self, requests: AsyncIterator[Any], headers: Mapping[str, str]):
        self.headers = headers
        self._requests = requests
        self.outbox: asyncio.Queue[dict[str, Any] | Close] = asyncio.Queue()

    async def accept(self) -> None:
        return None

    async def receive(self) -> dict[str, Any]:
        """The next client frame as an ASGI WebSocket message; the client ending its stream is a
        disconnect (its session ends as on a closed WebSocket)."""
        try:
            frame = await self._requests.__anext__()
        except StopAsyncIteration:
            return {"type": "websocket.disconnect", "code": CLOSE_NORMAL}
        return {"type": "websocket.receive", "text": frame.json}

    async def send_json(self, data: Any) -> None:
        self.outbox.put_nowait(data)

    async def close(self, code: int = CLOSE_NORMAL, reason: str | None = None) -> None:
        self.outbox.put_nowait(Close(code, reason or ""))


async def first_frame_read(requests: AsyncIterator[Any]) -> None:
    """Read (and drop) the client's first frame, waiting at most FIRST_FRAME_WAIT_S, before a call is refused.
    A client opens the stream and writes its session.start at once; a call that ends while that
    write is in flight fails the write, and grpc's client then reports INTERNAL instead of the
    refusal's status. Reading it first makes the refusal what the client sees; a client that
    writes nothing is refused after the wait."""
    with contextlib.suppress(StopAsyncIteration, TimeoutError, grpc.RpcError):
        await asyncio.wait_for(requests.__anext__(), FIRST_FRAME_WAIT_S)


def frame(data: dict[str, Any]) -> pb.RealtimeFrame:
    return pb.RealtimeFrame(json=json.dumps(data, separators=(",", ":")))


async def run_session(serve: Callable[[FrameSocket], Awaitable[None]], socket: FrameSocket,
                      context: StatusContext) -> AsyncIterator[pb.RealtimeFrame]:
    """Run `serve(socket)` (the session) and stream its frames; the close sets the status. A
    client that goes away (the RPC cancelled) ends the session as a WebSocket disconnect does."""
    task = asyncio.ensure_future(serve(socket))
    task.add_done_callback(lambda t: socket.outbox.put_nowait(_ending(t)))
    try:
        while True:
            item = await socket.outbox.get()
            if isinstance(item, Close):
                if item.code != CLOSE_NORMAL:  # a close without an error frame before it: say why in one
                    close_status(item, None).apply(context)
                    yield frame({"type": "error", "code": "closed", "message": item.reason or f"session closed ({item.code})"})
                return
            closing = _queued_close(socket.outbox)
            if closing is not None:
                status = close_status(closing, item if item.get("type") == "error" else None)
                if status.code != grpc.StatusCode.OK:
                    status.apply(context)
                yield frame(item)
                return
            yield frame(item)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _ending(task: asyncio.Future[None]) -> Close:
    """How a session that returned ends: normally, or (a bug of ours) 1011 without the trace."""
    if task.cancelled() or task.exception() is None:
        return Close(CLOSE_NORMAL)
    exc = task.exception()
    logger.error("real-time session failed", exc_info=exc)
    return Close(CLOSE_INTERNAL, f"internal error ({type(exc).__name__})")


def _queued_close(outbox: asyncio.Queue[dict[str, Any] | Close]) -> Close | None:
    """The close waiting right behind the frame just taken, taken too (None: none is there)."""
    if outbox.empty():
        return None
    nxt = outbox.get_nowait()
    if isinstance(nxt, Close):
        return nxt
    # not a close: put it back in front (asyncio.Queue has no peek)
    rest = [nxt]
    while not outbox.empty():
        rest.append(outbox.get_nowait())
    for x in rest:
        outbox.put_nowait(x)
    return None
