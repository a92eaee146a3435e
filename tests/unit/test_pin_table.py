"""The directory's pin table (router/pin_table.py): each decoder's pin count and held tokens follow
every change made through the table, equal a recount after any sequence of changes, and a change
made around the table is caught by check_integrity."""
from __future__ import annotations

import random

import pytest

from router.directory_loads import pin_sums
from router.directory_types import Pin
from router.pin_table import PinTable


def pin(decoder: str, tokens: int = 0) -> Pin:
    return Pin(decoder, "ana", 0.0, 0.0, prompt_tokens=tokens)


def test_sums_follow_put_move_hold_and_pop() -> None:
    t = PinTable()
    t.put("a", pin("d0", 100))
    t.put("b", pin("d0", 50))
    t.put("c", pin("d1", 10))
    assert dict(t.counts()) == {"d0": 2, "d1": 1} and dict(t.held()) == {"d0": 150, "d1": 10}
    t.move("a", "d1")
    t.hold("b", 70)
    assert dict(t.counts()) == {"d0": 1, "d1": 2} and dict(t.held()) == {"d0": 70, "d1": 110}
    t.put("c", pin("d2", 5))  # a replaced pin leaves its old decoder
    assert dict(t.counts()) == {"d0": 1, "d1": 1, "d2": 1} and dict(t.held()) == {"d0": 70, "d1": 100, "d2": 5}
    assert t.pop("b") is not None and t.pop("b") is None and t.pop("nobody") is None
    assert "d0" not in t.counts() and "d0" not in t.held()  # no zero entries
    assert len(t) == 2 and set(t) == {"a", "c"} and t["a"].decoder == "d1" and t.get(None) is None and t.get("") is None
    t.check_integrity()
    with pytest.raises(ValueError):
        t.put("", pin("d0"))
    with pytest.raises(KeyError):
        t.move("nobody", "d0")


def test_any_sequence_of_changes_matches_a_recount() -> None:
    rng = random.Random(7)
    t = PinTable()
    decoders = [f"d{i}" for i in range(5)]
    for _ in range(5000):
        sid = f"s{rng.randrange(300)}"
        op = rng.random()
        if op < 0.35:
            t.put(sid, pin(rng.choice(decoders), rng.randrange(0, 4000)))
        elif op < 0.55 and sid in t:
            t.move(sid, rng.choice(decoders))
        elif op < 0.8 and sid in t:
            t.hold(sid, rng.randrange(0, 4000))
        else:
            t.pop(sid)
    t.check_integrity()
    pinned, held = pin_sums(t.values())
    assert +pinned == dict(t.counts()) and +held == dict(t.held())


def test_a_pin_changed_around_the_table_is_caught() -> None:
    t = PinTable()
    t.put("a", pin("d0", 100))
    t["a"].decoder = "d1"  # not through move()
    with pytest.raises(AssertionError, match="drifted"):
        t.check_integrity()


def test_oldest_is_the_least_recently_seen_through_any_sequence_of_changes() -> None:
    rng = random.Random(11)
    t = PinTable()
    clock = 0.0
    with pytest.raises(LookupError):
        t.oldest()
    for step in range(20_000):
        clock += rng.random()
        sid = f"s{rng.randrange(400)}"
        op = rng.random()
        if op < 0.3:  # a new pin, or one put anew (adoption may start it in the past)
            t.put(sid, Pin("d0", "ana", clock - rng.uniform(0, 50), clock - rng.uniform(0, 50)))
        elif op < 0.75 and sid in t:  # a turn, or a touch reported late: last_seen never goes back
            t[sid].last_seen = max(t[sid].last_seen, clock - rng.uniform(0, 5))
        elif op < 0.85:
            t.pop(sid)
        elif len(t):  # a full directory evicts the oldest
            gone = t.oldest()
            assert t[gone].last_seen == min(p.last_seen for p in t.values())
            t.pop(gone)
        if step % 1000 == 0:
            t.check_integrity()
    assert len(t._by_seen) <= 2 * len(t) + 1024  # removed pins' entries do not pile up without bound
    t.check_integrity()


def test_a_pin_whose_last_seen_went_back_is_caught() -> None:
    t = PinTable()
    t.put("a", Pin("d0", "ana", 5.0, 5.0))
    t["a"].last_seen = 4.0  # against the rule: oldest could no longer be exact
    with pytest.raises(AssertionError, match="heap entry"):
        t.check_integrity()
