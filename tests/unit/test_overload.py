"""Bounded work per ingress: beyond max_inflight generation requests the frontend answers 429
with Retry-After at once, and every admitted request gives its slot back however it ends."""
from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deployments.chat import PromptRenderer
from deployments.errors import APIError
from deployments.frontend import OpenAIFrontend
from deployments.metrics import RecordingMetrics
from deployments.protocol import ChatCompletionRequest
from baton.engine.types import EngineUnavailable, GenerationDelta, GenerationRequest
from fakes import FakeTokenizer


class GatedBackend:
    """Each request yields one token, then waits for the gate; `fail` makes it raise instead."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.fail = False

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self.fail:
            raise EngineUnavailable("engine stopped")
        yield GenerationDelta(text="a", token_ids=(5,), prompt_tokens=3, cached_tokens=0)
        await self.gate.wait()
        yield GenerationDelta(text="", token_ids=(), prompt_tokens=3, cached_tokens=0, finished=True, finish_reason="stop")


def frontend(backend: Any, limit: int) -> OpenAIFrontend:
    return OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=backend, max_model_len=512,
                          default_max_tokens=8, metrics=RecordingMetrics(), max_inflight=limit)


def chat(stream: bool = False) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi there"}], "stream": stream})


def test_beyond_the_limit_requests_get_429_with_retry_after_and_slots_come_back() -> None:
    async def go() -> None:
        backend = GatedBackend()
        f = frontend(backend, 2)
        running = [asyncio.create_task(f.complete(f.prepare_chat(chat(), None))) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert f.inflight == 2
        with pytest.raises(APIError) as e:
            await f.complete(f.prepare_chat(chat(), None))
        assert e.value.status == 429 and e.value.code == "overloaded" and e.value.headers["Retry-After"] == "1"
        backend.gate.set()
        replies = await asyncio.gather(*running)
        assert all(r.body is not None for r in replies) and f.inflight == 0
        await f.complete(f.prepare_chat(chat(), None))  # admitted again
        assert f.inflight == 0

    asyncio.run(go())


def test_failed_requests_and_streams_release_their_slot() -> None:
    async def go() -> None:
        backend = GatedBackend()
        f = frontend(backend, 1)
        backend.fail = True
        with pytest.raises(APIError):
            await f.complete(f.prepare_chat(chat(), None))
        with pytest.raises(APIError):
            await f.open_stream(f.prepare_chat(chat(stream=True), None))
        assert f.inflight == 0
        backend.fail = False
        backend.gate.set()
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        assert f.inflight == 1
        events = [e async for e in reply.events]  # type: ignore[union-attr]
        assert events[-1] == "data: [DONE]\n\n" and f.inflight == 0
        # a stream the HTTP server never starts (client gone) gives the slot back when dropped
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        assert f.inflight == 1
        del reply
        gc.collect()
        assert f.inflight == 0

    asyncio.run(go())
