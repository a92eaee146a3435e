"""router/heap.py: a built directory (and ingress) freezes its startup heap, so CPython's
generation-2 collections no longer walk it; the pins it creates afterwards are collected as before."""
from __future__ import annotations

import gc
import warnings
from pathlib import Path

from router.directory_state import DirectorySettings
from router.heap import freeze_startup_heap

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from router.directory import ConversationDirectory


def test_freezing_leaves_nothing_of_the_startup_heap_for_collections_to_walk() -> None:
    gc.unfreeze()
    walked_before = len(gc.get_objects(generation=2))
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() and walked_before > 10_000 and frozen > 10_000  # this process imported Ray, Serve, torch
    assert len(gc.get_objects(generation=2)) < walked_before // 100
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1  # what comes later is still collected


def test_a_directory_freezes_its_heap_when_it_is_built(tmp_path: Path) -> None:
    gc.unfreeze()
    ConversationDirectory(DirectorySettings(policy="colocated"), ownership_db_path=str(tmp_path / "own.db"))
    assert gc.get_freeze_count() > 10_000 and len(gc.get_objects(generation=2)) < gc.get_freeze_count() // 100
