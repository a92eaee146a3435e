"""Idempotent adds (memory_store/idempotency.py, FactStore.add, POST /v1/memories with an
Idempotency-Key): a retry never duplicates facts, a reused key with another body is refused, keys
are per user, survive a restart and expire; and the schema migration from version 1 that adds them.
Real SQLite in tmp_path, HashingEmbedder, FastAPI's TestClient over a real MemoryService."""
from __future__ import annotations

import pickle
import sqlite3
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fakes import FakeBackend, FakeMemoryStoreHandle, FakeTokenizer
from fastapi.testclient import TestClient

from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.memory_api import MemoryFrontend
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.errors import IdempotencyKeyReused, InvalidInput
from memory_store.schema import MIGRATIONS, SCHEMA_VERSION
from memory_store.store import MemoryService

EMB = HashingEmbedder()
FACTS = ["Alice adopted a dog named Rex", "Alice moved to Lyon"]


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def open_store(path: Path, clock: Clock | None = None, **kw: Any) -> FactStore:
    return FactStore(path, clock=clock or Clock(), **kw)


def add(store: FactStore, user: str, texts: list[str], key: str | None, source: str = "api") -> list[str]:
    return [f.id for f in store.add(user, texts, source, EMB.embed(texts), key)]


# ---- FactStore ------------------------------------------------------------------------------------

def test_same_key_and_request_adds_once_and_answers_the_same_ids(tmp_path: Path) -> None:
    with open_store(tmp_path / "m.sqlite3") as s:
        first = add(s, "alice", FACTS, "k-1")
        assert add(s, "alice", FACTS, "k-1") == first
        assert add(s, "alice", FACTS, "k-1") == first
        assert s.count("alice") == 2
        assert len(add(s, "alice", FACTS, "k-2")) == 2 and s.count("alice") == 4  # a new key is a new request
        assert len(add(s, "alice", FACTS, None)) == 2 and s.count("alice") == 6  # no key: no protection
        s.check_integrity()


def test_same_key_with_another_request_is_refused_and_adds_nothing(tmp_path: Path) -> None:
    with open_store(tmp_path / "m.sqlite3") as s:
        add(s, "alice", FACTS, "k-1")
        for texts, source in ((["something else"], "api"), (FACTS[:1], "api"), (FACTS, "conv-9")):
            with pytest.raises(IdempotencyKeyReused):
                add(s, "alice", texts, "k-1", source)
        assert s.count("alice") == 2


def test_keys_are_per_user(tmp_path: Path) -> None:
    with open_store(tmp_path / "m.sqlite3") as s:
        a = add(s, "alice", FACTS, "shared-key")
        b = add(s, "bob", ["Bob has a cat"], "shared-key")  # another body, another user: no conflict
        c = add(s, "carol", FACTS, "shared-key")  # the same body, another user: her own facts
        assert len({*a, *b, *c}) == 5
        assert (s.count("alice"), s.count("bob"), s.count("carol")) == (2, 1, 2)
        assert add(s, "bob", ["Bob has a cat"], "shared-key") == b


