"""The ingress's memory surface (deployments/memory_api.py, deployments/openai_api.py): the
/v1/memories routes and the chat `memories` option, through FastAPI's TestClient over a real
MemoryService (SQLite in tmp_path, HashingEmbedder) behind FakeMemoryStoreHandle, a fake
tokenizer and a scripted backend. No engine, no Ray.

Isolation: another user's fact answers exactly like an id that does not exist (404, same body
shape); with API keys bound to users the key decides who the caller is (403 for a claim of
someone else)."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import FakeBackend, FakeMemoryStoreHandle, FakeTokenizer
from fastapi.testclient import TestClient

from deployments import memory_api
from deployments.chat import PromptRenderer
from deployments.errors import APIError
from deployments.frontend import OpenAIFrontend
from deployments.memory_api import MemoryFrontend, resolve_user, store_error
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from deployments.salt import tenant_salt
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.errors import FactNotFound, InvalidInput
from memory_store.layout import fact_line
from memory_store.store import MemoryService

UNKNOWN = "0" * 32
ALICE_FACTS = ["Alice adopted a dog named Rex", "Alice moved to Lyon", "Alice plays the violin"]


@dataclass
class Api:
    client: TestClient
    backend: FakeBackend
    store: FakeMemoryStoreHandle
    service: MemoryService
    renderer: PromptRenderer

    def add(self, user: str | None, facts: list[str], headers: dict[str, str] | None = None) -> httpx.Response:
        body: dict[str, Any] = {"facts": facts}
        if user is not None:
            body["user"] = user
        return self.client.post("/v1/memories", json=body, headers=headers)

    def chat(self, memories: dict[str, Any] | None, *, user: str | None = "alice", content: str = "tell me about my dog Rex",
             headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}
        if memories is not None:
            body["memories"] = memories
        if user is not None:
            body["user"] = user
        return self.client.post("/v1/chat/completions", json=body, headers=headers)

    def line_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.renderer.text_tokens(fact_line(text)))


def make_api(tmp_path: Path, *, mode: str = "kv", api_keys: dict[str, str | None] | None = None, with_memory: bool = True,
             errors: dict[str, BaseException] | None = None, hang: tuple[str, ...] = (), **cfg: Any) -> Api:
    tok = FakeTokenizer()
    renderer = PromptRenderer(tok)
    backend = FakeBackend()
    config = MemoryConfig(embedder="hashing", mode=mode, context_window=1, **cfg)
    service = MemoryService(config, FactStore(tmp_path / "m.sqlite3"), HashingEmbedder())
    store = FakeMemoryStoreHandle(service, errors=errors, hang=hang)
    frontend = OpenAIFrontend(model_id="m", renderer=renderer, backend=backend, max_model_len=1024, default_max_tokens=4,
                              metrics=RecordingMetrics())
    memory = MemoryFrontend(config, store, renderer, "m") if with_memory else None

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    app = build_openai_app(frontend, health, api_keys=api_keys, memory=memory)
    return Api(TestClient(app, raise_server_exceptions=False), backend, store, service, renderer)


@pytest.fixture
def api(tmp_path: Path) -> Api:
    return make_api(tmp_path)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    return body["error"]


def ids_of(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


# ---- /v1/memories ---------------------------------------------------------------------------------

def test_add_facts_returns_them_with_ids(api: Api) -> None:
    r = api.add("alice", ALICE_FACTS)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list"
    assert [m["text"] for m in body["data"]] == ALICE_FACTS
    assert all(re.fullmatch(r"[0-9a-f]{32}", m["id"]) and m["object"] == "memory" and m["source"] == "api" for m in body["data"])
    assert [m["seq"] for m in body["data"]] == [0, 1, 2]
    assert [f.text for f in api.service.list("alice")] == ALICE_FACTS


def test_add_from_messages_makes_one_fact_per_turn(api: Api) -> None:
    msgs = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "I adopted a dog"},
            {"role": "assistant", "content": "What is its name?"}, {"role": "user", "content": "  "},
            {"role": "user", "content": [{"type": "text", "text": "Rex"}]}]
    r = api.client.post("/v1/memories", json={"user": "alice", "messages": msgs}, headers={"x-session-id": "conv-9"})
    assert r.status_code == 200, r.text
    assert [(m["text"], m["source"]) for m in r.json()["data"]] == [
        ("User: I adopted a dog", "conv-9"), ("Assistant: What is its name?", "conv-9"), ("User: Rex", "conv-9")]
    error_of(api.client.post("/v1/memories", json={"user": "alice", "messages": [{"role": "system", "content": "x"}]}), 400)


def test_add_validation(api: Api) -> None:
    assert error_of(api.client.post("/v1/memories", json={"user": "alice"}), 400)["code"] == "invalid_value"
    assert error_of(api.client.post("/v1/memories", json={"user": "alice", "facts": ["a"], "messages": [{"role": "user", "content": "b"}]}), 400)
    assert error_of(api.add("alice", ["   "]), 400)["code"] == "invalid_memory"
    assert error_of(api.add("not a user!", ["x"]), 400)["code"] == "invalid_memory"
    assert api.service.list("alice") == []


def test_list_is_scoped_to_the_user(api: Api) -> None:
    alice = ids_of(api.add("alice", ALICE_FACTS))
    bob = ids_of(api.add("bob", ["Bob has a cat"]))
    assert ids_of(api.client.get("/v1/memories", params={"user": "alice"})) == alice
    assert ids_of(api.client.get("/v1/memories", headers={"x-baton-user": "bob"})) == bob
    assert ids_of(api.client.get("/v1/memories", params={"user": "alice", "limit": 1, "offset": 2})) == alice[2:]
    assert ids_of(api.client.get("/v1/memories", params={"user": "carol"})) == []
    assert error_of(api.client.get("/v1/memories", params={"user": "alice", "limit": 0}), 400)["param"] == "limit"
    assert error_of(api.client.get("/v1/memories", params={"user": "alice", "offset": 10**22}), 400)  # not SQLite's OverflowError


def test_get_and_delete_one(api: Api) -> None:
    a0, a1, _ = ids_of(api.add("alice", ALICE_FACTS))
    r = api.client.get(f"/v1/memories/{a1}", params={"user": "alice"})
    assert r.status_code == 200 and r.json()["text"] == "Alice moved to Lyon" and r.json()["id"] == a1
    r = api.client.delete(f"/v1/memories/{a0}", params={"user": "alice"})
    assert r.status_code == 200 and r.json() == {"id": a0, "object": "memory.deleted", "deleted": True}
    error_of(api.client.get(f"/v1/memories/{a0}", params={"user": "alice"}), 404)
    r = api.client.delete("/v1/memories", params={"user": "alice"})
    assert r.status_code == 200 and r.json() == {"object": "memory.deleted", "deleted": 2}
    assert api.service.list("alice") == []


def test_another_users_fact_answers_like_an_unknown_id(api: Api) -> None:
    (bob_id,) = ids_of(api.add("bob", ["Bob's PIN is 1234"]))
    api.add("alice", ALICE_FACTS)
    for method in ("get", "delete"):
        foreign = api.client.request(method, f"/v1/memories/{bob_id}", params={"user": "alice"})
        unknown = api.client.request(method, f"/v1/memories/{UNKNOWN}", params={"user": "alice"})
        ef, eu = error_of(foreign, 404), error_of(unknown, 404)
        assert ef["code"] == eu["code"] == "memory_not_found"
        assert {**ef, "message": ef["message"].replace(bob_id, "ID")} == {**eu, "message": eu["message"].replace(UNKNOWN, "ID")}
        leaked = foreign.text.replace(bob_id, "ID")  # the id the caller sent comes back; a random hex id can hold "1234"
        assert "1234" not in leaked and "bob" not in leaked.lower()
        assert foreign.headers.get("content-length") is None or len(foreign.content) == len(unknown.content)
    assert [f.text for f in api.service.list("bob")] == ["Bob's PIN is 1234"]  # not deleted
    r = api.client.delete("/v1/memories", params={"user": "alice"})
    assert r.json()["deleted"] == 3 and len(api.service.list("bob")) == 1


def test_malformed_id_is_400(api: Api) -> None:
    for bad in ("xyz", "0" * 31, "A" * 32, "0" * 33):
        e = error_of(api.client.get(f"/v1/memories/{bad}", params={"user": "alice"}), 400)
        assert e["code"] == "invalid_memory_id"
        error_of(api.client.delete(f"/v1/memories/{bad}", params={"user": "alice"}), 400)
    assert api.store.calls == []  # refused before the store


def test_a_user_is_required(api: Api) -> None:
    for r in (api.add(None, ["x"]), api.client.get("/v1/memories"), api.client.get(f"/v1/memories/{UNKNOWN}"),
              api.client.delete("/v1/memories"), api.chat({"k": 2}, user=None)):
        e = error_of(r, 400)
        assert (e["code"], e["param"]) == ("user_required", "user")
    assert api.store.calls == [] and api.backend.requests == []


def test_a_key_bound_to_a_user_decides_the_user(tmp_path: Path) -> None:
    api = make_api(tmp_path, api_keys={"ka": "alice", "kb": "bob", "kany": None})
    ka, kb, kany = ({"Authorization": f"Bearer {k}"} for k in ("ka", "kb", "kany"))
    assert api.add(None, ["Alice plays the violin"], headers=ka).status_code == 200
    assert [f.text for f in api.service.list("alice")] == ["Alice plays the violin"]
    assert api.add("alice", ["Alice likes tea"], headers=ka).status_code == 200  # naming oneself is fine
    (bob_id,) = ids_of(api.add(None, ["Bob's PIN is 1234"], headers=kb))
    for r in (api.add("bob", ["planted"], headers=ka),
              api.client.get("/v1/memories", params={"user": "bob"}, headers=ka),
              api.client.get("/v1/memories", headers={**ka, "x-baton-user": "bob"}),
              api.client.delete(f"/v1/memories/{bob_id}", params={"user": "bob"}, headers=ka),
              api.chat({"k": 2}, user="bob", headers=ka)):
        e = error_of(r, 403)
        assert (e["code"], e["type"]) == ("user_mismatch", "permission_error")
        assert "1234" not in r.text
    assert ids_of(api.client.get("/v1/memories", headers=kb)) == [bob_id]
    assert len(ids_of(api.client.get("/v1/memories", headers=ka))) == 2
    error_of(api.client.get(f"/v1/memories/{bob_id}", headers=ka), 404)
    # a key bound to no user lets the caller name one; no key at all is 401
    assert ids_of(api.client.get("/v1/memories", params={"user": "bob"}, headers=kany)) == [bob_id]
    assert error_of(api.client.get("/v1/memories", params={"user": "bob"}), 401)["code"] == "invalid_api_key"
    # chat with memories as alice's key recalls alice's facts only
    assert api.chat({"k": 5}, user=None, headers=ka).status_code == 200
    req = api.backend.last
    assert req.memory is not None and req.memory.user == "alice" and req.user == "alice"
    assert bob_id not in {f.fact_id for f in req.memory.facts}
    assert len(req.memory.facts) == 2


# ---- chat with memories ---------------------------------------------------------------------------

def test_chat_with_memories_in_kv_mode(api: Api) -> None:
    ids = ids_of(api.add("alice", ALICE_FACTS))
    api.add("bob", ["Bob has a dog named Rex too"])
    r = api.chat({"k": 2}, content="dog Rex violin")
    assert r.status_code == 200, r.text
    req = api.backend.last
    prompt = req.prompt_token_ids
    inj = req.memory
    assert inj is not None and inj.user == "alice" and inj.model == "m" and inj.window == 1
    assert [f.fact_id for f in inj.facts] == [ids[0], ids[2]]  # top 2, in (source, seq) order
    for f, text in zip(inj.facts, (ALICE_FACTS[0], ALICE_FACTS[2]), strict=True):
        assert prompt[f.start : f.start + len(f.token_ids)] == api.line_ids(text) == f.token_ids
    assert inj.facts[1].context_fact_ids == (ids[1],)  # w = 1: "Alice moved to Lyon" precedes it
    inj.check_integrity(len(prompt))
    assert req.cache_salt and req.cache_salt.startswith("baton-mem-")
    assert req.user == "alice"
    assert api.store.called("recall") == [("alice", "dog Rex violin", 2, 1, ())]


def test_chat_with_memories_in_prompt_mode(tmp_path: Path) -> None:
    api = make_api(tmp_path, mode="prompt")
    api.add("alice", ALICE_FACTS)
    assert api.chat({"k": 1}, content="violin").status_code == 200
    req = api.backend.last
    assert req.memory is None and req.cache_salt == tenant_salt("tenant", "alice")  # the user's salt (deployments/salt.py)
    line = api.line_ids("Alice plays the violin")
    prompt = req.prompt_token_ids
    assert any(prompt[i : i + len(line)] == line for i in range(len(prompt)))
    # the per-request mode overrides the config, both ways, with the same prompt tokens
    assert api.chat({"k": 1, "mode": "kv"}, content="violin").status_code == 200
    kv = api.backend.last
    assert kv.memory is not None and kv.cache_salt is not None and kv.prompt_token_ids == prompt


def test_prompt_mode_per_request_on_a_kv_store(api: Api) -> None:
    api.add("alice", ALICE_FACTS)
    assert api.chat({"k": 3, "mode": "prompt", "window": 0}).status_code == 200
    req = api.backend.last
    assert req.memory is None and req.cache_salt == tenant_salt("tenant", "alice")
    assert len(req.prompt_token_ids) > len(api.line_ids(ALICE_FACTS[0])) * 3


def test_chat_with_explicit_ids(api: Api) -> None:
    ids = ids_of(api.add("alice", ALICE_FACTS))
    (bob_id,) = ids_of(api.add("bob", ["Bob's PIN is 1234"]))
    assert api.chat({"ids": [ids[2], ids[1]]}).status_code == 200
    assert [f.fact_id for f in api.backend.last.memory.facts] == [ids[1], ids[2]]
    n = len(api.backend.requests)
    foreign = api.chat({"ids": [bob_id]})
    unknown = api.chat({"ids": [UNKNOWN]})
    ef, eu = error_of(foreign, 404), error_of(unknown, 404)
    assert ef["message"].replace(bob_id, "ID") == eu["message"].replace(UNKNOWN, "ID")
    assert "1234" not in foreign.text and len(api.backend.requests) == n


def test_chat_memories_validation(api: Api) -> None:
    api.add("alice", ALICE_FACTS)
    assert error_of(api.chat({"k": 101}), 400)["param"] == "memories.k"
    error_of(api.chat({"k": 0}), 400)
    error_of(api.chat({"k": 2, "ids": [UNKNOWN]}), 400)
    error_of(api.chat({"window": 65}), 400)
    error_of(api.chat({"mode": "text"}), 400)
    assert api.backend.requests == []
    assert api.chat({}).status_code == 200  # defaults: default_k facts
    assert len(api.backend.last.memory.facts) == 3


def test_chat_without_memories_is_untouched(api: Api) -> None:
    api.add("alice", ALICE_FACTS)
    assert api.chat(None).status_code == 200
    req = api.backend.last
    assert req.memory is None and req.cache_salt == tenant_salt("tenant", "alice")  # the tenant's, no memory salt
    assert api.store.called("recall") == []
    assert api.line_ids(ALICE_FACTS[0])[1] not in req.prompt_token_ids


def test_memories_on_a_frontend_without_a_store(tmp_path: Path) -> None:
    api = make_api(tmp_path, with_memory=False)
    e = error_of(api.chat({"k": 2}), 400)
    assert (e["code"], e["param"]) == ("memories_unavailable", "memories")
    assert api.backend.requests == []
    assert api.client.get("/v1/memories", params={"user": "alice"}).status_code == 404  # no such route
    assert api.chat(None).status_code == 200


def test_completions_refuse_memories(api: Api) -> None:
    r = api.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "user": "alice", "memories": {"k": 2}})
    assert error_of(r, 400)["code"] == "memories_unavailable"
    assert api.backend.requests == []


@pytest.mark.parametrize("error", [RuntimeError("actor died"), ConnectionError("refused"), TimeoutError()])
def test_a_failing_store_is_503_never_500(tmp_path: Path, error: BaseException) -> None:
    methods = ("add", "list", "get", "delete", "delete_all", "recall")
    api = make_api(tmp_path, errors={m: error for m in methods})
    for r in (api.add("alice", ["x"]), api.client.get("/v1/memories", params={"user": "alice"}),
              api.client.get(f"/v1/memories/{UNKNOWN}", params={"user": "alice"}),
              api.client.delete(f"/v1/memories/{UNKNOWN}", params={"user": "alice"}),
              api.client.delete("/v1/memories", params={"user": "alice"}), api.chat({"k": 2})):
        e = error_of(r, 503)
        assert e["type"] == "service_unavailable" and "actor died" not in e["message"]
        assert r.headers.get("retry-after")
    assert api.backend.requests == []


def test_a_hanging_store_times_out_as_503(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_api, "STORE_TIMEOUT_S", 0.05)
    api = make_api(tmp_path, hang=("list", "recall"))
    assert "in time" in error_of(api.client.get("/v1/memories", params={"user": "alice"}), 503)["message"]
    error_of(api.chat({"k": 2}), 503)
    assert api.backend.requests == []


# ---- which memories a reply recalled: x-baton-memories, x-baton-memory-mode ----------------------

def recalled_of(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    value = r.headers["x-baton-memories"]
    return value.split(",") if value else []


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_with_memories_names_the_recalled_facts_in_prompt_order(api: Api, stream: bool) -> None:
    ids = ids_of(api.add("alice", ALICE_FACTS))
    r = api.chat({"k": 2}, content="dog Rex violin", stream=stream)
    assert r.headers["content-type"].startswith("text/event-stream" if stream else "application/json")
    inj = api.backend.last.memory
    assert recalled_of(r) == [f.fact_id for f in inj.facts] == [ids[0], ids[2]]
    assert r.headers["x-baton-memory-mode"] == "kv" and r.headers["x-baton-memories-injected"] == "2"
    assert r.headers["x-baton-replica"] == "replica-a"  # beside the replica header, not instead of it
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("stream", [False, True])
def test_a_recompute_tail_injects_all_but_the_last_fact_and_says_how_many(tmp_path: Path, stream: bool) -> None:
    api = make_api(tmp_path, recompute_tail_tokens=1)  # one token: the last fact's whole line
    ids = ids_of(api.add("alice", ALICE_FACTS))
    r = api.chat({"k": 2}, content="dog Rex violin", stream=stream)
    inj, prompt = api.backend.last.memory, api.backend.last.prompt_token_ids
    assert recalled_of(r) == [ids[0], ids[2]]  # every recalled fact is named
    assert [f.fact_id for f in inj.facts] == [ids[0]]  # only the first is injected
    assert r.headers["x-baton-memory-mode"] == "kv" and r.headers["x-baton-memories-injected"] == "1"
    last = api.line_ids(ALICE_FACTS[2])
    assert prompt[inj.end : inj.end + len(last)] == last  # the last fact's tokens follow the injection, computed
    assert api.chat({"k": 2}, content="dog Rex violin", stream=stream).headers["x-baton-memories-injected"] == "1"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tail_longer_than_the_memories_computes_them_all(tmp_path: Path, stream: bool) -> None:
    api = make_api(tmp_path, recompute_tail_tokens=4096)
    ids_of(api.add("alice", ALICE_FACTS))
    r = api.chat({"k": 2}, content="dog Rex violin", stream=stream)
    assert len(recalled_of(r)) == 2 and api.backend.last.memory is None
    assert r.headers["x-baton-memory-mode"] == "prompt" and r.headers["x-baton-memories-injected"] == "0"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_mode_replies_name_the_facts_in_prompt_order(tmp_path: Path, stream: bool) -> None:
    api = make_api(tmp_path, mode="prompt")
    ids = ids_of(api.add("alice", ALICE_FACTS))
    r = api.chat({"ids": [ids[2], ids[0]]}, stream=stream)  # asked in another order
    prompt = api.backend.last.prompt_token_ids

    def at(text: str) -> int:
        line = api.line_ids(text)
        return next(i for i in range(len(prompt)) if prompt[i : i + len(line)] == line)

    assert recalled_of(r) == [ids[0], ids[2]] and at(ALICE_FACTS[0]) < at(ALICE_FACTS[2])
    assert r.headers["x-baton-memory-mode"] == "prompt"
    assert api.chat({"ids": [ids[1]], "mode": "kv"}, stream=stream).headers["x-baton-memory-mode"] == "kv"


@pytest.mark.parametrize("stream", [False, True])
def test_memories_asked_but_none_recalled_is_an_empty_header(api: Api, stream: bool) -> None:
    r = api.chat({"k": 3}, stream=stream)  # alice has no facts
    assert r.status_code == 200, r.text
    assert r.headers["x-baton-memories"] == "" and recalled_of(r) == []
    assert r.headers["x-baton-memory-mode"] == "prompt"  # nothing was injected
    assert api.backend.last.memory is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_without_memories_has_no_memory_headers(api: Api, stream: bool) -> None:
    api.add("alice", ALICE_FACTS)
    r = api.chat(None, stream=stream)
    assert r.status_code == 200, r.text
    assert "x-baton-memories" not in r.headers and "x-baton-memory-mode" not in r.headers
    c = api.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
    assert c.status_code == 200 and "x-baton-memories" not in c.headers


def test_a_refused_chat_with_memories_has_no_memory_headers(api: Api) -> None:
    r = api.chat({"k": 101})
    assert r.status_code == 400 and "x-baton-memories" not in r.headers


def test_memory_headers() -> None:
    from memory_store.layout import MemoryPrompt

    assert memory_api.memory_headers(None) == {}
    assert memory_api.memory_headers(MemoryPrompt((1, 2), None, None)) == {
        "x-baton-memories": "", "x-baton-memory-mode": "prompt", "x-baton-memories-injected": "0"}
    assert memory_api.memory_headers(MemoryPrompt((1,), None, None, ("b", "a")))["x-baton-memories"] == "b,a"


# ---- helpers --------------------------------------------------------------------------------------

def test_resolve_user() -> None:
    assert resolve_user(None, "bob", required=True) == "bob"
    assert resolve_user("alice", None, required=True) == "alice"
    assert resolve_user("alice", "alice", required=True) == "alice"
    assert resolve_user(None, None, required=False) is None
    with pytest.raises(APIError) as e:
        resolve_user("alice", "bob", required=False)
    assert e.value.status == 403 and e.value.code == "user_mismatch"
    for claim in (None, ""):
        with pytest.raises(APIError) as e:
            resolve_user(None, claim, required=True)
        assert e.value.status == 400 and e.value.code == "user_required"


def test_store_error_maps_causes() -> None:
    class RayTaskError(Exception):  # what a Ray actor call raises: the actor's exception as .cause
        def __init__(self, cause: BaseException):
            super().__init__("wrapped")
            self.cause = cause

    nf = store_error(RayTaskError(FactNotFound(["a" * 32])))
    assert (nf.status, nf.code, nf.param) == (404, "memory_not_found", "ids") and "a" * 32 in nf.message
    assert store_error(FactNotFound(["b" * 32])).status == 404
    bad = store_error(RayTaskError(InvalidInput("fact text must be a non-blank string")))
    assert (bad.status, bad.code) == (400, "invalid_memory") and "non-blank" in bad.message
    passthrough = APIError(418, "teapot")
    assert store_error(passthrough) is passthrough
    down = store_error(RayTaskError(RuntimeError("secret detail")))
    assert down.status == 503 and "secret detail" not in down.message and "RuntimeError" in down.message


def test_prepare_chat_sets_memory_and_salt_in_kv_mode_only(api: Api) -> None:
    from deployments.protocol import ChatCompletionRequest
    from memory_store.layout import MemoryPrompt, RecalledFact, memory_prompt

    frontend = OpenAIFrontend(model_id="m", renderer=api.renderer, backend=api.backend, max_model_len=1024,
                              default_max_tokens=4, metrics=RecordingMetrics())
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], memories={"k": 1}, user="claimed")
    facts = [RecalledFact("f1", "Alice plays the violin")]
    msgs = [{"role": "user", "content": "hi"}]
    kv = memory_prompt(api.renderer, msgs, facts, user="alice", model="m", window=0, inject=True)
    text = memory_prompt(api.renderer, msgs, facts, user="alice", model="m", window=0, inject=False)
    p = frontend.prepare_chat(body, "s1", kv).request
    assert p.prompt_token_ids == kv.token_ids and p.memory == kv.injection and p.cache_salt == tenant_salt("tenant", "alice", kv.cache_salt)
    assert p.user == "alice" and p.session_id == "s1"
    q = frontend.prepare_chat(body, "s1", text).request
    assert q.prompt_token_ids == kv.token_ids and q.memory is None and q.cache_salt == tenant_salt("tenant", "claimed")
    with pytest.raises(APIError) as e:  # memories asked for, but no memory prompt given
        frontend.prepare_chat(body, None)
    assert e.value.code == "memories_unavailable"
    assert frontend.prepare_chat(body, None, MemoryPrompt((5, 6, 7), None, None)).request.prompt_token_ids == (5, 6, 7)


def test_adding_facts_in_kv_mode_precomputes_their_kv_in_the_background(tmp_path: Path) -> None:
    class Encoder:
        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []
            self.encode_memories = self

        async def remote(self, *args: Any) -> None:
            self.calls.append(args)

    config = MemoryConfig(embedder="hashing", mode="kv", context_window=1)
    service = MemoryService(config, FactStore(tmp_path / "m.sqlite3"), HashingEmbedder())
    renderer = PromptRenderer(FakeTokenizer())
    encoder = Encoder()
    mem = MemoryFrontend(config, FakeMemoryStoreHandle(service), renderer, "m", encoder=encoder)
    from deployments.protocol import AddMemoriesRequest

    async def go() -> dict[str, Any]:
        out = await mem.add("alice", AddMemoriesRequest(facts=ALICE_FACTS[:2]), None)
        await asyncio.gather(*list(mem._background))
        return out

    out = asyncio.run(go())
    ids = [m["id"] for m in out["data"]]
    ((token_ids, injection),) = encoder.calls
    assert injection.user == "alice" and injection.window == 1 and [f.fact_id for f in injection.facts] == ids
    assert injection.facts[1].context_fact_ids == (ids[0],)
    injection.check_integrity(len(token_ids))
    assert not mem._background
    # prompt mode: nothing to precompute
    prompt_cfg = MemoryConfig(embedder="hashing", mode="prompt")
    enc2 = Encoder()
    mem2 = MemoryFrontend(prompt_cfg, FakeMemoryStoreHandle(service), renderer, "m", encoder=enc2)
    asyncio.run(mem2.add("alice", AddMemoriesRequest(facts=["x y"]), None))
    assert enc2.calls == []


def test_reserved_marker_in_a_chat_with_memories_is_400_not_500(api: Api) -> None:
    api.add("alice", ALICE_FACTS)
    r = api.chat({"k": 1}, content="hi \u0000baton-memory-block\u0000 there")
    e = error_of(r, 400)
    assert e["param"] == "messages"
    assert api.backend.requests == []
    assert api.store.called("recall") == []
    assert api.chat(None, content="hi \u0000baton-memory-block\u0000 there").status_code == 200  # harmless without memories
