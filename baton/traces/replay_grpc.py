"""`baton replay --protocol grpc`: each turn as one ChatCompletionStream call on Baton's gRPC API.

The body is the HTTP replayer's (request_body), mapped by the server's own mapping
(deployments/grpc_mapping.py); every ChatChunk is fed to the same StreamAccumulator as an SSE
event, so a turn records the same TTFT, tokens and errors as over HTTP. A failed call records the
HTTP status its gRPC code stands for (INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429 — 413 when
the server says request_too_large —, UNAVAILABLE 503, ...) and "gRPC CODE: details".
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from baton.traces.sse import SseEvent, StreamAccumulator
from deployments.grpc_gen import baton_pb2_grpc
from deployments.grpc_mapping import chat_request, chunk_event
from deployments.grpc_status import ERROR_KEY, metadata_text

_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 422,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(code: grpc.StatusCode, trailing: Any = None) -> int | None:
    """The HTTP status a gRPC status stands for (the inverse of deployments/grpc_status.py)."""
    if code == grpc.StatusCode.OK:
        return 200
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raw = metadata_text(list(trailing or ()), ERROR_KEY)
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            if raw and json.loads(raw).get("code") == "request_too_large":
                return 413
    return _HTTP_OF.get(code)


def grpc_target(url: str) -> str:
    """host:port from `url` (grpc://host:port or host:port)."""
    for prefix in ("grpc://", "http://"):
        if url.startswith(prefix):
            return url[len(prefix):]
    return url


@dataclass(frozen=True)
class GrpcStreamer:
    stub: Any  # baton_pb2_grpc.BatonStub over a grpc.aio channel

    async def __call__(self, target: Any, body: dict[str, Any], session_id: str, acc: StreamAccumulator) -> None:
        metadata = [(k.lower(), v) for k, v in target.headers.items()] + [("x-session-id", session_id)]
        call = self.stub.ChatCompletionStream(chat_request(body), metadata=metadata, timeout=target.timeout_s)
        try:
            async for chunk in call:  # a failure: its error chunk, then AioRpcError with the status
                acc.status = 200
                acc.feed(SseEvent(data=chunk_event(chunk)), time.perf_counter())
        except grpc.aio.AioRpcError as e:
            acc.status = http_status(e.code(), e.trailing_metadata())
            acc.error = acc.error or f"gRPC {e.code().name}: {e.details()}"
            return
        except BaseException:  # a timeout or a cancelled replay: end the call too
            call.cancel()
            raise
        acc.done = True


@contextlib.asynccontextmanager
async def grpc_streamer(url: str) -> AsyncIterator[GrpcStreamer]:
    async with grpc.aio.insecure_channel(grpc_target(url)) as channel:
        yield GrpcStreamer(baton_pb2_grpc.BatonStub(channel))
