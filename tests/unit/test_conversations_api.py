"""Conversations over HTTP (deployments/openai_api.py): DELETE /v1/conversations/{id} ends the
caller's conversation (pin and ownership) and answers someone else's like an unknown one (404);
a turn of a conversation is refused with 503 + Retry-After while the directory cannot check its
owner. The app is the real one over a PoolBackend whose directory handle is a FakeDirectory
backed by a real DirectoryState (no Ray, no engine)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fakes import FakeDirectory, FakePoolHandle, FakeResponseStream, FakeTokenizer, scripted_deltas
from fastapi.testclient import TestClient

from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from router.directory_state import DirectorySettings, DirectoryState
from router.report import ReplicaReport

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.backend import PoolBackend

HELLO = [{"role": "user", "content": "hello there"}]


@dataclass
class Api:
    client: TestClient
    state: DirectoryState
    directory: FakeDirectory
    decode: FakePoolHandle

    def turn(self, sid: str, user: str | None = None, key: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"messages": HELLO, "max_tokens": 2}
        if user is not None:
            body["user"] = user
        return self.client.post("/v1/chat/completions", json=body, headers={"x-session-id": sid, **_auth(key)})

    def get(self, sid: str, user: str | None = None, key: str | None = None) -> httpx.Response:
        headers = {"x-baton-user": user} if user is not None else {}
        return self.client.get(f"/v1/conversations/{sid}", headers={**headers, **_auth(key)})

    def delete(self, sid: str, user: str | None = None, key: str | None = None) -> httpx.Response:
        headers = {"x-baton-user": user} if user is not None else {}
        return self.client.delete(f"/v1/conversations/{sid}", headers={**headers, **_auth(key)})


def _auth(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def make_api(api_keys: dict[str, str | None] | None = None, errors: dict[str, BaseException] | None = None) -> Api:
    state = DirectoryState(DirectorySettings(policy="colocated", stale_after_s=1e9))
    state.report(ReplicaReport("d0", "decode", kv_capacity_tokens=1000), 0.0)
    directory = FakeDirectory(state=state, errors=errors)
    decode = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(2, replica=req.target_replica)))
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=PoolBackend(decode, None, directory),
                              max_model_len=64, default_max_tokens=4, metrics=RecordingMetrics())

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    async def end_conversation(sid: str, user: str | None) -> bool:
        return await directory.end_conversation.remote(sid, user)

    async def describe(sid: str, user: str | None) -> dict[str, Any] | None:  # as ConversationDirectory.describe_conversation
        info = await directory.describe.remote(sid, user)
        return info.as_json() if info is not None else None

    app = build_openai_app(frontend, health, api_keys=api_keys, end_conversation=end_conversation, describe_conversation=describe)
    return Api(TestClient(app, raise_server_exceptions=False), state, directory, decode)


def not_found(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 404, r.text
    assert r.json() == {"error": {"message": "no such conversation for this user", "type": "not_found_error",
                                  "param": "session_id", "code": "conversation_not_found"}}
    return r.json()


def test_the_owner_deletes_a_conversation_and_its_pin_and_ownership_go() -> None:
    api = make_api()
    assert api.turn("conv-1", "ana").status_code == 200
    assert api.state.pin_of("conv-1") is not None
    r = api.delete("conv-1", "ana")
    assert r.status_code == 200 and r.json() == {"id": "conv-1", "object": "conversation.deleted", "deleted": True}
    assert api.state.pin_of("conv-1") is None
    assert api.directory.called("end_conversation") == [("conv-1", "ana")]
    assert api.turn("conv-1", "bob").status_code == 200  # the id is free again: bob opens it


def test_someone_elses_conversation_and_an_unknown_one_get_the_same_404() -> None:
    api = make_api()
    assert api.turn("conv-1", "ana").status_code == 200
    foreign, unknown, anonymous = api.delete("conv-1", "bob"), api.delete("nope", "ana"), api.delete("conv-1")
    assert not_found(foreign) == not_found(unknown) == not_found(anonymous)
    assert api.state.pin_of("conv-1") is not None and api.turn("conv-1", "ana").status_code == 200
    assert not_found(api.turn("conv-1", "bob"))  # still ana's


def test_a_conversation_opened_without_a_user_is_deleted_without_one() -> None:
    api = make_api()
    assert api.turn("anon/1").status_code == 200  # session ids may hold a slash
    assert not_found(api.delete("anon/1", "ana"))
    assert api.delete("anon/1").status_code == 200 and api.state.pin_of("anon/1") is None


def test_an_api_key_bound_to_a_user_speaks_for_that_user() -> None:
    api = make_api(api_keys={"k-ana": "ana", "k-bob": "bob"})
    assert api.turn("conv-1", key="k-ana").status_code == 200
    assert api.delete("conv-1", key="k-ana", user="bob").status_code == 403  # naming another user
    assert not_found(api.delete("conv-1", key="k-bob"))
    assert api.delete("conv-1").status_code == 401
    assert api.delete("conv-1", key="k-ana").status_code == 200


def test_a_malformed_session_id_is_a_bad_request() -> None:
    r = make_api().delete("bad id!")
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


def test_an_unreachable_directory_answers_503_with_retry_after() -> None:
    api = make_api(errors={"end_conversation": RuntimeError("down"), "route": RuntimeError("down")})
    r = api.delete("conv-1", "ana")
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "engine_unavailable"
    # fail closed: a turn of a conversation is not placed unchecked ...
    r = api.turn("conv-1", "bob")
    assert r.status_code == 503 and r.headers["retry-after"] and "owner cannot be checked" in r.json()["error"]["message"]
    assert api.decode.sent == []
    # ... while a request outside any conversation is placed by load
    r = api.client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200 and api.decode.sent[0].target_replica is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_turn_is_a_plain_http_error_streaming_or_not(stream: bool) -> None:
    api = make_api(errors={"route": RuntimeError("down")})
    r = api.client.post("/v1/chat/completions", json={"messages": HELLO, "stream": stream}, headers={"x-session-id": "c"})
    assert r.status_code == 503 and "retry-after" in r.headers


def test_the_owner_sees_its_conversation_and_nobody_else_does() -> None:
    api = make_api()
    for _ in range(3):
        assert api.turn("conv-g", "ana").status_code == 200
    r = api.get("conv-g", user="ana")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["id"] == "conv-g" and info["object"] == "conversation" and info["decoder"] == "d0"
    assert info["turns"] == 3 and info["handoffs"] == 0 and info["context_tokens"] > 0 and info["adopted"] is False
    assert info["resident"] is False  # d0's latest report (before any turn) lists no conversation
    api.state.report(ReplicaReport("d0", "decode", kv_capacity_tokens=1000, conversations=(("conv-g", 0.5),)), 1.0)
    assert api.get("conv-g", user="ana").json()["resident"] is True
    not_found(api.get("conv-g", user="bob"))  # someone else's: exactly as an unknown id
    not_found(api.get("conv-g"))  # anonymous is another tenant too
    not_found(api.get("never-opened", user="ana"))
    assert api.delete("conv-g", user="ana").status_code == 200
    not_found(api.get("conv-g", user="ana"))  # ended


def test_get_with_keys_speaks_for_the_key_s_user_and_503s_without_the_directory() -> None:
    api = make_api(api_keys={"ka": "ana", "kb": "bob"})
    assert api.turn("conv-k", key="ka").status_code == 200
    assert api.get("conv-k", key="ka").status_code == 200
    not_found(api.get("conv-k", key="kb"))
    assert api.get("conv-k", user="ana", key="kb").status_code == 403  # a bound key cannot name another user
    down = make_api(errors={"describe": TimeoutError()})
    r = down.get("conv-x", user="ana")
    assert r.status_code == 503 and r.headers.get("retry-after") and r.json()["error"]["code"] == "engine_unavailable"
