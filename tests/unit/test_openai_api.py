"""The OpenAI-compatible HTTP surface (deployments/openai_api.py over deployments/frontend.py),
driven through FastAPI's TestClient with a fake tokenizer and a scripted backend: no engine.

Every error answer must be an OpenAI-style body {"error": {message, type, param, code}} with the
right status, and never a stack trace."""
from __future__ import annotations

import asyncio
import json
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fakes import FakeBackend, FakeDirectory, FakeTokenizer
from fastapi.testclient import TestClient

from baton.engine.types import EngineRequestError, EngineUnavailable, GenerationDelta, SamplingSpec
from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.inflight import InflightLimit
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from deployments.protocol import ChatCompletionRequest
from router.directory_state import DirectorySettings, DirectoryState
from router.report import ReplicaReport

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.ingress import Ingress, IngressSettings

MAX_MODEL_LEN = 64
DEFAULT_MAX_TOKENS = 16
HELLO = [{"role": "user", "content": "hello there"}]


@dataclass
class Api:
    client: TestClient
    backend: FakeBackend
    metrics: RecordingMetrics
    tokenizer: FakeTokenizer
    health_report: dict[str, Any] = field(default_factory=lambda: {"status": "ok"})
    stats_report: dict[str, Any] | BaseException = field(default_factory=lambda: {"policy": "conversation", "live_pins": 0})

    def chat(self, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json={"messages": HELLO, **(body or {}), **fields}, headers=headers)

    def complete(self, **fields: Any) -> httpx.Response:
        return self.client.post("/v1/completions", json=fields)

    def prompt_len(self, messages: list[dict[str, Any]]) -> int:
        return len(PromptRenderer(self.tokenizer).chat_tokens(ChatCompletionRequest(messages=messages).messages))


def make_api(backend: FakeBackend | None = None, *, raise_server_exceptions: bool = True, with_stats: bool = True,
             admission: InflightLimit | None = None) -> Api:
    tokenizer = FakeTokenizer()
    backend = backend or FakeBackend()
    metrics = RecordingMetrics()
    frontend = OpenAIFrontend(
        model_id="m",
        renderer=PromptRenderer(tokenizer),
        backend=backend,
        max_model_len=MAX_MODEL_LEN,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        metrics=metrics,
        admission=admission,
    )
    api = Api(client=None, backend=backend, metrics=metrics, tokenizer=tokenizer)  # type: ignore[arg-type]

    async def health() -> dict[str, Any]:
        return api.health_report

    async def stats() -> dict[str, Any]:
        if isinstance(api.stats_report, BaseException):
            raise api.stats_report
        return api.stats_report

    app = build_openai_app(frontend, health, stats if with_stats else None)
    api.client = TestClient(app, raise_server_exceptions=raise_server_exceptions)
    return api


@pytest.fixture
def api() -> Api:
    return make_api()


def sse_events(r: httpx.Response) -> list[Any]:
    """The data payloads of an SSE body: JSON objects, and the final '[DONE]' as a string."""
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks), r.text
    payloads = [b[len("data: "):] for b in blocks]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def assert_error(r: httpx.Response, status: int, *, code: str | None = None, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


# ---- models and health --------------------------------------------------------------------------


def test_models_lists_the_served_model(api: Api) -> None:
    r = api.client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["m"]
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_health_ok_is_200(api: Api) -> None:
    api.health_report = {"status": "ok", "decode": 1}
    r = api.client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "decode": 1}


def test_health_not_ok_is_503(api: Api) -> None:
    api.health_report = {"status": "starting", "reason": "decode engine loading"}
    r = api.client.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "decode engine loading"


def test_stats_returns_the_directory_snapshot(api: Api) -> None:
    api.stats_report = {"policy": "per_turn_pd", "live_pins": 3, "replicas": {"d0": {"pool": "decode", "live": True}}}
    r = api.client.get("/baton/stats")
    assert r.status_code == 200 and r.json() == api.stats_report


