"""An in-process gRPC server for unit tests: grpc.aio's own server (no Ray, no Serve) whose
servicer hands every RPC to a GrpcFrontend, exactly as the ingress deployment's methods do, with
grpc.aio's servicer context in place of Serve's (both have invocation_metadata / set_code /
set_details / set_trailing_metadata). Real stubs call it over a real channel, so a test sees what
a gRPC client sees: messages, status codes, details, trailing metadata.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from deployments.grpc_api import GrpcFrontend
from deployments.grpc_gen import baton_pb2_grpc


class _Servicer(baton_pb2_grpc.BatonServicer):
    def __init__(self, frontend: GrpcFrontend):
        self._f = frontend

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        return await self._f.chat_completion(request, context)

    async def ChatCompletionStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for c in self._f.chat_completion_stream(request, context):
            yield c

    async def Completion(self, request: Any, context: Any) -> Any:
        return await self._f.completion(request, context)

    async def CompletionStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for c in self._f.completion_stream(request, context):
            yield c

    async def ListModels(self, request: Any, context: Any) -> Any:
        return await self._f.list_models(request, context)

    async def Realtime(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for f in self._f.realtime(request_iterator, context):
            yield f


@contextlib.asynccontextmanager
async def grpc_server(frontend: GrpcFrontend) -> AsyncIterator[str]:
    """Serve `frontend` on a free loopback port; yields host:port."""
    server = grpc.aio.server()
    baton_pb2_grpc.add_BatonServicer_to_server(_Servicer(frontend), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


@contextlib.asynccontextmanager
async def stub_for(frontend: GrpcFrontend) -> AsyncIterator[baton_pb2_grpc.BatonStub]:
    async with grpc_server(frontend) as target, grpc.aio.insecure_channel(target) as channel:
        yield baton_pb2_grpc.BatonStub(channel)
