"""gRPC surface (service baton.v1.Baton, proto/baton/v1/baton.proto) over the same logic as HTTP.

The ingress deployment has one method per RPC (Serve's gRPC proxy calls the method named after
it, with Serve's gRPC context as `grpc_context`) and each hands over to a GrpcFrontend method:

    ChatCompletion        unary: ChatService.prepare + complete     -> ChatResponse
    ChatCompletionStream  server stream: prepare + open_chunks      -> ChatChunk per OpenAI chunk
    Completion            unary (/v1/completions)                   -> CompletionResponse
    CompletionStream      server stream                             -> CompletionChunk per chunk
    ListModels            unary (/v1/models)                        -> ListModelsResponse
    Realtime              bidirectional: RealtimeFrontend.serve over a FrameSocket (grpc_realtime.py)

Each call checks its `authorization` metadata with the HTTP API's keys and roles, reads
`x-session-id` / `x-baton-user` metadata as HTTP reads those headers, bounds the request by
`ingress.max_body_bytes` (its serialized size), and maps refusals to gRPC statuses
(deployments/grpc_status.py). A unary failure is its status; a stream's failure is one last
message holding the error (ChatChunk.error, or an `error` frame), then the status: Serve sends a
replica's status, trailing metadata included, along with the replica's messages.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from deployments.api_keys import Caller
from deployments.chat_service import CallContext, ChatService, Ready
from deployments.errors import APIError
from deployments.grpc_gen import baton_pb2 as pb
from deployments.grpc_mapping import (
    chat_body,
    chunk_message,
    completion_body,
    completion_chunk_message,
    completion_message,
    error_message,
    models_message,
    response_message,
)
from deployments.grpc_realtime import FrameSocket, first_frame_read, frame, run_session
from deployments.grpc_status import StatusContext, caller_of, error_status, metadata_text
from deployments.memory_api import USER_HEADER, memory_headers
from deployments.protocol import ChatCompletionRequest, CompletionRequest
from deployments.realtime_api import RealtimeFrontend
from deployments.request_body import too_large, validate_body

logger = logging.getLogger("baton.api")

SERVICE = "/baton.v1.Baton/"
SESSION_METADATA = "x-session-id"
# endpoint -> (its message as the HTTP body, the body's model): validated as over HTTP
_BODIES: dict[str, tuple[Any, Any]] = {"chat": (chat_body, ChatCompletionRequest), "completions": (completion_body, CompletionRequest)}


def _internal(e: Exception) -> APIError:
    """A bug of ours: logged with its trace, answered without one (as the HTTP app does)."""
    logger.error("unexpected error in a gRPC call", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__})", type="server_error", code="internal_error")


class GrpcFrontend:
    def __init__(self, chat: ChatService, api_keys: Mapping[str, str | None] | None = None, realtime: RealtimeFrontend | None = None):
        self._chat = chat
        self._keys = dict(api_keys or {})
        self._realtime = realtime

    def _caller(self, context: StatusContext, method: str) -> tuple[Caller, list[tuple[str, Any]]]:
        metadata = list(context.invocation_metadata() or ())
        return caller_of(metadata, self._keys, SERVICE + method), metadata

    async def _ready(self, request: Any, context: StatusContext, method: str, endpoint: str, stream: bool) -> Ready:
        caller, metadata = self._caller(context, method)
        self._chat.precheck(endpoint)  # overloaded: RESOURCE_EXHAUSTED before the request is mapped
        limit = self._chat.limits.max_body_bytes
        to_body, model = _BODIES[endpoint]

        async def read() -> Any:
            if request.ByteSize() > limit:
                raise too_large(limit)
            return validate_body(to_body(request, stream), model)

        call = CallContext(caller.user, metadata_text(metadata, USER_HEADER), metadata_text(metadata, SESSION_METADATA))
        return await self._chat.prepare(endpoint, read, call)

    async def _unary(self, request: Any, context: StatusContext, method: str, endpoint: str, empty: Any) -> Any:
        try:
            ready = await self._ready(request, context, method, endpoint, stream=False)
            reply = await self._chat.respond_chunks(ready)
            assert reply.body is not None
            _memory_trailers(ready, context)
            build = response_message if endpoint == "chat" else completion_message
            return build(reply.body, reply.replica, ready.session_id)
        except APIError as e:
            error_status(e).apply(context)
        except Exception as e:  # noqa: BLE001 - reported as INTERNAL, never with its trace
            error_status(_internal(e)).apply(context)
        return empty

    async def _stream(self, request: Any, context: StatusContext, method: str, endpoint: str) -> AsyncIterator[Any]:
        encode, message = (chunk_message, pb.ChatChunk) if endpoint == "chat" else (completion_chunk_message, pb.CompletionChunk)
        failure: APIError | None = None
        try:
            ready = await self._ready(request, context, method, endpoint, stream=True)
            reply = await self._chat.respond_chunks(ready)
        except APIError as e:
            failure = e
        except Exception as e:  # noqa: BLE001
            failure = _internal(e)
        if failure is not None:
            yield self._failed(failure, context, message)
            return
        assert reply.events is not None
        _memory_trailers(ready, context)  # a failure later in the stream replaces them with its status
        replica = reply.replica
        try:
            async for c in reply.events:
                if isinstance(c, APIError):  # failed after its first token: the stream's last chunk
                    yield self._failed(c, context, message)
                    return
                yield encode(c, replica)
                replica = None  # on the first chunk only
        finally:
            await reply.events.aclose()  # type: ignore[attr-defined]  # a cancelled RPC aborts its engine request

    async def chat_completion(self, request: pb.ChatRequest, context: StatusContext) -> pb.ChatResponse:
        return await self._unary(request, context, "ChatCompletion", "chat", pb.ChatResponse())  # type: ignore[no-any-return]

    def chat_completion_stream(self, request: pb.ChatRequest, context: StatusContext) -> AsyncIterator[pb.ChatChunk]:
        return self._stream(request, context, "ChatCompletionStream", "chat")

    async def completion(self, request: pb.CompletionRequest, context: StatusContext) -> pb.CompletionResponse:
        return await self._unary(request, context, "Completion", "completions", pb.CompletionResponse())  # type: ignore[no-any-return]

    def completion_stream(self, request: pb.CompletionRequest, context: StatusContext) -> AsyncIterator[pb.CompletionChunk]:
        return self._stream(request, context, "CompletionStream", "completions")

    async def list_models(self, request: pb.ListModelsRequest, context: StatusContext) -> pb.ListModelsResponse:
        try:
            self._caller(context, "ListModels")
        except APIError as e:
            error_status(e).apply(context)
            return pb.ListModelsResponse()
        return models_message(self._chat.frontend.models())

    @staticmethod
    def _failed(e: APIError, context: StatusContext, message: Any) -> Any:
        error_status(e).apply(context)  # before the message that carries it
        return message(error=error_message(e))

    async def realtime(self, requests: AsyncIterator[Any], context: StatusContext) -> AsyncIterator[pb.RealtimeFrame]:
        try:
            if self._realtime is None:
                raise APIError(404, "real-time sessions are off on this deployment (config `realtime`)", code="realtime_unavailable")
            caller, metadata = self._caller(context, "Realtime")
        except APIError as e:
            await first_frame_read(requests)  # so the client's first write is not racing the refusal
            error_status(e).apply(context)
            yield frame({"type": "error", "code": e.code, "message": e.message})
            return
        headers = {k: v for k, v in metadata if isinstance(v, str)}
        realtime = self._realtime
        async for f in run_session(lambda ws: realtime.serve(ws, caller.user), FrameSocket(requests, headers), context):
            yield f


def _memory_trailers(ready: Ready, context: StatusContext) -> None:
    """A reply that asked for memories names them as HTTP does (x-baton-memories, x-baton-memory-mode,
    x-baton-memories-injected), in trailing metadata, which Serve's gRPC proxy hands on with the
    status (see the module docstring)."""
    headers = memory_headers(ready.memory)
    if headers:
        context.set_trailing_metadata(list(headers.items()))
