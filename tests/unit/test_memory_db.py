"""FactStore: durability, atomicity, per-user isolation, preceding(), validation."""

import itertools
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memory_store.config import MemoryConfig
from memory_store.db import SCHEMA_VERSION, FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.errors import (
    FactNotFound,
    InvalidInput,
    SchemaVersionError,
    StoreCorrupted,
)

EMB = HashingEmbedder()
ROOT = Path(__file__).resolve().parents[2]


def add(store, user, texts, source="api"):
    return store.add(user, texts, source, EMB.embed(texts))


@pytest.fixture
def store(tmp_path):
    ticks = itertools.count(1000)
    with FactStore(tmp_path / "m.sqlite3", clock=lambda: float(next(ticks))) as s:
        yield s
        s.check_integrity()


def test_add_get_list_roundtrip(store):
    facts = add(store, "alice", ["Alice has a dog named Rex.", "Alice lives in Lyon."])
    assert [f.seq for f in facts] == [0, 1] and {f.user for f in facts} == {"alice"}
    assert len({f.id for f in facts}) == 2 and all(len(f.id) == 32 for f in facts)
    got = store.get("alice", [facts[1].id, facts[0].id, facts[1].id])
    assert [f.text for f in got] == ["Alice lives in Lyon.", "Alice has a dog named Rex."]
    np.testing.assert_allclose(got[1].embedding, EMB.embed(["Alice has a dog named Rex."])[0], atol=1e-6)
    assert got[0] == facts[1]  # equality ignores the embedding array
    assert [f.id for f in store.list("alice", limit=1, offset=1)] == [facts[1].id]
    assert store.count("alice") == 2 and store.count("bob") == 0


def test_seq_continues_per_source_and_embeddings_are_normalized(store):
    add(store, "alice", ["a one", "a two"], source="conv-1")
    later = add(store, "alice", ["a three"], source="conv-1")
    other = add(store, "alice", ["b one"], source="conv-2")
    bob = add(store, "bob", ["bob one"], source="conv-1")
    assert (later[0].seq, other[0].seq, bob[0].seq) == (2, 0, 0)
    raw = np.array([[3.0, 4.0] + [0.0] * 382], dtype=np.float32)
    (f,) = store.add("alice", ["scaled"], "api", raw)
    assert f.embedding[:2].tolist() == pytest.approx([0.6, 0.8])
    ids, matrix = store.all_embeddings("alice")
    assert matrix.shape == (5, 384) and ids[-1] == f.id
    np.testing.assert_allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-5)


