"""MemoryService (memory_store/store.py) over a real SQLite FactStore in tmp_path and the
HashingEmbedder (texts sharing words score higher): facts, recall, isolation, segment cache."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from memory_store.config import MemoryConfig
from memory_store.db import FactStore
from memory_store.embedder import HashingEmbedder
from memory_store.errors import FactNotFound, InvalidInput
from memory_store.segment_cache import SegmentKey
from memory_store.store import FactView, MemoryService

M = "m"


@dataclass(frozen=True)
class Blob:
    nbytes: int
    tag: str = ""


def make(path: Path, **cfg) -> MemoryService:
    ticks = itertools.count(1000)
    db = FactStore(path, clock=lambda: float(next(ticks)))
    return MemoryService(MemoryConfig(embedder="hashing", **cfg), db, HashingEmbedder())


@pytest.fixture
def svc(tmp_path: Path):
    s = make(tmp_path / "m.sqlite3")
    yield s
    s.check_integrity()


def fk(fid: str, window: int = 0) -> SegmentKey:
    return SegmentKey.for_fact(fid, window, M)


# ---- facts ----------------------------------------------------------------------------------------

def test_add_list_get_delete(svc: MemoryService) -> None:
    a = svc.add("alice", ["Alice has a dog", "Alice lives in Lyon"], "conv-1")
    assert [type(f) for f in a] == [FactView, FactView]
    assert [(f.text, f.source, f.seq) for f in a] == [("Alice has a dog", "conv-1", 0), ("Alice lives in Lyon", "conv-1", 1)]
    assert a[0].as_json() == {"id": a[0].id, "object": "memory", "text": "Alice has a dog", "source": "conv-1", "seq": 0,
                              "created_at": int(a[0].created_at)}
    svc.add("bob", ["Bob has a cat"])
    assert [f.id for f in svc.list("alice")] == [a[0].id, a[1].id]
    assert [f.id for f in svc.list("alice", limit=1, offset=1)] == [a[1].id]
    assert svc.get("alice", [a[1].id]) == [a[1]]
    assert svc.delete("alice", [a[0].id]) == 1
    assert [f.id for f in svc.list("alice")] == [a[1].id]
    with pytest.raises(FactNotFound):
        svc.get("alice", [a[0].id])
    assert svc.delete_all("alice") == 1
    assert svc.list("alice") == [] and len(svc.list("bob")) == 1


def test_add_validates(svc: MemoryService) -> None:
    with pytest.raises(InvalidInput):
        svc.add("alice", [])
    with pytest.raises(InvalidInput):
        svc.add("alice", ["   "])
    with pytest.raises(InvalidInput):
        svc.add("not a user!", ["x"])
    assert svc.list("alice") == []


def test_foreign_ids_look_exactly_like_unknown_ids(svc: MemoryService) -> None:
    (bob_fact,) = svc.add("bob", ["Bob's secret is 42"])
    unknown = "0" * 32
    errors = {}
    for name, fid in (("foreign", bob_fact.id), ("unknown", unknown)):
        for op in (lambda i: svc.get("alice", [i]), lambda i: svc.delete("alice", [i]),
                   lambda i: svc.recall("alice", "", 1, 0, [i])):
            with pytest.raises(FactNotFound) as e:
                op(fid)
            errors.setdefault(name, []).append(str(e.value).replace(fid, "<id>"))
    assert errors["foreign"] == errors["unknown"]
    assert svc.get("bob", [bob_fact.id])[0].text == "Bob's secret is 42"  # untouched


# ---- recall ---------------------------------------------------------------------------------------

def facts_for_recall(svc: MemoryService) -> dict[str, FactView]:
    conv = svc.add("alice", ["Alice adopted a dog named Rex", "Alice moved to Lyon", "Alice plays the violin",
                             "Rex the dog likes the park", "Alice bakes bread"], "conv-2")
    api = svc.add("alice", ["the dog Rex is brown"], "api")
    svc.add("bob", ["Bob has a dog named Rex too"], "conv-2")
    return {f.text: f for f in conv + api}


def test_recall_top_k_by_shared_words_in_layout_order(svc: MemoryService) -> None:
    by_text = facts_for_recall(svc)
    r = svc.recall("alice", "dog Rex", 3, 0)
    texts = [f.text for f in r.facts]
    assert set(texts) == {"Alice adopted a dog named Rex", "Rex the dog likes the park", "the dog Rex is brown"}
    # ordered by (source, seq): "api" < "conv-2", then seq
    assert texts == ["the dog Rex is brown", "Alice adopted a dog named Rex", "Rex the dog likes the park"]
    assert [f.fact_id for f in r.facts] == [by_text[t].id for t in texts]
    assert len(r.scores) == 3 and all(0 < s <= 1 for s in r.scores)
    unrelated = svc.recall("alice", "violin", 1, 0)
    assert [f.text for f in unrelated.facts] == ["Alice plays the violin"]
    assert all(f.context == () for f in r.facts)  # window 0


def test_recall_carries_the_window_predecessors(svc: MemoryService) -> None:
    by_text = facts_for_recall(svc)
    r = svc.recall("alice", "Rex the dog likes the park", 1, 2)
    (f,) = r.facts
    assert f.text == "Rex the dog likes the park"
    assert f.context == ("Alice moved to Lyon", "Alice plays the violin")
    assert f.context_fact_ids == (by_text["Alice moved to Lyon"].id, by_text["Alice plays the violin"].id)
    first = svc.recall("alice", "", 1, 3, [by_text["Alice adopted a dog named Rex"].id]).facts[0]
    assert first.context == ()  # the first of its source has none
    wide = svc.recall("alice", "", 1, 64, [by_text["Alice bakes bread"].id]).facts[0]
    assert len(wide.context) == 4 and "the dog Rex is brown" not in wide.context  # same source only


def test_recall_explicit_ids(svc: MemoryService) -> None:
    by_text = facts_for_recall(svc)
    ids = [by_text["Alice bakes bread"].id, by_text["the dog Rex is brown"].id, by_text["Alice moved to Lyon"].id]
    r = svc.recall("alice", "anything", 1, 0, ids)  # k is ignored with ids
    assert [f.text for f in r.facts] == ["the dog Rex is brown", "Alice moved to Lyon", "Alice bakes bread"]
    assert r.scores == (1.0, 1.0, 1.0)


def test_recall_limits(svc: MemoryService) -> None:
    facts_for_recall(svc)
    for k in (0, 101):
        with pytest.raises(InvalidInput, match="k"):
            svc.recall("alice", "dog", k, 0)
    for window in (-1, 65):
        with pytest.raises(InvalidInput, match="window"):
            svc.recall("alice", "dog", 1, window)
    assert len(svc.recall("alice", "dog", 100, 0).facts) == 6  # k above the count: all of them
    assert svc.recall("carol", "dog", 5, 0).facts == ()  # a user with no facts
    assert len(svc.recall("alice", "", 2, 0).facts) == 2  # an empty query still recalls


def test_recall_never_returns_another_users_fact(svc: MemoryService) -> None:
    facts_for_recall(svc)
    bob_ids = {f.id for f in svc.list("bob")}
    r = svc.recall("alice", "Bob has a dog named Rex too", 100, 64)
    assert not bob_ids & {f.fact_id for f in r.facts}
    assert not bob_ids & {i for f in r.facts for i in f.context_fact_ids}


# ---- encoded segments -----------------------------------------------------------------------------

def test_segments_put_get_and_ownership(svc: MemoryService) -> None:
    a1, a2 = svc.add("alice", ["a one", "a two"], "c")
    (b1,) = svc.add("bob", ["b one"])
    assert svc.put_segments("alice", [(fk(a1.id), Blob(10, "a1"), ()), (fk(a2.id, 1), Blob(10, "a2"), (a1.id,))]) == 2
    got = svc.get_segments("alice", [fk(a1.id), fk(a2.id, 1), fk(a2.id, 0)])
    assert got == {fk(a1.id): Blob(10, "a1"), fk(a2.id, 1): Blob(10, "a2")}  # misses are absent
    with pytest.raises(FactNotFound):
        svc.get_segments("bob", [fk(a1.id)])  # a foreign fact key
    with pytest.raises(FactNotFound):
        svc.get_segments("alice", [fk(a1.id), fk(b1.id)])  # one foreign key spoils the call
    # bob cannot plant a segment under alice's fact, nor alice one under bob's
    assert svc.put_segments("bob", [(fk(a1.id), Blob(10, "evil"), ())]) == 0
    assert svc.put_segments("alice", [(fk(b1.id), Blob(10, "x"), ())]) == 0
    assert svc.get_segments("alice", [fk(a1.id)]) == {fk(a1.id): Blob(10, "a1")}
    anchor = SegmentKey.for_anchor("h" * 32, M)
    assert svc.put_segments("alice", [(anchor, Blob(5), ())]) == 1
    assert svc.get_segments("bob", [anchor]) == {anchor: Blob(5)}  # anchors are shared system text
    assert svc.stats().items == 3


def test_put_segments_drops_deleted_facts_and_deleted_context(svc: MemoryService) -> None:
    a1, a2, a3 = svc.add("alice", ["a one", "a two", "a three"], "c")
    svc.delete("alice", [a1.id])
    stored = svc.put_segments("alice", [
        (fk(a1.id), Blob(10), ()),  # deleted fact
        (fk(a2.id, 1), Blob(10), (a1.id,)),  # encoded after a deleted fact
        (fk(a3.id, 1), Blob(10), (a2.id,)),  # fine
    ])
    assert stored == 1
    assert set(svc.get_segments("alice", [fk(a2.id, 1), fk(a3.id, 1)])) == {fk(a3.id, 1)}


def test_delete_drops_cached_segments_and_those_encoded_after_the_fact(svc: MemoryService) -> None:
    a1, a2, a3 = svc.add("alice", ["a one", "a two", "a three"], "c")
    svc.put_segments("alice", [(fk(a1.id), Blob(10), ()), (fk(a2.id, 1), Blob(10), (a1.id,)),
                               (fk(a3.id, 1), Blob(10), (a2.id,))])
    assert svc.stats().items == 3
    svc.delete("alice", [a1.id])
    assert svc.stats().items == 1 and svc.get_segments("alice", [fk(a2.id, 1), fk(a3.id, 1)]) == {fk(a3.id, 1): Blob(10)}
    svc.delete_all("alice")
    assert svc.stats().items == 0 and svc.stats().bytes == 0


def test_a_delete_racing_a_put_leaves_no_segment_of_the_deleted_fact(tmp_path: Path) -> None:
    """put_segments checks which facts are alive, then stores; a delete() landing in between
    (the actor runs calls on worker threads) must not leave the deleted fact's segment behind."""
    svc = make(tmp_path / "m.sqlite3")
    (a1,) = svc.add("alice", ["a one"])
    db = svc._db
    real_list = db.list_facts
    deleted = threading.Event()
    deleter: list[threading.Thread] = []

    def list_then_delete(*args, **kw):
        alive = real_list(*args, **kw)
        if not deleter:  # a delete lands right after the alive check
            def run() -> None:
                real_delete = db.delete

                def delete_and_signal(*a, **k):
                    n = real_delete(*a, **k)
                    deleted.set()
                    return n

                db.delete = delete_and_signal
                svc.delete("alice", [a1.id])

            deleter.append(threading.Thread(target=run))
            deleter[0].start()
            assert deleted.wait(5)
            deleter[0].join(0.05)  # finishes here unless it waits for the segment lock
        return alive

    db.list_facts = list_then_delete
    svc.put_segments("alice", [(fk(a1.id), Blob(10), ())])
    deleter[0].join(5)
    assert not deleter[0].is_alive()
    assert svc.stats().items == 0
    svc.check_integrity()


def test_restart_keeps_facts_but_not_segments(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite3"
    first = make(path)
    facts = first.add("alice", ["Alice has a dog", "Alice lives in Lyon"], "conv-1")
    first.put_segments("alice", [(fk(facts[0].id), Blob(10), ())])
    first._db.close()
    again = make(path)
    assert [(f.id, f.text, f.seq) for f in again.list("alice")] == [(f.id, f.text, f.seq) for f in facts]
    assert again.get_segments("alice", [fk(facts[0].id)]) == {}
    assert again.stats().items == 0
    assert [f.text for f in again.recall("alice", "dog", 1, 0).facts] == ["Alice has a dog"]
    assert again.add("alice", ["Alice likes tea"], "conv-1")[0].seq == 2  # numbering continues
    again.check_integrity()


def test_errors_survive_pickling_as_they_cross_ray() -> None:
    import pickle

    e = FactNotFound(["a" * 32, "b" * 32])
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is FactNotFound and back.ids == e.ids and str(back) == str(e) == f"2 memory id(s) not found: {'a' * 32}, {'b' * 32}"
    bad = pickle.loads(pickle.dumps(InvalidInput("no facts given")))
    assert type(bad) is InvalidInput and str(bad) == "no facts given"