@pytest.mark.parametrize("error", [TimeoutError(), RuntimeError("directory died")])
def test_stats_without_a_directory_is_503(api: Api, error: BaseException) -> None:
    api.stats_report = error
    err = assert_error(api.client.get("/baton/stats"), 503)
    assert "directory" in err["message"] and type(error).__name__ in err["message"]
    assert "directory died" not in err["message"]  # the type, not the internals


def test_stats_route_exists_only_when_given() -> None:
    assert_error(make_api(with_stats=False).client.get("/baton/stats"), 404)


def ingress_health(directory: FakeDirectory, disaggregated: bool) -> dict[str, Any]:
    """Ingress._health (what GET /health answers in Serve) over a fake directory handle."""
    cls = Ingress.func_or_class
    # the Ingress's own methods over its state, without __init__ (it loads a tokenizer) nor Serve's wrapper
    ingress = SimpleNamespace(
        _directory=directory,
        _settings=IngressSettings(model_id="m", model_path="/m", max_model_len=64, default_max_tokens=16, disaggregated=disaggregated),
        _frontend=SimpleNamespace(model_id="m"),
    )
    ingress._stats = lambda flush=True: cls._stats(ingress, flush)
    return asyncio.run(cls._health(ingress))


def directory_with(policy: str, now: float, **reports: tuple[str, float]) -> FakeDirectory:
    """A DirectoryState behind a fake handle, clock at `now`; reports: replica -> (pool, time)."""
    state = DirectoryState(DirectorySettings(policy=policy, stale_after_s=10.0))  # type: ignore[arg-type]
    for replica, (pool, at) in reports.items():
        state.report(ReplicaReport(replica, pool), at)
    return FakeDirectory(state=state, clock=lambda: now)


@pytest.mark.parametrize(
    "policy, disaggregated, reports, status, live",
    [
        ("conversation", True, {"d0": ("decode", 0.0), "p0": ("prefill", 0.0)}, "ok", {"decode": 1, "prefill": 1}),
        ("conversation", True, {"d0": ("decode", 0.0), "d1": ("decode", 0.0)}, "unavailable", {"decode": 2, "prefill": 0}),
        ("conversation", True, {"d0": ("decode", 0.0), "p0": ("prefill", -20.0)}, "unavailable", {"decode": 1, "prefill": 0}),
        ("colocated", False, {"d0": ("decode", 0.0)}, "ok", {"decode": 1, "prefill": 0}),
        ("colocated", False, {"d0": ("decode", -20.0)}, "unavailable", {"decode": 0, "prefill": 0}),
        ("round_robin", False, {}, "unavailable", {"decode": 0, "prefill": 0}),
    ],
    ids=["pd-up", "pd-no-prefill", "pd-stale-prefill", "colocated-up", "colocated-stale", "nothing-reported"],
)
def test_ingress_health_needs_the_live_replicas_its_policy_uses(
    policy: str, disaggregated: bool, reports: dict[str, tuple[str, float]], status: str, live: dict[str, int]
) -> None:
    report = ingress_health(directory_with(policy, 1.0, **reports), disaggregated)
    assert report == {"status": status, "model": "m", "policy": policy, "live_replicas": live}


def test_ingress_health_without_a_directory_is_unavailable() -> None:
    report = ingress_health(FakeDirectory(errors={"snapshot": RuntimeError("gone")}), disaggregated=False)
    assert report == {"status": "unavailable", "model": "m", "error": "directory: RuntimeError"}


def test_unknown_route_and_wrong_method_get_openai_errors(api: Api) -> None:
    assert_error(api.client.get("/v1/nothing"), 404, type_="not_found_error")
    assert_error(api.client.get("/v1/chat/completions"), 405)


# ---- chat, non-streaming ---------------------------------------------------------------------------


