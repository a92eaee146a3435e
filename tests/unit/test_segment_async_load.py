"""Asynchronous segment loads (kv_transfer/segment_loader.py, the worker side's use of it, the
scheduler side's load_async answer, the config that turns it on, and the engine loop's wait while
every request waits on a load).

No engine: the fakes of test_segment_connector (attention layers whose cache write is a plain
per-token store, a minimal vllm_config), with a writer that can be held, so a test can see the
engine side go on while a load runs."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_segment_connector import DIM, SPEC, Blocks, forward_context, request, run_withdrawn_load, run_worker, segment, step, vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from baton.engine.args import build_engine_spec
from baton.engine.config import EngineConfig
from baton.engine.scheduler_stats import none_running, wire_segment_scheduler
from kv_transfer.config import kv_transfer_engine_arg
from kv_transfer.rope import apply_rope
from kv_transfer.segment_connector import SegmentConnector
from kv_transfer.segment_loader import AsyncLoader
from kv_transfer.segment_scheduler import SegmentScheduler, async_min_tokens_configured
from kv_transfer.segment_stats import SegmentStats, segment_stats
from kv_transfer.segments import process_segments


def async_config(min_tokens: int | None = 0) -> Any:
    cfg = vllm_config()
    cfg.kv_transfer_config = SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={"async_load_min_tokens": min_tokens})
    return cfg


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    worker = SegmentConnector(async_config(), KVConnectorRole.WORKER)
    yield SegmentConnector(async_config(), KVConnectorRole.SCHEDULER), worker
    worker.shutdown()
    table = process_segments()
    for key in list(table._injections) + list(table._captures):
        table.discard(key)


def held_forward_context(gate: threading.Event) -> Any:
    """A forward context whose cache writes wait for `gate` (a load that takes as long as the test says)."""
    fc = forward_context()
    for layer in fc.no_compile_layers.values():
        if layer.impl is not None:
            write = layer.impl.do_kv_cache_update
            layer.impl = SimpleNamespace(do_kv_cache_update=lambda *a, _w=write: (gate.wait(5), _w(*a)))
    return fc


def test_the_scheduler_side_answers_load_async_and_names_the_request(pair: tuple[Any, Any]) -> None:
    sched, _ = pair
    process_segments().offer("k", (segment((1, 2, 3, 4, 5)),))
    r = request("r", [1, 2, 3, 4, 5, 6], key="k", inject_end=5)
    assert sched.get_num_new_matched_tokens(r, 0) == (5, True)
    sched.update_state_after_alloc(r, Blocks([3, 1]), 5)
    (load,) = sched.build_connector_meta(step()).loads
    assert (load.request_id, load.start, load.end) == ("r", 0, 5)
    # nothing to load (all of it in the local cache): no load, whatever the flag
    assert sched.get_num_new_matched_tokens(request("s", [1, 2, 3, 4, 5, 6], key="k", inject_end=5), 5) == (0, False)


def test_the_load_runs_while_the_engine_goes_on_and_is_reported_once(pair: tuple[Any, Any]) -> None:
    sched, worker = pair
    before = segment_stats()
    gate = threading.Event()
    fc = held_forward_context(gate)
    seg, prompt = segment((11, 12, 13, 14, 15)), [11, 12, 13, 14, 15, 16, 17]
    process_segments().offer("k1", (seg,))
    r1 = request("r1", prompt, key="k1", inject_end=5)
    assert sched.get_num_new_matched_tokens(r1, 0) == (5, True)
    sched.update_state_after_alloc(r1, Blocks([3, 1]), 5)
    run_worker(worker, sched.build_connector_meta(step()), fc)  # returns with the load held
    assert worker.get_finished(set()) == (None, None)  # not done: the request stays waiting
    run_worker(worker, sched.build_connector_meta(step()), fc)  # the engine steps again meanwhile
    assert worker.get_finished(set()) == (None, None)
    gate.set()
    assert worker.worker_side.loader.wait_idle(5)
    assert worker.get_finished(set()) == (None, {"r1"})
    assert worker.get_finished(set()) == (None, None)  # once
    assert worker.get_block_ids_with_load_errors() == set()
    cache = fc.no_compile_layers["model.layers.1.self_attn.attn"].kv_cache
    want = apply_rope(seg.keys[1], torch.arange(5), SPEC)
    assert torch.allclose(cache[3, :, :, :DIM].transpose(0, 1), want[:4], atol=1e-5)
    assert torch.allclose(cache[1, :, 0, :DIM], want[4], atol=1e-5) and torch.equal(cache[1, :, 0, DIM:], seg.values[1, 4])
    counted = segment_stats() - before
    assert (counted.injections, counted.injected_tokens, counted.background_loads, counted.load_failures) == (1, 5, 1, 0)
    worker.worker_side.loader.check_integrity()


def test_a_failed_async_load_reports_its_request_and_blocks_in_the_same_output(pair: tuple[Any, Any]) -> None:
    sched, worker = pair
    before = segment_stats()
    run_withdrawn_load(sched, worker, in_background=True)
    assert worker.worker_side.loader.wait_idle(5)
    # vLLM reads get_finished, then the load errors, of one output: both must name this load
    assert worker.get_finished(set()) == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == {2, 5}
    assert worker.get_block_ids_with_load_errors() == set()
    assert segment_stats() - before == SegmentStats(load_failures=1)


def test_loads_end_in_submission_order_and_a_request_has_one_in_flight() -> None:
    loader = AsyncLoader()
    order: list[str] = []
    gate = threading.Event()
    loader.submit("a", frozenset({1}), lambda: (gate.wait(5), order.append("a")))
    loader.submit("b", frozenset({2}), lambda: order.append("b"))
    with pytest.raises(ValueError, match="already has a segment load in flight"):
        loader.submit("a", frozenset({3}), lambda: None)
    assert loader.in_flight == 2 and loader.drain().finished == frozenset()
    loader.check_integrity()
    gate.set()
    assert loader.wait_idle(5)
    assert order == ["a", "b"]
    assert loader.drain() == type(loader.drain())(frozenset({"a", "b"}), frozenset())
    assert loader.in_flight == 0 and loader.submitted == 2 and loader.failed == 0
    loader.submit("a", frozenset({4}), lambda: None)  # drained: the id may load again
    loader.shutdown()


def test_a_raising_load_fails_only_its_own_blocks() -> None:
    loader = AsyncLoader()

    def boom() -> None:
        raise RuntimeError("no segments")

    loader.submit("bad", frozenset({7, 8}), boom)
    loader.submit("good", frozenset({9}), lambda: None)
    assert loader.wait_idle(5)
    drained = loader.drain()
    assert drained.finished == frozenset({"bad", "good"}) and drained.failed_blocks == frozenset({7, 8})
    assert loader.failed == 1
    loader.check_integrity()
    loader.shutdown()


def test_after_load_runs_before_the_load_counts_as_done() -> None:
    seen: list[int] = []
    loader = AsyncLoader(after_load=lambda: seen.append(loader.in_flight))
    loader.submit("a", frozenset(), lambda: None)
    assert loader.wait_idle(5)
    assert seen == [1] and loader.drain().finished == frozenset({"a"})
    loader.shutdown()


def test_only_loads_of_the_configured_size_run_in_the_background() -> None:
    sched = SegmentScheduler.from_config(async_config(min_tokens=4))
    assert sched.async_min_tokens == 4
    process_segments().offer("k", (segment((1, 2, 3, 4, 5)),))
    try:
        r = request("r", [1, 2, 3, 4, 5, 6], key="k", inject_end=5)
        assert sched.get_num_new_matched_tokens(r, 0) == (5, True)
        assert sched.get_num_new_matched_tokens(r, 2) == (3, False)  # after a local hit of 2: 3 tokens, inline
        sched.update_state_after_alloc(r, Blocks([3, 1]), 3)
        (load,) = sched.build_connector_meta(step()).loads
        assert load.request_id is None and (load.start, load.end) == (2, 5)
    finally:
        process_segments().discard("k")


def test_background_loads_take_1024_tokens_by_default_and_are_configurable() -> None:
    seg = kv_transfer_engine_arg("decode", handoff=False, on_gpu=False, segments=True)
    assert seg["kv_connector_extra_config"] == {"async_load_min_tokens": None}  # the plain default: inline
    spec = build_engine_spec(EngineConfig(model="m"), role="decode", handoff=False, model_path="/m", on_gpu=False,
                             cache_root="/tmp", segments=True)
    assert spec.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"] == {"async_load_min_tokens": 1024}
    spec = build_engine_spec(EngineConfig(model="m", segment_async_load_min_tokens=None), role="decode", handoff=True,
                             model_path="/m", on_gpu=False, cache_root="/tmp", segments=True)
    children = spec.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector_extra_config"] for c in children if c["kv_connector"] == "SegmentConnector"] == [
        {"async_load_min_tokens": None}]
    with pytest.raises(ValueError):
        EngineConfig(model="m", segment_async_load_min_tokens=-1)
    assert async_min_tokens_configured(async_config(7)) == 7
    assert async_min_tokens_configured(SimpleNamespace(kv_transfer_config=None)) is None
    for bad in ("yes", True, -3):
        with pytest.raises(ValueError, match="async_load_min_tokens"):
            async_min_tokens_configured(async_config(bad))
    assert SegmentScheduler.from_config(vllm_config()).async_min_tokens is None


def test_the_engine_loop_waits_only_when_no_request_runs() -> None:
    assert none_running(SimpleNamespace(running=[]))
    assert not none_running(SimpleNamespace(running=[object()]))
    assert not none_running(None)  # cannot tell: step as before


def test_a_large_load_runs_inline_when_no_other_request_runs() -> None:
    """In the background it would keep nothing going and cost its request a step."""
    sched = SegmentScheduler.from_config(async_config(min_tokens=4))
    vllm_sched = SimpleNamespace(connector=SimpleNamespace(scheduler_side=sched), running=[])
    wire_segment_scheduler(vllm_sched)
    process_segments().offer("k", (segment((1, 2, 3, 4, 5)),))
    try:
        r = request("r", [1, 2, 3, 4, 5, 6], key="k", inject_end=5)
        assert sched.get_num_new_matched_tokens(r, 0) == (5, False)  # idle engine: inline
        vllm_sched.running.append(object())
        assert sched.get_num_new_matched_tokens(r, 0) == (5, True)  # others run: in the background
    finally:
        process_segments().discard("k")
    wire_segment_scheduler(SimpleNamespace(connector=None))  # no segment connector: nothing to wire
