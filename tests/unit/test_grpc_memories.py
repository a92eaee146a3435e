"""Which memories a gRPC reply recalled: the HTTP headers x-baton-memories / x-baton-memory-mode,
as trailing metadata, on unary and streamed chat (a real in-process gRPC server, fake backend)."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from deployments.chat import PromptRenderer
from deployments.chat_service import ChatService
from deployments.frontend import OpenAIFrontend
from deployments.grpc_api import GrpcFrontend
from deployments.grpc_gen import baton_pb2 as pb
from deployments.memory_api import MemoryFrontend
from deployments.metrics import RecordingMetrics
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.store import MemoryService
from tests.unit.fakes import FakeBackend, FakeMemoryStoreHandle, FakeTokenizer
from tests.unit.grpc_fixtures import stub_for

FACTS = ["Alice adopted a dog named Rex", "Alice moved to Lyon", "Alice plays the violin"]


def _frontend(tmp_path: Path) -> tuple[GrpcFrontend, MemoryService, FakeBackend]:
    renderer = PromptRenderer(FakeTokenizer())
    backend = FakeBackend()
    config = MemoryConfig(embedder="hashing", mode="kv", context_window=1)
    service = MemoryService(config, FactStore(tmp_path / "m.sqlite3"), HashingEmbedder())
    frontend = OpenAIFrontend(model_id="m", renderer=renderer, backend=backend, max_model_len=1024, default_max_tokens=4,
                              metrics=RecordingMetrics())
    memory = MemoryFrontend(config, FakeMemoryStoreHandle(service), renderer, "m")
    return GrpcFrontend(ChatService(frontend, memory)), service, backend


def _req(memories: pb.Memories | None) -> pb.ChatRequest:
    req = pb.ChatRequest(max_tokens=2, user="alice")
    req.messages.add(role="user", content="tell me about my dog Rex")
    if memories is not None:
        req.memories.CopyFrom(memories)
    return req


async def _trailers(frontend: GrpcFrontend, req: pb.ChatRequest, stream: bool) -> dict[str, Any]:
    async with stub_for(frontend) as stub:
        call = stub.ChatCompletionStream(req) if stream else stub.ChatCompletion(req)
        if stream:
            async for _ in call:
                pass
        else:
            await call
        assert await call.code() == grpc.StatusCode.OK
        return dict(await call.trailing_metadata() or ())


def test_unary_and_streamed_replies_name_the_recalled_facts(tmp_path: Path) -> None:
    frontend, service, backend = _frontend(tmp_path)
    ids = [f.id for f in service.add("alice", FACTS)]
    for stream in (False, True):
        md = asyncio.run(_trailers(frontend, _req(pb.Memories(k=2)), stream))
        injected = [f.fact_id for f in backend.last.memory.facts]
        assert md["x-baton-memories"].split(",") == injected and set(injected) <= set(ids) and len(injected) == 2
        assert md["x-baton-memory-mode"] == "kv" and md["x-baton-memories-injected"] == "2"


def test_a_reply_without_memories_has_no_memory_trailers(tmp_path: Path) -> None:
    frontend, service, _ = _frontend(tmp_path)
    service.add("alice", FACTS)
    for stream in (False, True):
        md = asyncio.run(_trailers(frontend, _req(None), stream))
        assert "x-baton-memories" not in md and "x-baton-memory-mode" not in md