def test_chat_completion_body_usage_and_headers() -> None:
    api = make_api(FakeBackend(tokens=[" Hello", " world", "!"], cached_tokens=5, replica="replica-7"))
    r = api.chat(headers={"x-session-id": "conv-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "m" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": " Hello world!"}
    assert choice["finish_reason"] == "stop"
    n = api.prompt_len(HELLO)
    assert len(api.backend.last.prompt_token_ids) == n
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3, "prompt_tokens_details": {"cached_tokens": 5}}
    assert r.headers["x-session-id"] == "conv-1"
    assert r.headers["x-baton-replica"] == "replica-7"
    assert body["id"] == api.backend.last.request_id


def test_chat_without_session_has_no_session_header(api: Api) -> None:
    r = api.chat()
    assert r.status_code == 200
    assert "x-session-id" not in r.headers
    assert api.backend.last.session_id is None


def test_finish_reason_length_is_reported() -> None:
    api = make_api(FakeBackend(tokens=["a", "b"], finish_reason="length"))
    assert api.chat(max_tokens=2).json()["choices"][0]["finish_reason"] == "length"


def test_messages_are_rendered_with_the_chat_template(api: Api) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert api.chat(messages=messages).status_code == 200
    expected = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "two parts"},
        {"role": "assistant", "content": json.dumps([{"name": "f", "arguments": "{}"}])},
        {"role": "tool", "content": "42"},
    ]
    text = api.tokenizer.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
    assert api.backend.last.prompt_token_ids == tuple(api.tokenizer(text)["input_ids"])


# ---- chat, streaming --------------------------------------------------------------------------------