def test_durable_across_reopen(tmp_path):
    path = tmp_path / "m.sqlite3"
    with FactStore(path) as s:
        facts = add(s, "alice", ["kept across restarts"])
    with FactStore(path) as s:
        (back,) = s.get("alice", [facts[0].id])
        assert back.text == "kept across restarts"
        np.testing.assert_array_equal(back.embedding, facts[0].embedding)
        assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_durable_when_the_process_dies_without_closing(tmp_path):
    path = tmp_path / "m.sqlite3"
    code = ("import os, sys; from memory_store.db import FactStore; from memory_store.embedder import "
            "HashingEmbedder; s = FactStore(sys.argv[1]); "
            "f = s.add('alice', ['written then killed'], 'api', HashingEmbedder().embed(['x'])); "
            "print(f[0].id, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    with FactStore(path) as s:
        assert [f.text for f in s.get("alice", [out.stdout.strip()])] == ["written then killed"]


def test_add_is_all_or_nothing(tmp_path):
    ids = iter(["id-a", "id-b", "id-a"])  # the third insert collides with the first
    with FactStore(tmp_path / "m.sqlite3", new_id=lambda: next(ids)) as s:
        with pytest.raises(sqlite3.IntegrityError):
            add(s, "alice", ["one", "two", "three"])
        assert s.count("alice") == 0
        with pytest.raises(InvalidInput):  # validation fails before anything is written
            s.add("alice", ["ok", "   "], "api", EMB.embed(["ok", "x"]))
        assert s.count("alice") == 0
        s.check_integrity()


def test_isolation_foreign_ids_look_unknown(store):
    (a,) = add(store, "alice", ["alice's secret"])
    with pytest.raises(FactNotFound) as foreign:
        store.get("bob", [a.id])
    with pytest.raises(FactNotFound) as unknown:
        store.get("bob", ["0" * 32])
    assert foreign.value.ids == (a.id,) and unknown.value.ids == ("0" * 32,)
    assert type(foreign.value) is type(unknown.value)
    assert str(foreign.value).replace(a.id, "X") == str(unknown.value).replace("0" * 32, "X")
    assert "alice" not in str(foreign.value)
    assert store.delete("bob", [a.id]) == 0
    with pytest.raises(FactNotFound):
        store.delete("bob", [a.id], missing_ok=False)
    assert store.delete_all("bob") == 0
    assert store.list("bob") == [] and store.all_embeddings("bob")[0] == []
    assert store.preceding("bob", a, 5) == []
    assert store.get("alice", [a.id])[0].text == "alice's secret"


def test_get_reports_every_missing_id(store):
    (a,) = add(store, "alice", ["here"])
    with pytest.raises(FactNotFound) as err:
        store.get("alice", ["nope1", a.id, "nope2"])
    assert err.value.ids == ("nope1", "nope2")


def test_delete_own_and_strict_delete_is_atomic(store):
    facts = add(store, "alice", ["one", "two", "three"])
    with pytest.raises(FactNotFound):
        store.delete("alice", [facts[0].id, "missing"], missing_ok=False)
    assert store.count("alice") == 3
    assert store.delete("alice", [facts[0].id, "missing"]) == 1
    assert [f.text for f in store.list("alice")] == ["two", "three"]
    assert store.delete_all("alice") == 2 and store.count("alice") == 0


def test_preceding(store):
    facts = add(store, "alice", [f"turn {i}" for i in range(5)], source="conv")
    add(store, "alice", ["other source"], source="other")
    add(store, "bob", ["bob turn"], source="conv")
    assert [f.text for f in store.preceding("alice", facts[4], 2)] == ["turn 2", "turn 3"]
    assert [f.text for f in store.preceding("alice", facts[1], 3)] == ["turn 0"]
    assert store.preceding("alice", facts[0], 2) == []
    assert store.preceding("alice", facts[3], 0) == []
    store.delete("alice", [facts[2].id])
    assert [f.text for f in store.preceding("alice", facts[4], 2)] == ["turn 1", "turn 3"]


@pytest.mark.parametrize("user", ["", "a b", "-lead", "x" * 129, "é"])
def test_bad_user(store, user):
    with pytest.raises(InvalidInput, match="user"):
        add(store, user, ["text"])


def test_bad_inputs(tmp_path):
    with FactStore(tmp_path / "m.sqlite3", max_fact_chars=10, max_facts_per_request=2) as s:
        with pytest.raises(InvalidInput, match="limit is 10"):
            add(s, "alice", ["x" * 11])
        with pytest.raises(InvalidInput, match="non-blank"):
            add(s, "alice", [""])
        with pytest.raises(InvalidInput, match="limit is 2"):
            add(s, "alice", ["a", "b", "c"])
        with pytest.raises(InvalidInput, match="no facts"):
            s.add("alice", [], "api", np.zeros((0, 384), np.float32))
        with pytest.raises(InvalidInput, match="not one string"):
            s.add("alice", "abc", "api", EMB.embed(["abc"]))
        with pytest.raises(InvalidInput, match="shape"):
            s.add("alice", ["a"], "api", np.ones((1, 3), np.float32))
        with pytest.raises(InvalidInput, match="zero"):
            s.add("alice", ["a"], "api", np.zeros((1, 384), np.float32))
        with pytest.raises(InvalidInput, match="source"):
            add(s, "alice", ["a"], source=" ")
        with pytest.raises(InvalidInput, match="limit is 2"):
            s.get("alice", ["a", "b", "c"])
        assert s.get("alice", []) == [] and s.count("alice") == 0


def test_schema_and_dim_checks(tmp_path):
    path = tmp_path / "m.sqlite3"
    FactStore(path).close()
    with pytest.raises(InvalidInput, match="384-dim"):
        FactStore(path, dim=8)
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    con.close()
    with pytest.raises(SchemaVersionError):
        FactStore(path)


def test_check_integrity_catches_a_bad_embedding(store):
    (f,) = add(store, "alice", ["x"])
    store._db.execute("UPDATE facts SET embedding=? WHERE id=?", (b"\0" * 8, f.id))
    with pytest.raises(StoreCorrupted, match="not 384"):
        store.check_integrity()
    store._db.execute("UPDATE facts SET embedding=? WHERE id=?",
                      (np.full(384, 2.0, "<f4").tobytes(), f.id))
    with pytest.raises(StoreCorrupted, match="norm"):
        store.check_integrity()
    store.delete_all("alice")


def test_config_defaults_and_forbid(tmp_path):
    cfg = MemoryConfig()
    assert (cfg.default_k, cfg.max_k, cfg.context_window, cfg.mode) == (5, 100, 2, "kv")
    assert cfg.resolved_db_path(tmp_path) == tmp_path / ".cache/baton/memories.sqlite3"
    assert MemoryConfig(db_path="/abs/x.db").resolved_db_path(tmp_path) == Path("/abs/x.db")
    assert cfg.segment_capacity_bytes == 256 * 2**20
    with pytest.raises(ValueError, match="context_windw"):
        MemoryConfig(context_windw=3)
    with pytest.raises(ValueError):
        MemoryConfig(context_window=-1)
    with pytest.raises(ValueError, match="default_k"):
        MemoryConfig(default_k=10, max_k=5)
    with pytest.raises(ValueError):
        MemoryConfig(mode="text")
    with pytest.raises(ValueError):
        cfg.default_k = 3


def test_concurrent_adds_to_one_source_get_distinct_seqs(store):
    import threading

    def worker(i):
        for j in range(5):
            add(store, "alice", [f"t{i}-{j}", f"u{i}-{j}"], source="conv")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = sorted(f.seq for f in store.list("alice", limit=1000))
    assert seqs == list(range(40))
