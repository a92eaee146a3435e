"""The replayer against a fake OpenAI server (httpx.MockTransport): no network, no engine."""

import asyncio
import json
from itertools import pairwise

import httpx
import pytest

from baton.traces.format import Conversation, Turn
from baton.traces.replay import replay


class FakeOpenAI:
    """Streams "reply-<n>" as two content chunks; cached tokens = the session's last prompt."""

    def __init__(self, delay_s: float = 0.005, fail: dict | None = None):
        self.delay_s = delay_s
        self.fail = fail or {}  # (session_id, request number in session) -> kind
        self.requests: list[dict] = []
        self.headers: list[httpx.Headers] = []
        self.last_prompt: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        sid = request.headers["x-session-id"]
        nth = sum(r["session_id"] == sid for r in self.requests)
        self.requests.append(body)
        self.headers.append(request.headers)
        kind = self.fail.get((sid, nth))
        if kind == "http":
            return httpx.Response(400, json={"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}})
        if kind == "connect":
            raise httpx.ConnectError("refused", request=request)
        prompt = sum(len(m["content"]) for m in body["messages"]) // 4 + 1
        cached, self.last_prompt[sid] = self.last_prompt.get(sid, 0), prompt
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._stream(kind, nth, prompt, cached))

    async def _stream(self, kind, nth, prompt, cached):
        # in flight from the first chunk until the last one is produced (the client stops
        # reading at [DONE], so a `finally` here would run late)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
        await asyncio.sleep(self.delay_s)
        if kind == "stream":
            self.in_flight -= 1
            yield b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
            return
        if kind == "slow":
            self.in_flight -= 1
            await asyncio.sleep(1.0)
        for piece in ("reply-", f"{nth}"):
            yield f'data: {json.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]})}\n\n'.encode()
        usage = {"prompt_tokens": prompt, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self.in_flight -= 1
        yield f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n'.encode()


def _agentic(cid: str, user: str = "anonymous") -> Conversation:
    return Conversation(conversation_id=cid, user=user, system="SYS", source="test", turns=[
        Turn(role="user", content="do it", effective=False, max_tokens=8),
        Turn(role="tool", content='[{"result": 1}]', effective=True, memories={"k": 3}),
        Turn(role="user", content="again", effective=False),
    ])


def _run(server, convs, concurrency=2, **kw):
    return asyncio.run(replay(convs, "http://fake/", concurrency, progress=False,
                              transport=httpx.MockTransport(server.handler), **kw))


def test_records_history_and_request_fields():
    server = FakeOpenAI()
    result = _run(server, [_agentic("c1", user="alice")], concurrency=1)
    assert result.model == "fake-model" and len(result.turns) == 3
    first, second, third = server.requests
    assert first["messages"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "do it"}]
    assert second["messages"][1:] == [{"role": "user", "content": "do it"},
                                      {"role": "assistant", "content": "reply-0"},
                                      {"role": "tool", "content": '[{"result": 1}]'}]
    assert third["messages"][-2] == {"role": "assistant", "content": "reply-1"}
    assert (first["stream"], first["stream_options"], first["temperature"]) == (True, {"include_usage": True, "continuous_usage_stats": True}, 0)
    assert (first["model"], first["user"], first["session_id"], first["max_tokens"]) == ("fake-model", "alice", "c1", 8)
    assert "memories" not in first and second["memories"] == {"k": 3}
    assert all(h["x-session-id"] == "c1" for h in server.headers)
    assert "authorization" not in server.headers[0]

    t = result.turns
    assert [r.turn_index for r in t] == [0, 1, 2] and all(r.ok and r.status == 200 for r in t)
    assert all(0 < r.ttft_s <= r.e2e_s for r in t)
    assert all(r.ttft_s >= server.delay_s * 0.5 for r in t)  # the empty first delta is not a token
    assert [r.cached_tokens for r in t] == [0, t[0].prompt_tokens, t[1].prompt_tokens]
    assert all(r.completion_tokens == 2 and r.reply_chars == 7 for r in t)
    (conv,) = result.conversations
    assert conv.turns_sent == 3 and conv.error is None
    # TTFET: first request sent -> first token of turn 1 (the first effective one)
    expected = t[1].send_time_s + t[1].ttft_s - t[0].send_time_s
    assert conv.ttfet_s == pytest.approx(expected) and conv.ttfet_s > t[0].e2e_s


def test_explicit_model_and_api_key():
    server = FakeOpenAI()
    result = _run(server, [_agentic("c1")], model="m2", api_key="sekret")
    assert result.model == "m2" and server.requests[0]["model"] == "m2"
    assert server.headers[0]["authorization"] == "Bearer sekret"


@pytest.mark.parametrize("kind, status, text", [
    ("http", 400, "HTTP 400: BadRequestError: prompt too long"),
    ("stream", 200, "InternalServerError: engine died"),
    ("connect", None, "ConnectError: refused"),
    ("slow", 200, "timeout after 0.1s"),
])
def test_errors_recorded_and_stop_only_their_conversation(kind, status, text):
    server = FakeOpenAI(fail={("bad", 1): kind})
    result = _run(server, [_agentic("bad"), _agentic("good")], timeout_s=0.1)
    bad, good = result.conversations
    assert (bad.turns_sent, good.turns_sent) == (2, 3) and good.error is None
    assert bad.error == text and bad.ttfet_s is None
    failed = [r for r in result.turns if not r.ok]
    assert len(failed) == 1
    assert (failed[0].conversation_id, failed[0].turn_index, failed[0].status) == ("bad", 1, status)


def test_concurrency_respected():
    server = FakeOpenAI(delay_s=0.01)
    convs = [_agentic(f"c{i}") for i in range(6)]
    result = _run(server, convs, concurrency=3)
    assert server.max_in_flight == 3
    assert [c.conversation_id for c in result.conversations] == [f"c{i}" for i in range(6)]
    assert len(result.turns) == 18 and all(r.ok for r in result.turns)
    # turns of one conversation never overlap
    for cid in {r.conversation_id for r in result.turns}:
        rs = [r for r in result.turns if r.conversation_id == cid]
        assert all(a.send_time_s + a.e2e_s <= b.send_time_s for a, b in pairwise(rs))
    _run(server := FakeOpenAI(delay_s=0.002), convs, concurrency=1)
    assert server.max_in_flight == 1


def test_think_time_is_waited():
    server = FakeOpenAI(delay_s=0.0)
    conv = Conversation(conversation_id="t", turns=[Turn(role="user", content="a"),
                                                   Turn(role="user", content="b", think_time_s=0.05)])
    first, second = _run(server, [conv]).turns
    assert second.send_time_s - (first.send_time_s + first.e2e_s) >= 0.045


def test_models_endpoint_failure_is_a_clear_error():
    from baton.traces.replay import ReplayError

    transport = httpx.MockTransport(lambda request: httpx.Response(503, json={"error": "down"}))
    with pytest.raises(ReplayError, match="could not list models"):
        asyncio.run(replay([_agentic("c")], "http://fake", 1, progress=False, transport=transport))
