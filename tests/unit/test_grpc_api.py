"""The gRPC API (deployments/grpc_*.py): proto <-> OpenAI mapping, APIError -> gRPC status for
every status the API raises, API keys from metadata, and the servicer on a real in-process gRPC
server (tests/unit/grpc_fixtures.py) over the same OpenAIFrontend/ChatService as HTTP, with a fake
tokenizer and a scripted backend: no Ray, no engine."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from baton.engine.types import EngineUnavailable
from deployments.api_keys import access_refusal, authenticate
from deployments.chat import PromptRenderer
from deployments.chat_service import ChatService
from deployments.errors import APIError, bad_request, conversation_not_found, overloaded, unavailable
from deployments.frontend import OpenAIFrontend
from deployments.grpc_api import GrpcFrontend
from deployments.grpc_gen import baton_pb2 as pb
from deployments.grpc_mapping import chat_body, chat_request, chunk_event, chunk_message, completion_body, completion_request, response_message
from deployments.grpc_status import _BY_STATUS, caller_of, error_status, retry_info_seconds, status_code
from deployments.inflight import InflightLimit
from deployments.input_limits import InputLimits
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from deployments.protocol import ChatCompletionRequest, CompletionRequest
from deployments.request_body import too_large, validate_body
from tests.unit.fakes import FakeBackend, FakeTokenizer
from tests.unit.grpc_fixtures import stub_for

HELLO = [{"role": "user", "content": "hello there"}]
KEYS = {"opkey": None, "anakey": "ana"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def make(backend: FakeBackend | None = None, *, keys: dict[str, str | None] | None = None, admission: InflightLimit | None = None,
         limits: InputLimits | None = None) -> tuple[GrpcFrontend, ChatService, FakeBackend, RecordingMetrics]:
    backend = backend or FakeBackend()
    metrics = RecordingMetrics()
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=backend, max_model_len=64,
                              default_max_tokens=16, metrics=metrics, admission=admission)
    chat = ChatService(frontend, None, limits)
    return GrpcFrontend(chat, keys), chat, backend, metrics


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def md(key: str | None = None, **extra: str) -> list[tuple[str, str]]:
    out = [("authorization", f"Bearer {key}")] if key else []
    return out + [(k.replace("_", "-"), v) for k, v in extra.items()]


async def unary(frontend: GrpcFrontend, req: pb.ChatRequest, metadata: list[tuple[str, str]] | None = None) -> Any:
    async with stub_for(frontend) as stub:
        return await stub.ChatCompletion(req, metadata=metadata or ())


async def streamed(frontend: GrpcFrontend, req: pb.ChatRequest, metadata: list[tuple[str, str]] | None = None
                   ) -> tuple[list[pb.ChatChunk], grpc.aio.AioRpcError | None]:
    chunks: list[pb.ChatChunk] = []
    async with stub_for(frontend) as stub:
        try:
            async for c in stub.ChatCompletionStream(req, metadata=metadata or ()):
                chunks.append(c)
        except grpc.aio.AioRpcError as e:
            return chunks, e
    return chunks, None


def rpc_error(coro: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(coro)
    return e.value


def trailing(e: grpc.aio.AioRpcError) -> dict[str, Any]:
    return dict(e.trailing_metadata() or ())


# ---- mapping ------------------------------------------------------------------------------------


FULL_BODY: dict[str, Any] = {
    "model": "m", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": -3, "stop": ["END", "STOP"],
    "presence_penalty": 0.25, "frequency_penalty": -0.5, "user": "ana", "session_id": "conv-1", "ignore_eos": True,
    "memories": {"k": 3, "mode": "prompt", "window": 0}, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?", "name": "ana"},
                 {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                 {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}],
}


def test_every_field_survives_the_proto_and_validates_as_over_http() -> None:
    body = chat_body(chat_request(FULL_BODY), stream=True)
    assert body == {**FULL_BODY, "stream": True}
    assert validate_body(body, ChatCompletionRequest) == ChatCompletionRequest.model_validate({**FULL_BODY, "stream": True})


def test_unset_fields_stay_absent_so_server_defaults_apply() -> None:
    req = pb.ChatRequest(messages=[pb.Message(role="user", content="hi")])
    assert chat_body(req, stream=False) == {"messages": [{"role": "user", "content": "hi"}], "stream": False}
    # include_usage only means something on the stream; ids-only memories; zero values are values
    req = pb.ChatRequest(messages=[pb.Message(role="user", content="hi")], include_usage=True, temperature=0.0, memories=pb.Memories(ids=["a" * 32]))
    assert chat_body(req, stream=False) == {"messages": [{"role": "user", "content": "hi"}], "stream": False, "temperature": 0.0,
                                            "memories": {"ids": ["a" * 32]}}


@pytest.mark.parametrize("field", ["tools_json", "tool_choice_json"])
def test_bad_json_fields_are_invalid_json(field: str) -> None:
    with pytest.raises(APIError) as e:
        chat_body(pb.ChatRequest(messages=[pb.Message(role="user", content="hi")], **{field: "{nope"}), stream=False)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_json", field)
    with pytest.raises(APIError) as e:  # a lone surrogate, refused as over HTTP
        chat_body(pb.ChatRequest(messages=[pb.Message(role="user", content="hi")], **{field: '"\\ud800"'}), stream=False)
    assert e.value.code == "invalid_json"


def test_replies_and_chunks_map_both_ways() -> None:
    body = {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}}
    r = response_message(body, "replica-a", "conv-1")
    assert not r.HasField("content") and r.finish_reason == "tool_calls" and r.replica == "replica-a" and r.session_id == "conv-1"
    assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [("call_1", "f", "{}")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens, r.usage.cached_tokens) == (5, 2, 7, 4)
    chunks = [
        {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": " Hello"}, "finish_reason": None}]},
        {"id": "c", "model": "m", "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}]}}]},
        {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"id": "c", "model": "m", "choices": [], "usage": body["usage"]},
    ]
    for c in chunks:
        back = chunk_event(chunk_message(c))
        assert back["choices"] == [{**ch, "logprobs": None} if "logprobs" in ch else ch for ch in c["choices"]]
        assert back.get("usage") == c.get("usage")
    assert chunk_message(chunks[0], "replica-a").replica == "replica-a"


# ---- statuses -----------------------------------------------------------------------------------


ERRORS = [
    (bad_request("bad", param="temperature", code="invalid_value"), grpc.StatusCode.INVALID_ARGUMENT, None),
    (access_refusal("/baton.v1.Baton/ChatCompletion", authenticate(None, KEYS)), grpc.StatusCode.UNAUTHENTICATED, None),
    (APIError(403, "the API key belongs to another user", param="user", code="user_mismatch"), grpc.StatusCode.PERMISSION_DENIED, None),
    (conversation_not_found(), grpc.StatusCode.NOT_FOUND, None),
    (too_large(1024), grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    (APIError(422, "reused", code="idempotency_key_reused"), grpc.StatusCode.FAILED_PRECONDITION, None),
    (overloaded("busy", retry_after_s=7), grpc.StatusCode.RESOURCE_EXHAUSTED, 7),
    (APIError(499, "gone"), grpc.StatusCode.CANCELLED, None),
    (APIError(500, "internal error (KeyError)", type="server_error", code="internal_error"), grpc.StatusCode.INTERNAL, None),
    (unavailable("engine down", retry_after_s=2), grpc.StatusCode.UNAVAILABLE, 2),
]


@pytest.mark.parametrize("error,code,retry", ERRORS, ids=lambda v: str(getattr(v, "status", v)))
def test_error_status(error: APIError | None, code: grpc.StatusCode, retry: int | None) -> None:
    assert error is not None
    s = error_status(error)
    assert s.code == code and s.details == error.message
    meta = dict(s.trailing)
    assert json.loads(meta["baton-error"]) == error.body()["error"]
    assert meta.get("retry-after") == (str(retry) if retry is not None else None)
    assert retry_info_seconds(list(s.trailing)) == retry


def test_every_status_the_api_raises_has_its_own_grpc_code() -> None:
    root = Path(__file__).resolve().parents[2]
    raised = {int(m) for f in (root / "deployments").glob("*.py") for m in re.findall(r"APIError\(\s*(\d{3})", f.read_text())}
    assert raised and raised <= set(_BY_STATUS), sorted(raised - set(_BY_STATUS))
    assert {e.status for e, _, _ in ERRORS} >= raised  # and each is tested above
    assert status_code(418) == grpc.StatusCode.INVALID_ARGUMENT and status_code(502) == grpc.StatusCode.INTERNAL


# ---- auth ---------------------------------------------------------------------------------------


def test_keys_from_metadata() -> None:
    method = "/baton.v1.Baton/ChatCompletion"
    assert caller_of(md("opkey"), KEYS, method).operator
    assert caller_of([("authorization", "bearer anakey")], KEYS, method).user == "ana"
    for bad in ([], md("nope"), [("authorization", "anakey")], [("authorization", b"Bearer opkey")]):
        with pytest.raises(APIError) as e:
            caller_of(bad, KEYS, method)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
    assert caller_of([], {}, method) == (False, None)  # keys off: anyone, as over HTTP


# ---- the servicer on a real gRPC server -----------------------------------------------------------


def req(**fields: Any) -> pb.ChatRequest:
    return chat_request({"messages": HELLO, **fields})


def test_unary_chat_is_the_http_reply() -> None:
    g, chat, backend, metrics = make()
    r = run(unary(g, req(temperature=0, max_tokens=5), md(x_session_id="conv-1")))
    assert (r.content, r.finish_reason, r.replica, r.session_id, r.model) == (" Hello world!", "stop", "replica-a", "conv-1", "m")
    assert backend.last.session_id == "conv-1" and backend.last.sampling.max_tokens == 5 and backend.last.sampling.temperature == 0
    http = TestClient(build_openai_app(chat.frontend, _health, chat=chat)).post(
        "/v1/chat/completions", json={"messages": HELLO, "temperature": 0, "max_tokens": 5}, headers={"x-session-id": "conv-1"}).json()
    assert http["choices"][0]["message"]["content"] == r.content
    assert http["usage"]["prompt_tokens"] == r.usage.prompt_tokens and http["usage"]["completion_tokens"] == r.usage.completion_tokens == 3
    assert backend.requests[0].prompt_token_ids == backend.requests[1].prompt_token_ids
    assert metrics.requests[("chat", 200)] == 2


async def _health() -> dict[str, Any]:
    return {"status": "ok"}


def test_stream_chunks_first_role_then_tokens_then_usage() -> None:
    g, _, _, metrics = make()
    chunks, err = run(streamed(g, req(stream_options={"include_usage": True})))
    assert err is None
    assert chunks[0].role == "assistant" and chunks[0].replica == "replica-a" and all(not c.replica for c in chunks[1:])
    assert "".join(c.content for c in chunks) == " Hello world!"
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    assert chunks[-1].HasField("usage") and chunks[-1].usage.completion_tokens == 3
    assert metrics.requests[("chat", 200)] == 1


def test_continuous_usage_puts_the_usage_so_far_on_every_chunk_with_output() -> None:
    g, _, _, _ = make()
    chunks, err = run(streamed(g, req(stream_options={"include_usage": True, "continuous_usage_stats": True})))
    assert err is None
    out = [c for c in chunks if c.content]
    assert out and all(c.HasField("usage") for c in out)
    counts = [c.usage.completion_tokens for c in out]
    assert counts == sorted(counts) and counts[-1] == 3, counts  # the tokens streamed so far, up to the whole reply
    assert chunks[-1].HasField("usage") and chunks[-1].usage.completion_tokens == 3
    plain, _ = run(streamed(g, req(stream_options={"include_usage": True})))
    assert [c.HasField("usage") for c in plain] == [False] * (len(plain) - 1) + [True]


def test_bad_key_is_unauthenticated_on_both_chat_rpcs() -> None:
    g, _, backend, _ = make(keys=KEYS)
    e = rpc_error(unary(g, req(), md("nope")))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.details()
    chunks, e = run(streamed(g, req()))
    assert e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED and chunks[-1].error.code == "invalid_api_key"
    assert not backend.requests
    assert run(unary(g, req(), md("opkey"))).content == " Hello world!"


def test_a_user_key_speaks_for_its_user_only() -> None:
    g, _, backend, _ = make(keys=KEYS)
    run(unary(g, req(), md("anakey")))
    assert backend.last.user == "ana"
    e = rpc_error(unary(g, req(user="bob"), md("anakey")))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and json.loads(trailing(e)["baton-error"])["code"] == "user_mismatch"
    e = rpc_error(unary(g, req(), md("anakey", x_baton_user="bob")))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED


def test_overload_is_resource_exhausted_with_retry_after() -> None:
    limit = InflightLimit(1)
    held = limit.acquire()
    g, _, backend, metrics = make(admission=limit)
    e = rpc_error(unary(g, req()))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = trailing(e)["retry-after"]
    assert int(retry) >= 1 and retry_info_seconds(e.trailing_metadata()) == int(retry)
    chunks, e = run(streamed(g, req()))
    assert e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and trailing(e)["retry-after"] == retry
    assert chunks[-1].error.code == "overloaded" and not backend.requests and metrics.requests[("chat", 429)] == 2
    held.release(200)
    assert run(unary(g, req())).content == " Hello world!"


@pytest.mark.parametrize("fields,code,param", [
    ({"temperature": 5.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ({"model": "other"}, grpc.StatusCode.NOT_FOUND, "model"),
    ({"max_tokens": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"tools": TOOLS}, grpc.StatusCode.INVALID_ARGUMENT, "tools"),  # no tool parser on this frontend
    ({"session_id": "bad id!"}, grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
])
def test_invalid_requests_are_refused_as_over_http(fields: dict[str, Any], code: grpc.StatusCode, param: str) -> None:
    g, chat, backend, metrics = make()
    e = rpc_error(unary(g, req(**fields)))
    err = json.loads(trailing(e)["baton-error"])
    http = TestClient(build_openai_app(chat.frontend, _health, chat=chat)).post("/v1/chat/completions", json={"messages": HELLO, **fields})
    assert e.code() == code and err == http.json()["error"] and e.details() == err["message"] and err["param"] == param
    assert "Traceback" not in e.details() and not backend.requests


def test_a_request_over_max_body_bytes_is_resource_exhausted_without_retry() -> None:
    g, _, backend, _ = make(limits=InputLimits(max_body_bytes=200))
    e = rpc_error(unary(g, req(messages=[{"role": "user", "content": "word " * 100}])))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after" not in trailing(e)
    assert json.loads(trailing(e)["baton-error"])["code"] == "request_too_large" and not backend.requests


def test_engine_failures_are_unavailable_before_and_after_the_first_token() -> None:
    g, _, _, _ = make(FakeBackend(error=EngineUnavailable("decoder gone")))
    e = rpc_error(unary(g, req()))
    assert e.code() == grpc.StatusCode.UNAVAILABLE and trailing(e)["retry-after"] == "1"
    g, _, backend, metrics = make(FakeBackend(error=EngineUnavailable("decoder gone"), error_after=2))
    chunks, e = run(streamed(g, req()))
    assert e is not None and e.code() == grpc.StatusCode.UNAVAILABLE and trailing(e)["retry-after"] == "1"
    assert "".join(c.content for c in chunks) == " Hello world" and chunks[-1].error.type == "service_unavailable"
    assert metrics.requests[("chat", 503)] == 1


def test_a_bug_is_internal_without_its_trace() -> None:
    g, _, _, _ = make(FakeBackend(error=KeyError("secret internals")))
    e = rpc_error(unary(g, req()))
    assert e.code() == grpc.StatusCode.INTERNAL and e.details() == "internal error (KeyError)"


def test_messages_cross_ray_by_reference_to_an_importable_module() -> None:
    """Serve hands each gRPC request message from its proxy to the ingress through Ray's
    cloudpickle; a class whose module cannot be imported is pickled by value, which fails for
    upb message classes ("cannot pickle ... Descriptor"): the generator names the real module."""
    from ray import cloudpickle

    from deployments.grpc_gen import baton_pb2 as pb

    for name in pb.DESCRIPTOR.message_types_by_name:
        assert getattr(pb, name).__module__ == "deployments.grpc_gen.baton_pb2"
    frame = pb.RealtimeFrame(json='{"type": "input"}')
    assert cloudpickle.loads(cloudpickle.dumps(frame)) == frame


# ---- completions and models -----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["once upon a time", [5, 6, 7], ["once upon a time"]])
def test_a_completion_body_survives_the_proto(prompt: Any) -> None:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "seed": 9, "stop": ["."], "user": "ana", "session_id": "c1",
            "ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}
    back = completion_body(completion_request(body), stream=True)
    expected = {**body, "stream": True, "prompt": prompt[0] if prompt == ["once upon a time"] else prompt}
    assert back == expected
    assert validate_body(back, CompletionRequest).prompt == expected["prompt"]


def test_a_completion_without_a_prompt_is_invalid_argument() -> None:
    g, _, backend, _ = make()

    async def go() -> Any:
        async with stub_for(g) as stub:
            return await stub.Completion(pb.CompletionRequest(max_tokens=3))

    e = rpc_error(go())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and json.loads(trailing(e)["baton-error"])["param"] == "prompt"
    assert not backend.requests


def test_completions_unary_and_streamed_are_the_http_reply() -> None:
    g, chat, backend, metrics = make()
    request = completion_request({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream_options": {"include_usage": True}})

    async def go() -> tuple[Any, list[pb.CompletionChunk]]:
        async with stub_for(g) as stub:
            one = await stub.Completion(request, metadata=md(x_session_id="c1"))
            return one, [c async for c in stub.CompletionStream(request, metadata=md(x_session_id="c1"))]

    one, chunks = run(go())
    assert (one.text, one.finish_reason, one.replica, one.session_id) == (" Hello world!", "stop", "replica-a", "c1")
    assert backend.last.prompt_token_ids == (5, 6, 7) and backend.last.session_id == "c1"
    assert "".join(c.text for c in chunks) == one.text and chunks[0].replica == "replica-a" and not any(c.replica for c in chunks[1:])
    assert chunks[-1].HasField("usage") and chunks[-1].usage.completion_tokens == one.usage.completion_tokens == 3
    http = TestClient(build_openai_app(chat.frontend, _health, chat=chat)).post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3,
                                                                                                     "temperature": 0}).json()
    assert http["choices"][0]["text"] == one.text
    assert metrics.requests[("completions", 200)] == 3


def test_list_models_needs_a_key_and_names_the_model() -> None:
    g, _, _, _ = make(keys=KEYS)

    async def go(metadata: list[tuple[str, str]]) -> Any:
        async with stub_for(g) as stub:
            return await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)

    e = rpc_error(go(md("nope")))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    models = run(go(md("anakey"))).models
    assert [(m.id, m.owned_by, m.max_model_len) for m in models] == [("m", "baton", 64)]
