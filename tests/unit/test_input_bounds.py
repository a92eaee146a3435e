"""Bounded input on the HTTP routes (deployments/request_body.py, input_limits.py, offload.py
through deployments/openai_api.py): body bytes (413 before reading), lone surrogates and other
JSON the decoder passes on or trips over (400, never 5xx), messages, prompt characters, stop
strings and token-id prompts (400 before any rendering), and rendering off the event loop.

The tokenizer is a FakeTokenizer that counts its calls and can block a render in its thread."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import FakeBackend, FakeTokenizer
from fastapi.testclient import TestClient
from test_memory_api import make_api as make_memory_api
from test_openai_api import assert_error

from deployments.chat import PromptRenderer
from deployments.config import IngressConfig, RealtimeConfig
from deployments.frontend import OpenAIFrontend
from deployments.input_limits import CHARS_PER_TOKEN_BOUND, InputLimits, chat_chars
from deployments.metrics import RecordingMetrics
from deployments.offload import Offload
from deployments.openai_api import build_openai_app
from deployments.protocol import ChatMessage

MAX_MODEL_LEN = 4096
HELLO = [{"role": "user", "content": "hello there"}]
TEN_MB = 10 * 1000 * 1000
SURROGATE = '"\\ud800"'  # a JSON string escape of a lone UTF-16 surrogate


def lone(template: str) -> str:
    """template with @S replaced by a JSON string that is a lone surrogate."""
    return template.replace("@S", SURROGATE)


class SpyTokenizer(FakeTokenizer):
    """Counts renders and tokenizations; a chat whose text holds SLOW waits on `gate` in its thread."""

    def __init__(self) -> None:
        super().__init__()
        self.renders = self.encodes = 0
        self.gate, self.entered = threading.Event(), threading.Event()

    def apply_chat_template(self, messages: Any, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        self.renders += 1
        if any("SLOW" in str(m["content"]) for m in messages):
            self.entered.set()
            assert self.gate.wait(2), "the slow render was never released"
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        self.encodes += 1
        return super().__call__(text, add_special_tokens)


def make(limits: InputLimits | None = None) -> tuple[Any, SpyTokenizer, FakeBackend]:
    tok, backend = SpyTokenizer(), FakeBackend()
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(tok), backend=backend, max_model_len=MAX_MODEL_LEN,
                              default_max_tokens=4, metrics=RecordingMetrics())

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    return build_openai_app(frontend, health, limits=limits), tok, backend


@pytest.fixture
def app() -> tuple[Any, SpyTokenizer, FakeBackend]:
    return make()


def post(app: Any, path: str, content: bytes | str, **headers: str) -> httpx.Response:
    return TestClient(app).post(path, content=content, headers={"content-type": "application/json", **headers})


# ---- body bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_10_mb_body_is_413_at_once_and_never_rendered(app: Any, path: str) -> None:
    asgi, tok, backend = app
    body = json.dumps({"messages": [{"role": "user", "content": "word " * (TEN_MB // 5)}], "prompt": "x"})
    t0 = time.monotonic()
    r = post(asgi, path, body)
    assert time.monotonic() - t0 < 1.0
    err = assert_error(r, 413, code="request_too_large", type_="invalid_request_error")
    assert str(4 << 20) in err["message"]
    assert tok.renders == tok.encodes == 0 and backend.requests == []


def test_the_limit_is_inclusive_and_configurable() -> None:
    asgi, _, _ = make(InputLimits(max_body_bytes=2048))
    base = json.dumps({"messages": HELLO})
    assert post(asgi, "/v1/chat/completions", base + " " * (2048 - len(base))).status_code == 200
    assert_error(post(asgi, "/v1/chat/completions", base + " " * (2049 - len(base))), 413, code="request_too_large")


def test_a_chunked_body_is_read_only_up_to_the_limit(app: Any) -> None:
    asgi, tok, _ = app
    sent = 0

    async def chunks() -> Any:  # no Content-Length: Transfer-Encoding chunked
        nonlocal sent
        for _ in range(10):
            sent += 1
            yield b" " * (1 << 20)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as client:
            return await client.post("/v1/chat/completions", content=chunks())

    assert_error(asyncio.run(run()), 413, code="request_too_large")
    assert sent == 5  # 4 MiB fit, the fifth MiB is one byte too many: the other five are never read
    assert tok.renders == 0


def test_a_malformed_content_length_is_400(app: Any) -> None:
    asgi, _, _ = app

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as client:
            req = client.build_request("POST", "/v1/chat/completions", content=json.dumps({"messages": HELLO}))
            req.headers["content-length"] = "-5"
            return await client.send(req)

    assert_error(asyncio.run(run()), 400)


def test_memories_bodies_are_bounded_too(tmp_path: Path) -> None:
    api = make_memory_api(tmp_path)
    r = api.client.post("/v1/memories", content=json.dumps({"user": "alice", "facts": ["x" * TEN_MB]}))
    assert_error(r, 413, code="request_too_large")
    assert api.store.calls == []


# ---- JSON the decoder passes on or trips over ---------------------------------------------------------------


@pytest.mark.parametrize("path, raw", [
    ("/v1/chat/completions", lone('{"messages": [{"role": "user", "content": @S}]}')),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ok"}], "stop": ["a\\udc00"]}'),
    ("/v1/chat/completions", lone('{"messages": [{"role": "user", "content": "ok"}], @S: 1}')),  # a key
    ("/v1/completions", lone('{"prompt": @S}')),
    ("/v1/completions", '{"prompt": ["x \\udfff y"]}'),
])
def test_lone_surrogates_are_400_before_any_rendering(app: Any, path: str, raw: str) -> None:
    asgi, tok, backend = app
    err = assert_error(post(asgi, path, raw), 400, code="invalid_json")
    assert "surrogate" in err["message"]
    assert tok.renders == tok.encodes == 0 and backend.requests == []


def test_surrogates_encoded_as_utf8_bytes_are_400(app: Any) -> None:
    # json.loads decodes bytes with surrogatepass: ED A0 80 would become "\ud800"
    raw = b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    assert_error(post(app[0], "/v1/chat/completions", raw), 400, code="invalid_json")


def test_a_surrogate_pair_is_one_character_and_fine(app: Any) -> None:
    asgi, _, backend = app
    r = post(asgi, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}')
    assert r.status_code == 200, r.text
    assert len(backend.requests) == 1


@pytest.mark.parametrize("raw, what", [("[" * 100_000, "nested too deeply"), ('{"messages": %s}' % ("1" * 5000), "digits")])
def test_json_the_decoder_trips_over_is_400_not_500(raw: str, what: str) -> None:
    asgi, _, _ = make()
    r = TestClient(asgi, raise_server_exceptions=False).post("/v1/chat/completions", content=raw)
    err = assert_error(r, 400, code="invalid_json")
    assert what in err["message"]


def test_lone_surrogates_on_memories_are_400_not_503(tmp_path: Path) -> None:
    api = make_memory_api(tmp_path)
    for raw in (lone('{"user": "alice", "facts": [@S]}'), lone('{"user": @S, "facts": ["ok"]}'),
                lone('{"user": "alice", "messages": [{"role": "user", "content": @S}]}')):
        assert_error(api.client.post("/v1/memories", content=raw), 400, code="invalid_json")
    chat = lone('{"user": "alice", "memories": {"k": 1}, "messages": [{"role": "user", "content": @S}]}')
    assert_error(api.client.post("/v1/chat/completions", content=chat), 400, code="invalid_json")
    assert api.store.calls == [] and api.backend.requests == []


# ---- what a request may ask for -----------------------------------------------------------------------


def test_too_many_messages_is_400_before_rendering() -> None:
    asgi, tok, _ = make(InputLimits(max_messages=3))
    c = TestClient(asgi)
    assert c.post("/v1/chat/completions", json={"messages": HELLO * 3}).status_code == 200
    renders = tok.renders
    err = assert_error(c.post("/v1/chat/completions", json={"messages": HELLO * 4}), 400, code="too_many_messages", param="messages")
    assert "at most 3" in err["message"] and tok.renders == renders


def test_prompt_characters_are_bounded_before_tokenization(app: Any) -> None:
    asgi, tok, backend = app
    limit = CHARS_PER_TOKEN_BOUND * MAX_MODEL_LEN  # the default: far beyond the context
    c = TestClient(asgi)
    long_chat = [{"role": "system", "content": "x" * (limit // 2)}, {"role": "user", "content": "y" * (limit // 2 + 1)}]
    err = assert_error(c.post("/v1/chat/completions", json={"messages": long_chat}), 400, code="context_length_exceeded", param="messages")
    assert str(limit) in err["message"]
    assert_error(c.post("/v1/completions", json={"prompt": "z" * (limit + 1)}), 400, code="context_length_exceeded", param="prompt")
    assert_error(c.post("/v1/completions", json={"prompt": ["z" * (limit + 1)]}), 400, code="context_length_exceeded", param="prompt")
    assert tok.renders == tok.encodes == 0 and backend.requests == []


def test_max_prompt_chars_is_configurable() -> None:
    asgi, tok, _ = make(InputLimits(max_prompt_chars=10))
    c = TestClient(asgi)
    assert c.post("/v1/completions", json={"prompt": "a" * 10}).status_code == 200
    assert_error(c.post("/v1/completions", json={"prompt": "a" * 11}), 400, code="context_length_exceeded")


def test_chat_characters_count_everything_the_template_renders() -> None:
    m = ChatMessage.model_validate({"role": "assistant", "content": [{"type": "text", "text": "ab"}], "name": "n",
                                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]})
    assert chat_chars([m, ChatMessage(role="tool", content="42", tool_call_id="c1")]) == 2 + 1 + (2 + 1 + 2) + 2 + 2


def test_token_id_prompts_past_the_context_are_refused_before_the_vocabulary_scan(app: Any) -> None:
    asgi, _, backend = app
    c = TestClient(asgi)
    ids = [5] * (MAX_MODEL_LEN - 1)
    assert c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).status_code == 200
    too_long = [5] * MAX_MODEL_LEN + [10**9]  # out of vocabulary too: the length is what is reported
    err = assert_error(c.post("/v1/completions", json={"prompt": too_long}), 400, code="context_length_exceeded", param="prompt")
    assert str(MAX_MODEL_LEN) in err["message"] and len(backend.requests) == 1


@pytest.mark.parametrize("stop", [["x" * 257], "x" * 257, ["a"] * 5])
def test_stop_strings_are_bounded(app: Any, stop: Any) -> None:
    r = TestClient(app[0]).post("/v1/chat/completions", json={"messages": HELLO, "stop": stop})
    assert_error(r, 400, code="invalid_value", param="stop")
    assert TestClient(app[0]).post("/v1/chat/completions", json={"messages": HELLO, "stop": ["x" * 256] * 4}).status_code == 200


# ---- rendering off the event loop ---------------------------------------------------------------------


def test_a_slow_render_does_not_stall_other_requests() -> None:
    asgi, tok, backend = make()

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as client:
            slow = asyncio.create_task(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "SLOW job"}]}))
            assert await asyncio.to_thread(tok.entered.wait, 2)  # the slow render holds its thread
            fast = await asyncio.wait_for(client.post("/v1/chat/completions", json={"messages": HELLO}), 1.0)
            assert fast.status_code == 200 and not slow.done()
            assert [r.prompt_token_ids for r in backend.requests] == [tuple(tok(tok.apply_chat_template(HELLO))["input_ids"])]
            tok.gate.set()
            assert (await slow).status_code == 200

    asyncio.run(run())
    assert len(backend.requests) == 2


def test_the_render_pool_runs_at_most_its_threads_at_once() -> None:
    pool, lock = Offload(2), threading.Lock()
    running, peak = 0, 0

    def job(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        if i == 3:
            raise ValueError("bad input")
        return i

    async def run() -> list[Any]:
        return await asyncio.gather(*(pool.run(job, i) for i in range(6)), return_exceptions=True)

    results = asyncio.run(run())
    assert results[:3] == [0, 1, 2] and isinstance(results[3], ValueError) and results[4:] == [4, 5]
    assert peak == 2


# ---- configuration ---------------------------------------------------------------------------------------


def test_ingress_config_carries_the_bounds() -> None:
    assert IngressConfig().input_limits() == InputLimits(max_body_bytes=4 << 20, max_messages=1024, max_prompt_chars=None, render_threads=2)
    cfg = IngressConfig(max_body_bytes=1 << 20, max_messages=8, max_prompt_chars=1000, render_threads=4)
    assert cfg.input_limits() == InputLimits(1 << 20, 8, 1000, 4)
    assert InputLimits().prompt_chars(100) == CHARS_PER_TOKEN_BOUND * 100 and InputLimits(max_prompt_chars=7).prompt_chars(100) == 7
    with pytest.raises(ValueError):
        IngressConfig(max_body_bytes=10)


def test_realtime_frames_must_fit_an_input() -> None:
    assert RealtimeConfig().max_frame_bytes == 64 * 1024 and RealtimeConfig().max_sessions_per_user == 4
    with pytest.raises(ValueError, match="max_frame_bytes"):
        RealtimeConfig(max_input_chars=4000, max_frame_bytes=8000)