def test_chat_stream_chunks_in_order(api: Api) -> None:
    r = api.chat(stream=True, headers={"x-session-id": "s1"})
    assert r.status_code == 200
    assert r.headers["x-session-id"] == "s1" and r.headers["x-baton-replica"] == "replica-a"
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert deltas == [{"content": " Hello"}, {"content": " world"}, {"content": "!"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None, None, "stop"]
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_without_memories_has_no_memory_headers(api: Api, stream: bool) -> None:
    """x-baton-memories / x-baton-memory-mode come only with `memories` (tests/unit/test_memory_api.py)."""
    r = api.chat(stream=stream, headers={"x-session-id": "s1"})
    assert r.status_code == 200 and r.headers["x-baton-replica"] == "replica-a"
    assert "x-baton-memories" not in r.headers and "x-baton-memory-mode" not in r.headers


@dataclass
class CoalescingBackend(FakeBackend):
    """Deltas of several tokens each, as a replica sends them when its consumer fell behind."""

    per_delta: tuple[int, ...] = (1, 3, 2)

    async def generate(self, request: Any) -> Any:
        self.requests.append(request)
        for i, n in enumerate(self.per_delta):
            last = i == len(self.per_delta) - 1
            yield GenerationDelta(text=" w" * n, token_ids=tuple(range(3, 3 + n)), prompt_tokens=len(request.prompt_token_ids),
                                  cached_tokens=0, finished=last, finish_reason="stop" if last else None,
                                  replica="replica-a" if i == 0 else None)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_counts_the_tokens_of_every_chunk(endpoint: str) -> None:
    """stream_options.continuous_usage_stats: each output chunk carries the usage so far, so the
    tokens a chunk held are the step in completion_tokens (1, 3, 2 here); without it no chunk but
    the include_usage one has usage."""
    api = make_api(CoalescingBackend())
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        events = sse_events(api.chat(stream=True, stream_options=opts))
    else:
        events = sse_events(api.complete(prompt=[5, 6, 7], max_tokens=8, stream=True, stream_options=opts))
    outputs = [e for e in events[:-1] if e["choices"] and ((e["choices"][0].get("delta") or {}).get("content") or e["choices"][0].get("text"))]
    counts = [e["usage"]["completion_tokens"] for e in outputs]
    assert [b - a for a, b in zip([0, *counts], counts, strict=False)] == [1, 3, 2]
    assert all(e["usage"]["prompt_tokens"] == outputs[0]["usage"]["prompt_tokens"] > 0 for e in outputs)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6  # include_usage's last chunk still comes
    plain = sse_events(api.chat(stream=True, stream_options={"include_usage": True})) if endpoint == "chat" else \
        sse_events(api.complete(prompt=[5, 6, 7], max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert sum("usage" in e for e in plain[:-1]) == 1


def test_chat_stream_usage_chunk_only_when_asked() -> None:
    api = make_api(FakeBackend(cached_tokens=2))
    no_usage = sse_events(api.chat(stream=True, stream_options={"include_usage": False}))
    assert all("usage" not in e for e in no_usage[:-1])
    events = sse_events(api.chat(stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    last = events[-2]
    n = api.prompt_len(HELLO)
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3, "prompt_tokens_details": {"cached_tokens": 2}}
    assert sum("usage" in e for e in events[:-1]) == 1


def test_stream_of_an_engine_that_produced_nothing_still_ends_with_done() -> None:
    api = make_api(FakeBackend(tokens=[]))
    events = sse_events(api.chat(stream=True))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == "[DONE]" and len(events) == 2


# ---- completions ----------------------------------------------------------------------------------


def test_completion_with_a_string_prompt(api: Api) -> None:
    r = api.complete(prompt="one two three four", max_tokens=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == " Hello world!" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 3
    assert api.backend.last.prompt_token_ids == tuple(api.tokenizer("one two three four")["input_ids"])


def test_completion_with_a_one_element_list_prompt(api: Api) -> None:
    assert api.complete(prompt=["one two"]).status_code == 200
    assert len(api.backend.last.prompt_token_ids) == 2


def test_completion_with_token_ids(api: Api) -> None:
    r = api.complete(prompt=[5, 6, 999])
    assert r.status_code == 200, r.text
    assert api.backend.last.prompt_token_ids == (5, 6, 999)


@pytest.mark.parametrize("bad", [1000, -1, 10**9])
def test_completion_with_out_of_vocabulary_ids_is_400(api: Api, bad: int) -> None:
    err = assert_error(api.complete(prompt=[5, bad]), 400, param="prompt")
    assert str(bad) in err["message"]
    assert api.backend.requests == []


def test_completion_stream(api: Api) -> None:
    events = sse_events(api.client.post("/v1/completions", json={"prompt": "hi", "stream": True}))
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" Hello", " world", "!"]
    assert all(e["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize("prompt", ["", [], ["a", "b"], [""]])
def test_completion_rejects_empty_or_multiple_prompts(api: Api, prompt: Any) -> None:
    assert_error(api.complete(prompt=prompt), 400)
    assert api.backend.requests == []


# ---- session ids ---------------------------------------------------------------------------------


def test_session_from_header_reaches_the_backend(api: Api) -> None:
    assert api.chat(headers={"x-session-id": "user-1/conv:2"}).status_code == 200
    assert api.backend.last.session_id == "user-1/conv:2"


def test_session_from_body_reaches_the_backend(api: Api) -> None:
    r = api.chat(session_id="conv-b")
    assert r.status_code == 200 and r.headers["x-session-id"] == "conv-b"
    assert api.backend.last.session_id == "conv-b"


def test_session_in_header_and_body_must_agree(api: Api) -> None:
    assert api.chat(session_id="same", headers={"x-session-id": "same"}).status_code == 200
    assert api.backend.last.session_id == "same"
    assert_error(api.chat(session_id="one", headers={"x-session-id": "two"}), 400, param="session_id")
    assert len(api.backend.requests) == 1


@pytest.mark.parametrize("sid", ["has space", "semi;colon", "x" * 129, ""])
def test_invalid_session_ids_are_400(api: Api, sid: str) -> None:
    assert_error(api.chat(headers={"x-session-id": sid}), 400, param="session_id")
    assert_error(api.chat(session_id=sid), 400, param="session_id")
    assert api.backend.requests == []


def test_user_reaches_the_backend(api: Api) -> None:
    # the directory records who a conversation belongs to
    assert api.chat(user="alice", headers={"x-session-id": "c"}).status_code == 200
    assert api.backend.last.user == "alice" and api.backend.last.session_id == "c"
    assert api.chat().status_code == 200 and api.backend.last.user is None
    assert api.client.post("/v1/completions", json={"prompt": "hi", "user": "bob"}).status_code == 200
    assert api.backend.last.user == "bob"


def test_the_frontend_never_places_a_request_itself(api: Api) -> None:
    assert api.chat(headers={"x-session-id": "c"}).status_code == 200
    assert api.backend.last.target_replica is None and api.backend.last.kv_transfer_params is None


def test_completion_session_reaches_the_backend(api: Api) -> None:
    assert api.client.post("/v1/completions", json={"prompt": "hi"}, headers={"x-session-id": "c"}).status_code == 200
    assert api.backend.last.session_id == "c"


# ---- sampling parameters -----------------------------------------------------------------------------


def test_sampling_params_reach_the_backend(api: Api) -> None:
    r = api.chat(temperature=0, max_tokens=5, stop=["\n", "END"], top_p=0.5, top_k=-1, seed=7, presence_penalty=0.5, frequency_penalty=-0.5, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert api.backend.last.sampling == SamplingSpec(
        max_tokens=5, temperature=0.0, top_p=0.5, top_k=0, seed=7, stop=("\n", "END"), presence_penalty=0.5, frequency_penalty=-0.5, ignore_eos=True
    )


def test_sampling_defaults(api: Api) -> None:
    assert api.chat().status_code == 200
    assert api.backend.last.sampling == SamplingSpec(max_tokens=DEFAULT_MAX_TOKENS)


def test_single_stop_string_and_max_completion_tokens(api: Api) -> None:
    assert api.chat(stop="###", max_tokens=3, max_completion_tokens=4, top_k=20).status_code == 200
    s = api.backend.last.sampling
    assert s.stop == ("###",) and s.max_tokens == 4 and s.top_k == 20


def test_default_max_tokens_shrinks_to_the_room_left() -> None:
    api = make_api()
    words = " ".join(f"w{i}" for i in range(MAX_MODEL_LEN - 10 - 2))
    messages = [{"role": "user", "content": words}]
    room = MAX_MODEL_LEN - api.prompt_len(messages)
    assert 0 < room < DEFAULT_MAX_TOKENS
    assert api.chat(messages=messages).status_code == 200
    assert api.backend.last.sampling.max_tokens == room


# ---- client errors ---------------------------------------------------------------------------------


def post_raw(api: Api, content: bytes) -> httpx.Response:
    return api.client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe"])
def test_invalid_json_is_400(api: Api, raw: bytes) -> None:
    assert_error(post_raw(api, raw), 400, code="invalid_json", type_="invalid_request_error")


@pytest.mark.parametrize("raw", [b"[]", b'[{"messages": []}]', b'"text"', b"null"])
def test_non_object_json_is_400(api: Api, raw: bytes) -> None:
    assert_error(post_raw(api, raw), 400, code="invalid_json")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": HELLO, "temperature": 5}, "temperature"),
        ({"messages": HELLO, "top_p": 0}, "top_p"),
        ({"messages": HELLO, "n": 2}, "n"),
        ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": HELLO, "stop": [""]}, "stop"),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ({"messages": HELLO, "temperature": "hot"}, "temperature"),
        ({"messages": HELLO, "seed": 10**22}, "seed"),  # beyond 64 bits: the engine cannot take it
    ],
)
def test_invalid_bodies_are_400_naming_the_field(api: Api, body: dict[str, Any], param: str) -> None:
    err = assert_error(api.client.post("/v1/chat/completions", json=body), 400, param=param, code="invalid_value")
    assert err["message"].startswith(param)
    assert api.backend.requests == []


def test_unknown_fields_are_ignored(api: Api) -> None:
    assert api.chat(logit_bias={"1": 2}, some_future_field=True).status_code == 200


def test_unknown_model_is_404(api: Api) -> None:
    err = assert_error(api.chat(model="gpt-9"), 404, code="model_not_found", param="model", type_="not_found_error")
    assert "gpt-9" in err["message"]
    assert api.chat(model="m").status_code == 200


def test_prompt_longer_than_the_context_is_400(api: Api) -> None:
    words = " ".join(f"w{i}" for i in range(MAX_MODEL_LEN + 5))
    err = assert_error(api.chat(messages=[{"role": "user", "content": words}]), 400, code="context_length_exceeded", param="messages")
    assert str(MAX_MODEL_LEN) in err["message"]
    assert_error(api.complete(prompt=list(range(3, 3 + MAX_MODEL_LEN))), 400, code="context_length_exceeded", param="prompt")
    assert api.backend.requests == []


def test_prompt_plus_max_tokens_over_the_context_is_400(api: Api) -> None:
    room = MAX_MODEL_LEN - api.prompt_len(HELLO)
    assert api.chat(max_tokens=room).status_code == 200
    assert_error(api.chat(max_tokens=room + 1), 400, code="context_length_exceeded", param="max_tokens")
    assert len(api.backend.requests) == 1


def test_memories_are_rejected_without_a_memory_store(api: Api) -> None:
    assert_error(api.chat(memories={"ref": "x"}), 400, param="memories", code="memories_unavailable")
    assert api.backend.requests == []


# ---- engine failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_engine_unavailable_before_the_first_token_is_503(stream: bool) -> None:
    api = make_api(FakeBackend(error=EngineUnavailable("decode pool is restarting")))
    r = api.chat(stream=stream)
    err = assert_error(r, 503, code="engine_unavailable", type_="service_unavailable")
    assert "decode pool is restarting" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert api.metrics.requests == {("chat", 503): 1}


@pytest.mark.parametrize("stream", [False, True])
def test_engine_rejecting_the_request_is_400(stream: bool) -> None:
    api = make_api(FakeBackend(error=EngineRequestError("bad logits processor")))
    err = assert_error(api.chat(stream=stream), 400, code="engine_rejected")
    assert "bad logits processor" in err["message"]
    assert api.metrics.requests == {("chat", 400): 1}


def test_engine_failure_mid_stream_is_an_in_stream_error_then_done() -> None:
    api = make_api(FakeBackend(tokens=["a", "b", "c", "d"], error=EngineUnavailable("replica died"), error_after=2))
    r = api.chat(stream=True)
    assert r.status_code == 200
    events = sse_events(r)
    assert [e["choices"][0]["delta"] for e in events[1:3]] == [{"content": "a"}, {"content": "b"}]
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "engine_unavailable" and "replica died" in err["message"]
    assert len(events) == 5  # role, a, b, error, [DONE]
    assert api.metrics.requests == {("chat", 503): 1}


def test_engine_failure_after_some_tokens_without_streaming_is_503() -> None:
    api = make_api(FakeBackend(tokens=["a", "b", "c"], error=EngineUnavailable("replica died"), error_after=2))
    assert_error(api.chat(), 503, code="engine_unavailable")


@pytest.mark.parametrize("stream", [False, True])
def test_unexpected_backend_exception_is_500_without_a_trace(stream: bool) -> None:
    api = make_api(FakeBackend(error=RuntimeError("secret internals at 0xdeadbeef")), raise_server_exceptions=False)
    err = assert_error(api.chat(stream=stream), 500, code="internal_error", type_="server_error")
    assert "RuntimeError" in err["message"]
    assert "secret internals" not in err["message"]


def test_unexpected_backend_exception_mid_stream_still_ends_the_stream() -> None:
    api = make_api(FakeBackend(tokens=["a", "b", "c"], error=RuntimeError("boom"), error_after=1), raise_server_exceptions=False)
    events = sse_events(api.chat(stream=True))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "internal_error"
    assert api.metrics.requests == {("chat", 500): 1}


# ---- metrics -------------------------------------------------------------------------------------------


def test_metrics_of_a_successful_chat() -> None:
    api = make_api(FakeBackend(tokens=["a", "b", "c"], cached_tokens=4))
    assert api.chat().status_code == 200
    n = api.prompt_len(HELLO)
    assert api.metrics.requests == {("chat", 200): 1}
    assert len(api.metrics.ttfts) == 1 and api.metrics.ttfts[0] >= 0
    assert len(api.metrics.tpots) == 1
    assert dict(api.metrics.token_totals) == {"prompt": n, "cached": 4, "generated": 3}


def test_metrics_count_streams_and_endpoints_separately(api: Api) -> None:
    assert api.chat(stream=True).status_code == 200
    assert api.chat().status_code == 200
    assert api.complete(prompt="x y").status_code == 200
    assert api.metrics.requests == {("chat", 200): 2, ("completions", 200): 1}
    assert len(api.metrics.ttfts) == 3
    assert api.metrics.token_totals["generated"] == 9


def test_rejected_requests_never_reach_the_engine_but_are_counted(api: Api) -> None:
    api.chat(temperature=5)
    api.chat(model="nope")
    api.complete(prompt="")
    assert api.backend.requests == [] and api.metrics.ttfts == [] and not api.metrics.token_totals
    assert api.metrics.requests == {("chat", 400): 1, ("chat", 404): 1, ("completions", 400): 1}


def test_unexpected_backend_exception_is_counted_as_500() -> None:
    api = make_api(FakeBackend(error=RuntimeError("x")), raise_server_exceptions=False)
    api.chat()
    assert api.metrics.requests == {("chat", 500): 1}


# ---- the frontend when the client goes away ---------------------------------------------------------------


def test_client_leaving_mid_stream_closes_the_engine_request() -> None:
    backend = FakeBackend(tokens=[f"t{i}" for i in range(10)])
    metrics = RecordingMetrics()
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=backend, max_model_len=MAX_MODEL_LEN,
                              default_max_tokens=DEFAULT_MAX_TOKENS, metrics=metrics)

    async def leave_after_two_events() -> list[str]:
        prepared = frontend.prepare_chat(ChatCompletionRequest(messages=HELLO, stream=True), "s")
        reply = await frontend.open_stream(prepared)
        assert reply.events is not None and reply.replica == "replica-a"
        got = [await reply.events.__anext__(), await reply.events.__anext__()]
        await reply.events.aclose()  # type: ignore[attr-defined]
        return got

    got = asyncio.run(leave_after_two_events())
    assert '"role":"assistant"' in got[0] and '"t0"' in got[1]
    assert backend.closed_early()
    assert metrics.requests == {("chat", 499): 1}


def test_finished_requests_are_not_reported_as_closed(api: Api) -> None:
    api.chat(stream=True)
    api.chat()
    assert all(outcome == "finished" for outcome in api.backend.outcomes.values())


def test_turn_labels_are_a_bounded_set() -> None:
    from deployments.metrics import turn_label

    assert [turn_label(i) for i in (None, 0, 4, 5, 99)] == ["none", "0", "4", "5+", "5+"]


def test_a_full_ingress_refuses_before_reading_the_body() -> None:
    limit = InflightLimit(1)
    api = make_api(admission=limit)
    held = limit.acquire()
    # not even valid JSON: the 429 comes before any parsing (a refusal costs next to nothing)
    r = api.client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 429, code="overloaded")
    assert r.headers["retry-after"] == "1"
    assert api.metrics.requests[("chat", 429)] == 1
    held.release(200)
    assert api.client.post("/v1/chat/completions", content=b"{not json").status_code == 400  # room again: parsed
    assert api.chat().status_code == 200