def test_a_key_survives_a_store_restart(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite3"
    with open_store(path) as s:
        first = add(s, "alice", FACTS, "k-1")
    with open_store(path) as s:  # the memory-store actor restarted on the same file
        assert add(s, "alice", FACTS, "k-1") == first and s.count("alice") == 2
        with pytest.raises(IdempotencyKeyReused):
            add(s, "alice", ["other"], "k-1")


def test_keys_expire_after_the_ttl(tmp_path: Path) -> None:
    clock = Clock()
    with open_store(tmp_path / "m.sqlite3", clock, idempotency_ttl_s=100.0) as s:
        first = add(s, "alice", FACTS, "k-1")
        clock.t += 99.0
        assert add(s, "alice", FACTS, "k-1") == first
        clock.t += 1.0  # 100 s after it was recorded: forgotten
        again = add(s, "alice", FACTS, "k-1")
        assert not set(again) & set(first) and s.count("alice") == 4
        assert add(s, "alice", FACTS, "k-1") == again  # recorded anew


def test_deleting_facts_keeps_the_key_and_deleting_all_forgets_it(tmp_path: Path) -> None:
    with open_store(tmp_path / "m.sqlite3") as s:
        f0, f1 = add(s, "alice", FACTS, "k-1")
        s.delete("alice", [f0])
        assert add(s, "alice", FACTS, "k-1") == [f1]  # the facts left; the deleted one is not re-added
        assert s.count("alice") == 1
        s.delete_all("alice")
        assert len(add(s, "alice", FACTS, "k-1")) == 2 and s.count("alice") == 2  # nothing of hers is left to duplicate


def test_concurrent_retries_add_once(tmp_path: Path) -> None:
    with open_store(tmp_path / "m.sqlite3") as s:
        results: list[list[str]] = []
        threads = [threading.Thread(target=lambda: results.append(add(s, "alice", FACTS, "k-1"))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 8 and all(r == results[0] for r in results) and s.count("alice") == 2


def test_bad_keys_are_refused_before_anything_is_stored(tmp_path: Path) -> None:
    with open_store(tmp_path / "m.sqlite3") as s:
        for bad in ("", "x" * 256, "has space", "tab\t", "caf\u00e9", 5):
            with pytest.raises(InvalidInput, match="Idempotency-Key"):
                add(s, "alice", FACTS, bad)  # type: ignore[arg-type]
        assert s.count("alice") == 0
        assert len(add(s, "alice", FACTS, "x" * 255)) == 2


def test_the_reuse_error_crosses_ray_intact() -> None:
    e = pickle.loads(pickle.dumps(IdempotencyKeyReused("k-1")))
    assert isinstance(e, IdempotencyKeyReused) and e.key == "k-1" and "different request" in str(e)


def test_migrates_a_version_1_file_keeping_its_facts(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite3"
    con = sqlite3.connect(path, isolation_level=None)
    for stmt in filter(str.strip, MIGRATIONS[1].split(";")):
        con.execute(stmt)
    vec = np.zeros(384, "<f4")
    vec[0] = 1.0
    con.execute("INSERT INTO meta VALUES ('dim', '384')")
    con.execute("INSERT INTO facts VALUES (?, 'alice', 'api', 0, 'kept', 1.0, ?)", ("a" * 32, vec.tobytes()))
    con.execute("PRAGMA user_version=1")
    con.close()
    with open_store(path) as s:
        assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        assert [f.text for f in s.get("alice", ["a" * 32])] == ["kept"]
        store_id = s.store_id
        assert len(store_id) == 32
        first = add(s, "alice", ["new"], "k-1")
        assert add(s, "alice", ["new"], "k-1") == first and s.count("alice") == 2
        s.check_integrity()
    with open_store(path) as s:  # migrated once: the same store id, the same keys
        assert s.store_id == store_id and add(s, "alice", ["new"], "k-1") == first


# ---- POST /v1/memories with Idempotency-Key --------------------------------------------------------

def make_client(tmp_path: Path) -> tuple[TestClient, MemoryService]:
    renderer = PromptRenderer(FakeTokenizer())
    config = MemoryConfig(embedder="hashing", mode="prompt")
    service = MemoryService(config, FactStore(tmp_path / "m.sqlite3"), HashingEmbedder())
    frontend = OpenAIFrontend(model_id="m", renderer=renderer, backend=FakeBackend(), max_model_len=1024,
                              default_max_tokens=4, metrics=RecordingMetrics())

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    memory = MemoryFrontend(config, FakeMemoryStoreHandle(service), renderer, "m")
    app = build_openai_app(frontend, health, memory=memory)
    return TestClient(app, raise_server_exceptions=False), service


def test_api_retry_with_the_same_key_answers_the_same_response(tmp_path: Path) -> None:
    client, svc = make_client(tmp_path)
    body = {"user": "alice", "facts": FACTS}
    first = client.post("/v1/memories", json=body, headers={"Idempotency-Key": "req-7"})
    again = client.post("/v1/memories", json=body, headers={"idempotency-key": "req-7"})
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and len(first.json()["data"]) == 2
    assert [f.text for f in svc.list("alice")] == FACTS
    # the same key from another user is that user's own request
    bob = client.post("/v1/memories", json={"user": "bob", "facts": FACTS}, headers={"Idempotency-Key": "req-7"})
    assert bob.status_code == 200 and {m["id"] for m in bob.json()["data"]}.isdisjoint(m["id"] for m in first.json()["data"])


def test_api_reused_key_with_another_body_is_422(tmp_path: Path) -> None:
    client, svc = make_client(tmp_path)
    client.post("/v1/memories", json={"user": "alice", "facts": FACTS}, headers={"Idempotency-Key": "req-7"})
    r = client.post("/v1/memories", json={"user": "alice", "facts": ["Alice hates dogs"]}, headers={"Idempotency-Key": "req-7"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"], err["param"]) == ("idempotency_key_reused", "invalid_request_error", "Idempotency-Key")
    assert [f.text for f in svc.list("alice")] == FACTS


def test_api_malformed_key_is_400_and_reaches_no_store(tmp_path: Path) -> None:
    client, svc = make_client(tmp_path)
    r = client.post("/v1/memories", json={"user": "alice", "facts": FACTS}, headers={"Idempotency-Key": "x" * 256})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_idempotency_key"
    assert svc.list("alice") == []
