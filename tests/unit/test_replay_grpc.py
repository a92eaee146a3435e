"""`baton replay --protocol grpc` (baton/traces/replay_grpc.py) against the real gRPC servicer on
an in-process server (tests/unit/grpc_fixtures.py) over a scripted backend: the same per-turn
records as over HTTP — TTFT, tokens, status, errors."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc

from baton.traces.format import Conversation, Turn
from baton.traces.replay import replay
from baton.traces.replay_grpc import grpc_target, http_status
from deployments.chat import PromptRenderer
from deployments.chat_service import ChatService
from deployments.frontend import OpenAIFrontend
from deployments.grpc_api import GrpcFrontend
from deployments.inflight import InflightLimit
from deployments.metrics import RecordingMetrics
from tests.unit.fakes import FakeBackend, FakeTokenizer
from tests.unit.grpc_fixtures import grpc_server


def frontend(backend: FakeBackend, admission: InflightLimit | None = None, keys: dict[str, str | None] | None = None) -> GrpcFrontend:
    f = OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=backend, max_model_len=256,
                       default_max_tokens=16, metrics=RecordingMetrics(), admission=admission)
    return GrpcFrontend(ChatService(f), keys)


def conv(cid: str, user: str = "ana") -> Conversation:
    return Conversation(conversation_id=cid, user=user, system="SYS", source="test", turns=[
        Turn(role="user", content="do it", effective=False, max_tokens=8),
        Turn(role="user", content="again please", effective=True),
    ])


def run(g: GrpcFrontend, convs: list[Conversation], **kw: Any) -> Any:
    async def main() -> Any:
        async with grpc_server(g) as target:
            return await replay(convs, f"grpc://{target}", 2, progress=False, protocol="grpc", **kw)

    return asyncio.run(main())


def test_turns_record_ttft_tokens_and_history() -> None:
    backend = FakeBackend()
    result = run(frontend(backend), [conv("c1"), conv("c2", user="bob")])
    assert result.model == "" and len(result.turns) == 4
    for t in result.turns:
        assert t.ok and t.status == 200 and t.error is None
        assert t.ttft_s is not None and 0 <= t.ttft_s <= t.e2e_s
        assert t.completion_tokens == 3 and t.prompt_tokens and t.cached_tokens == 0 and t.reply_chars == len(" Hello world!")
    first, second = [r for r in backend.requests if r.session_id == "c1"]
    assert first.user == "ana" and first.sampling.max_tokens == 8 and first.sampling.temperature == 0
    assert len(second.prompt_token_ids) > len(first.prompt_token_ids)  # the reply is in the history
    assert {c.conversation_id: c.ttfet_s is not None for c in result.conversations} == {"c1": True, "c2": True}


def test_refusals_and_failures_are_recorded_and_end_the_conversation() -> None:
    limit = InflightLimit(1)
    held = limit.acquire()
    result = run(frontend(FakeBackend(), admission=limit), [conv("c1")])
    held.release(200)
    (t,) = result.turns
    assert t.status == 429 and "rate_limit_error" in (t.error or "") and t.ttft_s is None
    assert result.conversations[0].turns_sent == 1 and result.conversations[0].error == t.error

    result = run(frontend(FakeBackend(error=RuntimeError("boom"), error_after=1)), [conv("c2")])
    (t,) = result.turns
    assert t.status == 500 and t.ttft_s is not None and "server_error" in (t.error or "")

    result = run(frontend(FakeBackend(), keys={"k": None}), [conv("c3")], api_key="wrong")
    assert result.turns[0].status == 401
    assert run(frontend(FakeBackend(), keys={"k": None}), [conv("c4")], api_key="k").turns[0].ok


def test_status_and_target_helpers() -> None:
    assert http_status(grpc.StatusCode.OK) == 200 and http_status(grpc.StatusCode.UNAVAILABLE) == 503
    assert http_status(grpc.StatusCode.RESOURCE_EXHAUSTED, [("baton-error", '{"code": "request_too_large"}')]) == 413
    assert http_status(grpc.StatusCode.RESOURCE_EXHAUSTED, [("baton-error", '{"code": "overloaded"}')]) == 429
    assert grpc_target("grpc://127.0.0.1:9000") == grpc_target("127.0.0.1:9000") == "127.0.0.1:9000"
