"""Bounded work per ingress: beyond its InflightLimit the frontend answers 429 with Retry-After
at once, and every admitted request gives its slot back however it ends (completion, an engine
error before or mid-stream, the client cancelling mid-stream, a stream never started)."""
from __future__ import annotations

import asyncio
import gc
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fakes import FakeTokenizer

from baton.engine.types import EngineUnavailable, GenerationDelta, GenerationRequest
from deployments.chat import PromptRenderer
from deployments.errors import APIError
from deployments.frontend import OpenAIFrontend
from deployments.inflight import InflightLimit
from deployments.metrics import RecordingMetrics
from deployments.protocol import ChatCompletionRequest
from router.chat_admission import ChatAdmissionConfig


class GatedBackend:
    """Each request yields one token, then waits for the gate; `fail` makes it raise instead."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.fail = False
        self.fail_after_first = False

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self.fail:
            raise EngineUnavailable("engine stopped")
        yield GenerationDelta(text="a", token_ids=(5,), prompt_tokens=3, cached_tokens=0)
        await self.gate.wait()
        if self.fail_after_first:
            raise EngineUnavailable("engine died mid-stream")
        yield GenerationDelta(text="", token_ids=(), prompt_tokens=3, cached_tokens=0, finished=True, finish_reason="stop")


def frontend(backend: Any, limit: InflightLimit, metrics: RecordingMetrics | None = None) -> OpenAIFrontend:
    return OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=backend, max_model_len=512,
                          default_max_tokens=8, metrics=metrics or RecordingMetrics(), admission=limit)


def chat(stream: bool = False) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi there"}], "stream": stream})


def test_beyond_the_limit_requests_get_429_with_retry_after_and_slots_come_back() -> None:
    async def go() -> None:
        backend, limit = GatedBackend(), InflightLimit(2)
        f = frontend(backend, limit)
        running = [asyncio.create_task(f.complete(f.prepare_chat(chat(), None))) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert limit.inflight == 2
        with pytest.raises(APIError) as e:
            await f.complete(f.prepare_chat(chat(), None))
        assert e.value.status == 429 and e.value.code == "overloaded" and e.value.headers["Retry-After"] == "1"
        backend.gate.set()
        replies = await asyncio.gather(*running)
        assert all(r.body is not None for r in replies) and limit.inflight == 0
        await f.complete(f.prepare_chat(chat(), None))  # admitted again
        assert limit.inflight == 0

    asyncio.run(go())


def test_failed_requests_and_streams_release_their_slot() -> None:
    async def go() -> None:
        backend, limit = GatedBackend(), InflightLimit(1)
        f = frontend(backend, limit)
        backend.fail = True
        with pytest.raises(APIError):
            await f.complete(f.prepare_chat(chat(), None))
        with pytest.raises(APIError):
            await f.open_stream(f.prepare_chat(chat(stream=True), None))
        assert limit.inflight == 0
        backend.fail = False
        backend.gate.set()
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        assert limit.inflight == 1
        events = [e async for e in reply.events]  # type: ignore[union-attr]
        assert events[-1] == "data: [DONE]\n\n" and limit.inflight == 0
        # a stream the HTTP server never starts (client gone) gives the slot back when dropped
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        assert limit.inflight == 1
        del reply
        gc.collect()
        assert limit.inflight == 0

    asyncio.run(go())


def test_a_refused_request_is_counted_as_429_and_takes_no_slot() -> None:
    async def go() -> None:
        backend, limit, metrics = GatedBackend(), InflightLimit(1), RecordingMetrics()
        f = frontend(backend, limit, metrics)
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        for _ in range(2):
            with pytest.raises(APIError) as e:
                await f.open_stream(f.prepare_chat(chat(stream=True), None))
            assert e.value.status == 429
        assert limit.inflight == 1 and metrics.requests[("chat", 429)] == 2
        backend.gate.set()
        assert [e async for e in reply.events][-1] == "data: [DONE]\n\n"  # type: ignore[union-attr]
        assert limit.inflight == 0 and metrics.requests[("chat", 200)] == 1

    asyncio.run(go())


def test_an_engine_failure_mid_stream_releases_the_slot_once() -> None:
    async def go() -> None:
        backend, limit = GatedBackend(), InflightLimit(1)
        backend.fail_after_first = True
        f = frontend(backend, limit)
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        backend.gate.set()
        events = [e async for e in reply.events]  # type: ignore[union-attr]
        assert '"engine_unavailable"' in events[-2] and events[-1] == "data: [DONE]\n\n"
        assert limit.inflight == 0
        del reply, events  # the finalizer's release after the stream's own is a no-op
        gc.collect()
        assert limit.inflight == 0

    asyncio.run(go())


def test_a_client_cancelling_mid_stream_releases_the_slot() -> None:
    async def go() -> None:
        backend, limit = GatedBackend(), InflightLimit(1)
        f = frontend(backend, limit)
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        events, got = reply.events, []
        assert events is not None

        async def consume() -> None:  # as the HTTP server does; it cancels when the client goes away
            async for e in events:
                got.append(e)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        assert got and limit.inflight == 1  # the first token went out; the engine is still generating
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert limit.inflight == 0
        backend.gate.set()
        assert (await f.complete(f.prepare_chat(chat(), None))).body is not None  # the one slot is free again
        assert limit.inflight == 0

    asyncio.run(go())


def test_the_frontend_hands_each_tickets_first_token_to_an_adaptive_limit() -> None:
    """Non-streaming and streaming requests report their TTFT when the first token arrives (not
    when they end); a failure before any token reports a miss; refusals report nothing."""
    now = [0.0]
    cfg = ChatAdmissionConfig(mode="adaptive", ttft_target_s=5.0, initial_limit=2, min_samples=10)

    async def go() -> None:
        backend, limit = GatedBackend(), InflightLimit(8, cfg, clock=lambda: now[0])
        f = frontend(backend, limit)
        running = asyncio.create_task(f.complete(f.prepare_chat(chat(), None)))
        reply = await f.open_stream(f.prepare_chat(chat(stream=True), None))
        assert reply.events is not None
        first = await reply.events.__anext__()  # the role chunk; the first token follows
        assert first.startswith("data: ") and limit.limit == 2
        await reply.events.__anext__()
        await asyncio.sleep(0.01)
        assert limit.totals["samples"] == 2 and limit.inflight == 2  # both reported, both still generating
        with pytest.raises(APIError) as e:
            await f.complete(f.prepare_chat(chat(), None))
        assert e.value.status == 429 and limit.totals == {"admitted": 2, "refused": 1, "samples": 2, "overdue": 0}
        backend.gate.set()
        await running
        assert [ev async for ev in reply.events][-1] == "data: [DONE]\n\n" and limit.inflight == 0
        backend.fail = True
        with pytest.raises(APIError):
            await f.complete(f.prepare_chat(chat(), None))
        assert limit.totals["samples"] == 3 and limit._ctl is not None and limit._ctl.window(0.0) == [0.0, 0.0, math.inf]

    asyncio.run(go())
