"""The gRPC API through the running application: Ray + Serve's gRPC proxy + vLLM (SmolLM2, this
CPU), API keys on, one ingress replica with room for one chat request at a time.

* a keyed client streams a chat over ChatCompletionStream: the same greedy text as HTTP gives
  for the same prompt, with usage, and unary ChatCompletion agrees;
* ListModels names HTTP's models; a token-id Completion (unary and streamed) is HTTP's text;
* a short Realtime session (session.start, two inputs, session.end) ends OK;
* a bad key is UNAUTHENTICATED; a second chat while one holds the only slot is
  RESOURCE_EXHAUSTED with retry-after (trailing metadata) and a google.rpc.RetryInfo.

Run (needs the models and the generated stubs: `make setup`; from the repo root, the checkout on
the path of Ray's workers too):  .venv/bin/python -m pytest tests/e2e/test_grpc_app.py -q -p no:cacheprovider
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from deployments.grpc_gen import baton_pb2 as pb
from deployments.grpc_gen import baton_pb2_grpc
from deployments.grpc_mapping import chat_request, completion_request
from deployments.grpc_status import retry_info_seconds
from tests.e2e.conftest import e2e_args, free_port, keyed_app

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

KEYS_ENV = "BATON_E2E_GRPC_KEYS"
KEY = "grpc-e2e-key"
TIMEOUT_S = 180.0
PROMPT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    args = e2e_args("conversation", decode_replicas=1, prefill_replicas=1, ingress_replicas=1)
    args["ingress"] = {**args["ingress"], "max_inflight_requests": 1}
    port = free_port()
    with keyed_app(args, KEYS_ENV, KEY, tmp_path_factory.mktemp("grpc") / "conversations.sqlite3", grpc_port=port) as url:
        yield url, f"127.0.0.1:{port}"


def auth(key: str = KEY) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}"), ("application", "baton")]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def stream_text(target: str, body: dict[str, Any]) -> tuple[str, list[pb.ChatChunk]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = baton_pb2_grpc.BatonStub(ch)
        chunks = [c async for c in stub.ChatCompletionStream(chat_request(body), metadata=auth(), timeout=TIMEOUT_S)]
    return "".join(c.content for c in chunks), chunks


def test_a_streamed_chat_is_the_http_reply(app: tuple[str, str]) -> None:
    url, target = app
    body = {"messages": PROMPT, "temperature": 0, "max_tokens": 16, "stream_options": {"include_usage": True}}
    http = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S).json()
    text, chunks = run(stream_text(target, body))
    assert text and text == http["choices"][0]["message"]["content"]
    assert chunks[0].role == "assistant" and chunks[0].replica
    assert chunks[-1].HasField("usage") and chunks[-1].usage.completion_tokens == http["usage"]["completion_tokens"]
    # continuous_usage_stats: the tokens streamed so far on every chunk with output, up to the whole
    # reply (less a stop token, counted but without text)
    text2, chunks2 = run(stream_text(target, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counts = [c.usage.completion_tokens for c in chunks2 if c.content]
    total = http["usage"]["completion_tokens"]
    assert text2 == text and counts and counts == sorted(counts) and total - 1 <= counts[-1] <= total, (counts, total)

    async def unary() -> pb.ChatResponse:
        async with grpc.aio.insecure_channel(target) as ch:
            metadata = [*auth(), ("x-session-id", "grpc-e2e-1")]
            return await baton_pb2_grpc.BatonStub(ch).ChatCompletion(chat_request(body), metadata=metadata, timeout=TIMEOUT_S)

    r = run(unary())
    assert r.content == text and r.session_id == "grpc-e2e-1" and r.finish_reason in ("stop", "length")


def test_models_and_a_token_id_completion_are_the_http_ones(app: tuple[str, str]) -> None:
    url, target = app
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"prompt": [504, 3458, 314, 1345], "temperature": 0, "max_tokens": 8}
    http = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S).json()
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=TIMEOUT_S).json()

    async def calls() -> tuple[pb.ListModelsResponse, pb.CompletionResponse, list[pb.CompletionChunk]]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = baton_pb2_grpc.BatonStub(ch)
            listed = await stub.ListModels(pb.ListModelsRequest(), metadata=auth(), timeout=TIMEOUT_S)
            one = await stub.Completion(completion_request(body), metadata=auth(), timeout=TIMEOUT_S)
            chunks = [c async for c in stub.CompletionStream(completion_request(body), metadata=auth(), timeout=TIMEOUT_S)]
            return listed, one, chunks

    listed, one, chunks = run(calls())
    assert [m.id for m in listed.models] == [m["id"] for m in models["data"]]
    assert one.text and one.text == http["choices"][0]["text"] == "".join(c.text for c in chunks)
    assert one.usage.prompt_tokens == 4 and one.replica and chunks[0].replica


def test_a_short_realtime_session(app: tuple[str, str]) -> None:
    _, target = app

    async def session() -> tuple[list[dict[str, Any]], grpc.StatusCode]:
        async with grpc.aio.insecure_channel(target) as ch:
            call = baton_pb2_grpc.BatonStub(ch).Realtime(metadata=auth(), timeout=TIMEOUT_S)
            frames = []

            async def send(d: dict[str, Any]) -> None:
                await call.write(pb.RealtimeFrame(json=json.dumps(d)))

            async def recv() -> dict[str, Any]:
                frames.append(json.loads((await call.read()).json))
                return frames[-1]

            await send({"type": "session.start", "instructions": "Reply briefly.", "max_tokens": 4, "tick_ms": 5000, "deadline_ms": 60000})
            assert (await recv())["type"] == "session.started"
            for seq, text in enumerate(("Hello there.", "What is two plus two?")):
                await send({"type": "input", "seq": seq, "text": text})
                await recv()
            await send({"type": "session.end"})
            assert await call.read() is grpc.aio.EOF
            return frames, await call.code()

    frames, code = run(session())
    assert [f["type"] for f in frames] == ["session.started", "output", "output"] and [f["seq"] for f in frames[1:]] == [0, 1]
    assert all(f["text"] for f in frames[1:]) and code == grpc.StatusCode.OK


def test_a_bad_key_is_unauthenticated(app: tuple[str, str]) -> None:
    _, target = app

    async def call() -> None:
        async with grpc.aio.insecure_channel(target) as ch:
            await baton_pb2_grpc.BatonStub(ch).ChatCompletion(chat_request({"messages": PROMPT}), metadata=auth("wrong"), timeout=TIMEOUT_S)

    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(call())
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()


def test_a_full_ingress_is_resource_exhausted_with_retry_after(app: tuple[str, str]) -> None:
    _, target = app

    async def overload() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = baton_pb2_grpc.BatonStub(ch)
            long = chat_request({"messages": PROMPT, "max_tokens": 512, "ignore_eos": True})
            holder = stub.ChatCompletionStream(long, metadata=auth(), timeout=TIMEOUT_S)
            await holder.read()  # admitted and generating: the ingress's one slot is taken
            try:
                await stub.ChatCompletion(chat_request({"messages": PROMPT, "max_tokens": 2}), metadata=auth(), timeout=TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                return e
            finally:
                holder.cancel()
            raise AssertionError("the second request was admitted")

    e = run(overload())
    meta = dict(e.trailing_metadata() or ())
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and int(meta["retry-after"]) >= 1
    assert retry_info_seconds(e.trailing_metadata()) == int(meta["retry-after"])
    assert json.loads(meta["baton-error"])["code"] == "overloaded"
