"""Injected KV prepared in the pull path (kv_transfer/prepared.py, SegmentWorker.prepare): keys
rotated to their positions and cast before the request is submitted, so the engine thread's load
only slices and writes.

No engine: the worker's own Rotator over a small plain RoPE table, fake attention layers whose
cache write is a per-token [key | value] store (as in test_segment_connector.py), and load
metadata built by hand. The prepared path must write exactly what the engine-thread path writes,
for whole and partial (after a local prefix-cache hit) load ranges."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kv_transfer import segment_worker
from kv_transfer.prepared import PreparedInjection, prepare
from kv_transfer.rope import RopeSpec, Rotator, apply_rope
from kv_transfer.segment_meta import SegmentConnectorMetadata, SegmentLoad
from kv_transfer.segment_stats import SegmentCounters, SegmentStats
from kv_transfer.segment_worker import SegmentWorker, prepare_injection
from kv_transfer.segments import Injection, KVSegment, SegmentTable

LAYERS, HEADS, DIM, BS, BLOCKS, MAX_POS = 3, 2, 8, 4, 8, 64
SPEC = RopeSpec.unscaled(head_dim=DIM, base=10000.0, table_dtype=torch.float32, max_positions=MAX_POS)
BLOCK_IDS = (5, 2, 7)  # the request's blocks, out of order as the allocator hands them out


class _Impl:
    @staticmethod
    def do_kv_cache_update(layer: Any, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        assert k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == cache.dtype
        for t, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, cache.shape[2])
            cache[b, :, o, :DIM] = k[t]
            cache[b, :, o, DIM:] = v[t]


def fake_layers(dtype: torch.dtype) -> list[Any]:
    return [SimpleNamespace(kv_cache=torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=dtype), impl=_Impl()) for _ in range(LAYERS)]


def forward_context(layers: list[Any]) -> Any:
    return SimpleNamespace(no_compile_layers={f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})


def segment(first: int, n: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, HEADS, DIM)
    return KVSegment(tuple(range(first, first + n)), torch.randn(shape, generator=g), torch.randn(shape, generator=g).to(dtype))


SEGS = (segment(100, 3, 1), segment(200, 5, 2), segment(300, 2, 3))  # tiles [0, 10)


def worker(dtype: torch.dtype, rope: RopeSpec | None = SPEC) -> tuple[SegmentWorker, SegmentTable]:
    table = SegmentTable()
    return SegmentWorker(BS, dtype, rope, MAX_POS, table=table, counters=SegmentCounters()), table


def load(key: str, start: int, end: int) -> SegmentLoad:
    slots = tuple(BLOCK_IDS[p // BS] * BS + p % BS for p in range(start, end))
    return SegmentLoad(key, start, end, slots)


def run_load(w: SegmentWorker, layers: list[Any], ld: SegmentLoad) -> None:
    w.start_load_kv(SegmentConnectorMetadata(loads=[ld]), forward_context(layers))
    assert w.get_block_ids_with_load_errors() == set()


# ---- (a) the prepared path writes what the engine-thread path writes ------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start,end", [(0, 10), (4, 10), (8, 10), (9, 10)])
def test_a_prepared_load_writes_exactly_what_rotating_on_the_engine_thread_writes(dtype: torch.dtype, start: int, end: int) -> None:
    old, old_table = worker(dtype)
    new, new_table = worker(dtype)
    old_table.offer("k", SEGS)
    prepared = new.prepare(SEGS)
    assert isinstance(prepared, PreparedInjection) and prepared.dtype == dtype and prepared.end == 10
    inj = new_table.offer("k", prepared)
    assert inj.prepared is prepared and inj.segments == prepared.segments and inj.end == 10
    old_layers, new_layers = fake_layers(dtype), fake_layers(dtype)
    run_load(old, old_layers, load("k", start, end))
    run_load(new, new_layers, load("k", start, end))
    for a, b in zip(old_layers, new_layers, strict=True):
        assert torch.equal(a.kv_cache, b.kv_cache)
    # and it is the right KV: the pre-RoPE keys rotated to their prompt positions
    all_keys = torch.cat([s.keys for s in SEGS], dim=1)
    want = apply_rope(all_keys[1, start:end], torch.arange(start, end), SPEC).to(dtype)
    got = torch.stack([new_layers[1].kv_cache[BLOCK_IDS[p // BS], :, p % BS, :DIM] for p in range(start, end)])
    assert torch.allclose(got.float(), want.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert old.counters.snapshot() == SegmentStats(injections=1, injected_tokens=end - start,
                                                   load_seconds=old.counters.snapshot().load_seconds)
    assert new.counters.snapshot().prepared_loads == 1 and new.counters.snapshot().injected_tokens == end - start


def test_a_load_split_across_steps_writes_the_whole_range() -> None:
    """Two loads of one prepared injection (e.g. a prefix hit, then the rest) leave the same cache
    as one engine-thread load of the union."""
    old, old_table = worker(torch.bfloat16)
    new, new_table = worker(torch.bfloat16)
    old_table.offer("k", SEGS)
    new_table.offer("k", new.prepare(SEGS))
    old_layers, new_layers = fake_layers(torch.bfloat16), fake_layers(torch.bfloat16)
    run_load(old, old_layers, load("k", 2, 10))
    run_load(new, new_layers, load("k", 2, 6))
    run_load(new, new_layers, load("k", 6, 10))
    assert all(torch.equal(a.kv_cache, b.kv_cache) for a, b in zip(old_layers, new_layers, strict=True))
    assert new.counters.snapshot().prepared_loads == 2


def test_kv_prepared_for_another_rotation_or_dtype_is_rotated_on_the_engine_thread() -> None:
    other = RopeSpec.unscaled(head_dim=DIM, base=500.0, table_dtype=torch.float32, max_positions=MAX_POS)
    ref, ref_table = worker(torch.bfloat16)
    ref_table.offer("k", SEGS)
    ref_layers = fake_layers(torch.bfloat16)
    run_load(ref, ref_layers, load("k", 0, 10))
    for foreign in (prepare(SEGS, Rotator(other), torch.bfloat16), prepare(SEGS, Rotator(SPEC), torch.float32)):
        w, table = worker(torch.bfloat16)
        table.offer("k", foreign)
        layers = fake_layers(torch.bfloat16)
        run_load(w, layers, load("k", 0, 10))
        assert all(torch.equal(a.kv_cache, b.kv_cache) for a, b in zip(ref_layers, layers, strict=True))
        assert w.counters.snapshot().prepared_loads == 0 and w.counters.snapshot().injections == 1


# ---- (b) injection off: the plain segments, unchanged ---------------------------------------------

def test_prepare_injection_returns_the_segments_when_this_process_has_no_segment_worker() -> None:
    out = prepare_injection(list(SEGS))
    assert isinstance(out, tuple) and len(out) == len(SEGS) and all(a is b for a, b in zip(out, SEGS, strict=True))


def test_prepare_injection_returns_the_segments_when_the_workers_rope_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    off, _ = worker(torch.bfloat16, rope=None)
    monkeypatch.setattr(segment_worker, "process_segment_worker", lambda: off)
    out = prepare_injection(SEGS)
    assert isinstance(out, tuple) and all(a is b for a, b in zip(out, SEGS, strict=True))
    on, _ = worker(torch.bfloat16)
    monkeypatch.setattr(segment_worker, "process_segment_worker", lambda: on)
    prepared = prepare_injection(SEGS)
    assert isinstance(prepared, PreparedInjection) and prepared.rope is SPEC
    assert prepare_injection(()) == ()


def test_a_rope_turned_off_after_preparing_fails_the_load_into_recompute() -> None:
    w, table = worker(torch.bfloat16)
    table.offer("k", w.prepare(SEGS))
    no_rope = SimpleNamespace(named_modules=lambda: iter(()))  # a model with no rotary embedding
    assert "KV injection and capture off" in w.bind_model(no_rope) and w.rope is None
    w.start_load_kv(SegmentConnectorMetadata(loads=[load("k", 0, 10)]), forward_context(fake_layers(torch.bfloat16)))
    assert w.get_block_ids_with_load_errors() == set(BLOCK_IDS)
    assert w.counters.snapshot().load_failures == 1


# ---- (c) a malformed prepared injection is refused ------------------------------------------------

def _good() -> PreparedInjection:
    return prepare(SEGS, Rotator(SPEC), torch.bfloat16)


@pytest.mark.parametrize("change,match", [
    (lambda p: {"keys": p.keys[:, :9].contiguous()}, "do not cover"),
    (lambda p: {"values": p.values[:, :, :1].contiguous()}, "do not cover"),
    (lambda p: {"segments": p.segments[:2]}, "do not cover"),
    (lambda p: {"values": p.values.float()}, "values torch.float32"),
    (lambda p: {"keys": p.keys.transpose(2, 3).contiguous().transpose(2, 3)}, "contiguous"),
    (lambda p: {"segments": ()}, "at least one segment"),
    (lambda p: {"segments": (*p.segments[:2], KVSegment((1, 2), torch.zeros(LAYERS, 2, 1, DIM), torch.zeros(LAYERS, 2, 1, DIM)))},
     "does not match the first"),
    (lambda p: {"rope": RopeSpec.unscaled(head_dim=2 * DIM, base=10000.0, table_dtype=torch.float32)}, "head dim"),
])
def test_a_malformed_prepared_injection_is_refused(change: Any, match: str) -> None:
    p = _good()
    fields = {"segments": p.segments, "keys": p.keys, "values": p.values, "rope": p.rope} | change(p)
    with pytest.raises(ValueError, match=match):
        PreparedInjection(**fields)


def test_a_prepared_injection_of_other_segments_and_ranges_outside_it_are_refused() -> None:
    p = _good()
    with pytest.raises(ValueError, match="other segments"):
        Injection(SEGS[:2], prepared=p)
    with pytest.raises(ValueError, match="other segments"):
        Injection((segment(100, 3, 1), *SEGS[1:]), prepared=p)  # equal tokens, another object
    assert Injection(p.segments, prepared=p).end == p.end
    for start, end in ((0, 11), (5, 5), (-1, 3)):
        with pytest.raises(ValueError, match="not within the prepared"):
            p.layer_range(0, start, end)
    with pytest.raises(ValueError, match="beyond the rope table"):  # longer than the rotation: the caller keeps the segments
        prepare((segment(0, MAX_POS + 1, 9),), Rotator(SPEC), torch.bfloat16)
    with pytest.raises(ValueError, match="no segments"):
        prepare((), Rotator(SPEC), torch.bfloat16)


# ---- (d) preparing in several threads at once ------------------------------------------------------

def test_prepare_runs_concurrently_with_distinct_results_and_one_rotator(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Rotator] = []

    class Counted(Rotator):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(segment_worker, "Rotator", Counted)
    w, _ = worker(torch.bfloat16)
    inputs = {0: SEGS, 1: (segment(400, 6, 7), segment(500, 4, 8))}
    expected = {i: prepare(segs, Rotator(SPEC), torch.bfloat16) for i, segs in inputs.items()}
    results: dict[int, list[PreparedInjection]] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(25):
            results[i].append(w.prepare(inputs[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1  # the lazily built Rotator is built once, under the lock
    for i, got in results.items():
        assert len(got) == 25
        assert all(torch.equal(p.keys, expected[i].keys) and torch.equal(p.values, expected[i].values) for p in got)
    ptrs = [p.keys.data_ptr() for got in results.values() for p in got] + [p.values.data_ptr() for got in results.values() for p in got]
    assert len(set(ptrs)) == len(ptrs)  # every result has tensors of its own: no shared buffer


# ---- the runner and the replica hand a prepared injection on --------------------------------------

def test_the_runner_offers_a_prepared_injection_and_discards_its_key_once() -> None:
    from baton.engine.args import EngineSpec
    from baton.engine.runner import EngineRunner
    from baton.engine.types import GenerationRequest, SamplingSpec
    from kv_transfer.segment_connector import PARAMS_KEY
    from tests.unit.fake_engine import FakeEngine, RecordingTable

    log: list[tuple[str, str]] = []
    engine, table = FakeEngine(2, log), RecordingTable(log)
    engine.table = table
    runner = EngineRunner(EngineSpec(engine_kwargs={}, env={}, model_path="fake"), engine_factory=lambda spec: engine, segment_table=table)
    offered: list[Any] = []
    real_offer = table.offer
    table.offer = lambda key, kv: offered.append(real_offer(key, kv)) or offered[-1]  # type: ignore[method-assign]
    req = GenerationRequest(request_id="p", prompt_token_ids=tuple(range(11)), sampling=SamplingSpec(max_tokens=2))
    prepared = _good()

    async def run() -> list[Any]:
        return [d async for d in runner.generate(req, injection=prepared)]

    try:
        assert asyncio.run(asyncio.wait_for(run(), 5.0))[-1].finished
        assert engine.added["p"][1].extra_args["kv_transfer_params"][PARAMS_KEY] == {"key": "p", "inject_end": 10}
        assert offered[0].prepared is prepared
        assert [op for op, key in table.log if key == "p"] == ["offer", "add", "discard"] and len(table) == 0
    finally:
        runner.shutdown()


def test_the_replica_falls_back_to_the_plain_segments_when_preparing_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments import pool

    def broken(segs: Any) -> Any:
        raise RuntimeError("no memory for the prepared KV")

    monkeypatch.setattr(segment_worker, "prepare_injection", broken)
    assert asyncio.run(pool._prepared("r", SEGS)) is SEGS
    monkeypatch.setattr(segment_worker, "prepare_injection", lambda segs: ("prepared", segs))
    assert asyncio.run(pool._prepared("r", SEGS)) == ("prepared", SEGS)
