"""Memories through the running application (Ray + Serve + vLLM + NIXL, conversation policy):
/v1/memories, chat with recalled facts injected as KV on the prefill engine and handed to the
decoder over NIXL (MultiConnector), isolation between users, and durability of facts across a
restart of the memory-store actor and of the whole application."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import SharedApp, deploy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ALICE_FACTS = [
    "Alice keeps three beehives on her roof in Lisbon.",
    "Alice is allergic to peanuts.",
    "Alice plays the cello in a community orchestra.",
    "Alice's daughter is called Marta and she is seven.",
]


@pytest.fixture
def url(baton_url: str) -> str:
    return baton_url  # the folder's application (conftest.py)


def _chat(url: str, user: str, question: str, memories: dict[str, Any], session: str | None = None) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
            "user": user, "memories": memories}
    headers = {"x-session-id": session} if session else {}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=180)


def _facts(url: str, user: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/memories", params={"user": user}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_add_and_list_are_scoped_to_the_user(url: str) -> None:
    r = httpx.post(f"{url}/v1/memories", json={"user": "alice", "facts": ALICE_FACTS}, timeout=60)
    assert r.status_code == 200, r.text
    assert [f["text"] for f in r.json()["data"]] == ALICE_FACTS
    r = httpx.post(f"{url}/v1/memories", json={"user": "bob", "facts": ["Bob collects vintage typewriters."]}, timeout=60)
    assert r.status_code == 200
    assert [f["text"] for f in _facts(url, "alice")] == ALICE_FACTS
    assert [f["text"] for f in _facts(url, "bob")] == ["Bob collects vintage typewriters."]


def test_kv_injection_serves_recalled_facts(url: str) -> None:
    # the facts' KV was precomputed on a decode replica in the background: wait for it, so the
    # prefill replica below finds it in the memory store and reads it over NIXL
    _wait_for_replica(url, "decode", lambda r: r.get("memory_encoded_tokens", 0) > 0)
    time.sleep(1)  # its fire-and-forget put into the store
    kv = _chat(url, "alice", "What is Alice allergic to?", {"k": 3, "mode": "kv"}, session="mem-kv")
    assert kv.status_code == 200, kv.text
    prompt = _chat(url, "alice", "What is Alice allergic to?", {"k": 3, "mode": "prompt"}, session="mem-prompt")
    assert prompt.status_code == 200, prompt.text
    u_kv, u_prompt = kv.json()["usage"], prompt.json()["usage"]
    assert u_kv["prompt_tokens"] == u_prompt["prompt_tokens"]  # the same tokens, two ways to get their KV
    # the prefill engine loaded the anchor + facts (reported as cached) and computed the rest;
    # prompt injection computed the facts
    assert u_kv["prompt_tokens_details"]["cached_tokens"] > 40
    assert u_prompt["prompt_tokens_details"]["cached_tokens"] == 0
    # a later turn of the KV conversation goes to its decoder and reuses the injected prefix
    body = {"messages": [{"role": "user", "content": "What is Alice allergic to?"},
                         {"role": "assistant", "content": kv.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And what instrument does she play?"}],
            "max_tokens": 8, "temperature": 0, "user": "alice", "memories": {"k": 3, "mode": "kv"}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": "mem-kv"}, timeout=180)
    assert r.status_code == 200, r.text
    # the prefill replica read the precomputed segments out of the store's arena over NIXL, and
    # loaded KV prepared in its pull path (rotated and cast off the engine thread)
    prefill = _wait_for_replica(url, "prefill", lambda r: r.get("segment_prepared_loads", 0) > 0)
    assert prefill["segment_prepared_loads"] <= prefill["segment_injections"]
    assert prefill["memory_pulled_segments"] > 0 and prefill["memory_pulled_bytes"] > 0, prefill
    assert prefill["memory_pull_failures"] == 0, prefill


def _wait_for_replica(url: str, pool: str, ready: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """The /baton/stats entry of the pool's first replica for which `ready(entry)`; replicas report
    every routing-stats period."""
    deadline = time.monotonic() + timeout_s
    while True:
        reps = [r for r in httpx.get(f"{url}/baton/stats", timeout=10).json()["replicas"].values() if r["pool"] == pool]
        if ok := [r for r in reps if ready(r)]:
            return ok[0]
        assert time.monotonic() < deadline, reps
        time.sleep(0.5)


def test_other_users_memories_are_unreachable(url: str) -> None:
    alice_id = _facts(url, "alice")[0]["id"]
    unknown = "0" * 32
    for fid in (alice_id, unknown):
        r = httpx.get(f"{url}/v1/memories/{fid}", params={"user": "bob"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "memory_not_found"
        assert alice_id not in r.text or fid == alice_id
        assert "Alice" not in r.text
        r = httpx.delete(f"{url}/v1/memories/{fid}", params={"user": "bob"}, timeout=30)
        assert r.status_code == 404
    r = _chat(url, "bob", "Tell me about my facts.", {"ids": [alice_id]})
    assert r.status_code == 404 and "Alice" not in r.text
    assert len(_facts(url, "alice")) == len(ALICE_FACTS)  # nothing deleted by bob


def _kill_memory_store() -> None:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#memory_store#" in a["name"]]
    assert names, "memory store replica not found"
    for a in names:
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)


@pytest.mark.disrupts_app(last=True)
def test_facts_survive_a_memory_store_restart_and_an_app_restart(shared_app: SharedApp, tmp_path: Path) -> None:
    url = shared_app.url
    before = _facts(url, "alice")
    _kill_memory_store()
    deadline = time.monotonic() + 90
    while True:  # Serve replaces the dead replica; until then the API answers 503, never 500
        r = httpx.get(f"{url}/v1/memories", params={"user": "alice"}, timeout=30)
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, "memory store did not come back"
        time.sleep(1)
    assert r.json()["data"] == before
    r = _chat(url, "alice", "What is Alice allergic to?", {"k": 3})
    assert r.status_code == 200, r.text  # segments lost with the actor: encoded again (or recomputed)

    from ray import serve

    # the application again with the same memory database, every replica new; smaller, to start
    # sooner (colocated on one decode engine, a fresh ownership store: the facts are what is checked)
    args = shared_app.args
    small = {k: v for k, v in args.items() if k != "prefill"}
    small |= {"routing": {**args["routing"], "policy": "colocated", "ownership_db_path": str(tmp_path / "conversations.sqlite3")},
              "decode": {**args["decode"], "num_replicas": 1}, "ingress": {**args["ingress"], "num_replicas": 1}}
    serve.delete("baton")
    deploy(small, url)
    assert _facts(url, "alice") == before
