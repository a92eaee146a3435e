"""A native BFCL trace replayed against Baton's own OpenAI app (in process, httpx ASGITransport):
real BFCL tools through the server's tool checks, the shipped tools chat template and vLLM's
hermes parser; a scripted backend plays a model that always calls get_current_time. No engine."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fakes import FakeBackend
from test_tools import hermes, pieces, tok  # noqa: F401 - fixtures

from baton.traces.replay import replay
from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app

pytest.importorskip("bfcl_eval", reason="bfcl_eval (pip install --no-deps bfcl-eval) is not installed")

CALL = '<tool_call>\n{"name": "get_current_time", "arguments": {}}\n</tool_call>'


def test_native_trace_against_the_openai_app(tok: Any, hermes: Any) -> None:  # noqa: F811
    from baton.traces.bfcl import BfclOptions, build_bfcl_trace

    conv = build_bfcl_trace(BfclOptions(ids=("multi_turn_base_100",), max_user_turns=1, mode="native"))[0]
    backend = FakeBackend(tokens=pieces(tok, CALL))
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(tok), backend=backend, max_model_len=8192,
                              default_max_tokens=64, metrics=RecordingMetrics(), tools=hermes)

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    transport = httpx.ASGITransport(app=build_openai_app(frontend, health))
    result = asyncio.run(replay([conv], "http://app", 1, progress=False, transport=transport, max_tool_rounds=1))
    assert all(r.ok and r.status == 200 for r in result.turns), [r.error for r in result.turns]
    assert [(r.tool_round, r.tool_calls, r.tool_calls_parseable, r.tool_calls_ok) for r in result.turns] == [
        (0, 1, 1, 1), (1, 1, 1, 1)]
    # the second prompt holds the first call and its result, rendered by the template
    second = tok.decode(backend.requests[1].prompt_token_ids)
    assert "get_current_time" in second and "current_time" in second.split("<tool_response>")[1]
