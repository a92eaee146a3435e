"""Inline segment loads written layer by layer while the forward pass runs
(kv_transfer/layered_load.py, and the segment worker's wait_for_layer_load / wait_for_save around
it): a layer's attention waits only for its own layer, a failed load releases every layer, and the
step's output is read only once every write is done."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_segment_connector import DIM, SPEC, forward_context, segment

from kv_transfer.layered_load import LayeredLoad
from kv_transfer.rope import apply_rope
from kv_transfer.segment_meta import SegmentConnectorMetadata, SegmentLoad
from kv_transfer.segment_worker import SegmentWorker
from kv_transfer.segments import SegmentTable


def test_a_layer_is_released_once_every_load_wrote_it() -> None:
    gates = [threading.Event() for _ in range(3)]
    written: list[tuple[str, int]] = []

    def writes(name: str) -> Iterator[None]:
        for i in range(3):
            gates[i].wait(5)
            written.append((name, i))
            yield

    pool = ThreadPoolExecutor(max_workers=1)
    layered = LayeredLoad(pool, [("a", writes("a")), ("b", writes("b"))], 3)
    gates[0].set()
    layered.wait_layer(0)
    assert set(written) == {("a", 0), ("b", 0)}  # layer 0 of both, nothing further yet
    gates[1].set()
    gates[2].set()
    assert layered.join() == []
    assert written == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    layered.wait_layer(7)  # a layer it does not know: no wait
    pool.shutdown()


def test_a_failing_load_releases_every_layer_and_the_others_finish() -> None:
    def bad() -> Iterator[None]:
        yield
        raise RuntimeError("withdrawn")

    def good(out: list[int]) -> Iterator[None]:
        for i in range(4):
            out.append(i)
            yield

    out: list[int] = []
    pool = ThreadPoolExecutor(max_workers=1)
    layered = LayeredLoad(pool, [("bad", bad()), ("good", good(out))], 4)
    for i in range(4):
        layered.wait_layer(i)
    failed = layered.join()
    assert [(name, str(e)) for name, e in failed] == [("bad", "withdrawn")] and out == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        LayeredLoad(pool, [], 0)
    pool.shutdown()


def _held(fc: Any, gate: threading.Event, held_from: int) -> list[int]:
    """Layers from `held_from` on write only once `gate` is set; returns the order of writes."""
    order: list[int] = []
    names = sorted(n for n, layer in fc.no_compile_layers.items() if layer.impl is not None)
    for i, name in enumerate(names):
        layer = fc.no_compile_layers[name]
        write = layer.impl.do_kv_cache_update

        def held(*a: Any, _w: Any = write, _i: int = i) -> None:
            if _i >= held_from:
                gate.wait(5)
            _w(*a)
            order.append(_i)

        layer.impl = SimpleNamespace(do_kv_cache_update=held)
    return order


def test_the_worker_overlaps_an_inline_load_with_the_forward_pass() -> None:
    table = SegmentTable()
    worker = SegmentWorker(4, torch.float32, SPEC, 64, table=table, overlap_layers=True)
    seg = segment((11, 12, 13, 14, 15))
    table.offer("k", (seg,))
    fc, gate = forward_context(), threading.Event()
    order = _held(fc, gate, held_from=1)
    worker.start_load_kv(SegmentConnectorMetadata(loads=[SegmentLoad("k", 0, 5, (12, 13, 14, 15, 4))]), fc)
    worker.wait_for_layer_load("model.layers.0.self_attn.attn")  # layer 0's attention may run
    assert order == [0]  # while layer 1 is still being written
    gate.set()
    worker.wait_for_layer_load("model.layers.1.self_attn.attn")
    worker.wait_for_save(SegmentConnectorMetadata())
    assert order == [0, 1] and worker.get_block_ids_with_load_errors() == set() and worker.layer_waits == 2
    cache = fc.no_compile_layers["model.layers.1.self_attn.attn"].kv_cache
    want = apply_rope(seg.keys[1], torch.arange(5), SPEC)
    assert torch.allclose(cache[3, :, :, :DIM].transpose(0, 1), want[:4], atol=1e-5)
    assert worker.counters.snapshot().injections == 1
    worker.shutdown()


def test_an_overlapped_load_that_fails_reports_its_blocks_at_the_end_of_the_step() -> None:
    table = SegmentTable()
    worker = SegmentWorker(4, torch.float32, SPEC, 64, table=table, overlap_layers=True)
    fc = forward_context()
    worker.start_load_kv(SegmentConnectorMetadata(loads=[SegmentLoad("gone", 0, 5, (12, 13, 14, 15, 4))]), fc)
    worker.wait_for_layer_load("model.layers.0.self_attn.attn")  # released, not hung
    worker.wait_for_layer_load("model.layers.1.self_attn.attn")
    worker.wait_for_save(SegmentConnectorMetadata())
    assert worker.get_block_ids_with_load_errors() == {3, 1}
    assert worker.counters.snapshot().load_failures == 1
    worker.shutdown()


def test_overlap_is_on_for_eager_engines_only() -> None:
    from test_segment_connector import vllm_config

    eager = vllm_config()
    eager.model_config.enforce_eager = True
    assert SegmentWorker.from_config(eager)._overlap_layers
    assert not SegmentWorker.from_config(vllm_config())._overlap_layers
