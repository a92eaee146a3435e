"""SegmentConnector split by role (kv_transfer/segment_connector.py): vLLM builds one connector
for its scheduler and one for its worker; each holds only its own side and forwards to it.

No engine: a minimal vllm_config (only the fields the connector reads), fake attention layers
whose cache write is a plain per-token [key | value] store, and fake scheduler outputs. The
scheduler connector's metadata is bound to the worker connector as vLLM does between them; the
counters each side keeps must reach `segment_stats()`."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kv_transfer.rope import RopeSpec, apply_rope
from kv_transfer.segment_connector import SegmentConnector
from kv_transfer.segment_meta import PARAMS_KEY, SegmentConnectorMetadata
from kv_transfer.segment_scheduler import SegmentScheduler
from kv_transfer.segment_stats import SegmentStats, segment_stats
from kv_transfer.segment_worker import SegmentWorker
from kv_transfer.segments import KVSegment, process_segments

LAYERS, HEADS, DIM, BS, BLOCKS = 2, 2, 8, 4, 6
BASE = 10000.0
SPEC = RopeSpec.unscaled(head_dim=DIM, base=BASE, table_dtype=torch.float32, max_positions=64)


def vllm_config() -> Any:
    hf = SimpleNamespace(rope_theta=BASE, head_dim=DIM, hidden_size=HEADS * DIM, num_attention_heads=HEADS)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(dtype=torch.float32, hf_config=hf, max_model_len=64),
    )


class _Impl:
    @staticmethod
    def do_kv_cache_update(layer: Any, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        for t, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, cache.shape[2])
            cache[b, :, o, :DIM] = k[t]
            cache[b, :, o, DIM:] = v[t]


def forward_context() -> Any:
    layers = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(kv_cache=torch.zeros(BLOCKS, HEADS, BS, 2 * DIM), impl=_Impl())
              for i in range(LAYERS)}
    layers["model.embed_tokens"] = SimpleNamespace(kv_cache=None, impl=None)  # not an attention layer
    return SimpleNamespace(no_compile_layers=layers)


def segment(token_ids: tuple[int, ...], seed: int = 0) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, len(token_ids), HEADS, DIM)
    return KVSegment(token_ids, torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def request(rid: str, prompt: list[int], **params: Any) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params={PARAMS_KEY: params})


class Blocks:
    def __init__(self, ids: list[int]):
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self._ids,)


def step(new: list[tuple[str, list[int], list[int], int]] = (), scheduled: dict[str, int] | None = None,
         cached: list[tuple[str, list[int] | None, int]] = (), resumed: frozenset[str] = frozenset()) -> Any:
    """A scheduler output: new requests (id, prompt, block ids, computed), cached ones (id, new block ids, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=p, block_ids=(b,), num_computed_tokens=c) for r, p, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
                                              resumed_req_ids=set(resumed), num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=scheduled or {},
    )


def run_worker(worker: Any, meta: SegmentConnectorMetadata, fc: Any) -> None:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(fc)
    worker.wait_for_save()
    worker.clear_connector_metadata()


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    yield SegmentConnector(vllm_config(), KVConnectorRole.SCHEDULER), SegmentConnector(vllm_config(), KVConnectorRole.WORKER)
    table = process_segments()
    for key in list(table._injections) + list(table._captures):
        table.discard(key)


def test_each_role_holds_only_its_own_side(pair: tuple[Any, Any]) -> None:
    sched, worker = pair
    assert isinstance(sched.scheduler_side, SegmentScheduler) and sched.worker_side is None
    assert isinstance(worker.worker_side, SegmentWorker) and worker.scheduler_side is None
    with pytest.raises(RuntimeError, match="worker-side method was called on the SCHEDULER"):
        sched.start_load_kv(forward_context())
    with pytest.raises(RuntimeError, match="worker-side"):
        sched.get_block_ids_with_load_errors()
    with pytest.raises(RuntimeError, match="scheduler-side method was called on the WORKER"):
        worker.get_num_new_matched_tokens(request("r", [1, 2, 3]), 0)
    with pytest.raises(RuntimeError, match="scheduler-side"):
        worker.build_connector_meta(step())


def test_inject_then_capture_round_trips_through_both_roles(pair: tuple[Any, Any]) -> None:
    sched, worker = pair
    fc, before = forward_context(), segment_stats()
    seg, prompt = segment((11, 12, 13, 14, 15)), [11, 12, 13, 14, 15, 16, 17]
    process_segments().offer("k1", (seg,))
    r1 = request("r1", prompt, key="k1", inject_end=5)
    assert sched.get_num_new_matched_tokens(r1, 0) == (5, False)
    sched.update_state_after_alloc(r1, Blocks([3, 1]), 5)
    meta = sched.build_connector_meta(step(new=[("r1", prompt, [3, 1], 0)], scheduled={"r1": 2}))
    assert [(ld.key, ld.start, ld.end, ld.slots) for ld in meta.loads] == [("k1", 0, 5, (12, 13, 14, 15, 4))]
    assert sched.scheduler_side.in_flight == 0
    run_worker(worker, meta, fc)
    cache = fc.no_compile_layers["model.layers.1.self_attn.attn"].kv_cache
    want = apply_rope(seg.keys[1], torch.arange(5), SPEC)  # keys laid at their prompt positions
    assert torch.allclose(cache[3, :, :, :DIM].transpose(0, 1), want[:4], atol=1e-5)
    assert torch.allclose(cache[1, :, 0, :DIM], want[4], atol=1e-5) and torch.equal(cache[1, :, 0, DIM:], seg.values[1, 4])
    assert worker.get_block_ids_with_load_errors() == set()

    # capture positions [1, 4) of a request sharing those blocks: the pre-RoPE keys come back
    r2 = request("r2", prompt, key="k2", capture=[[1, 4]])
    assert sched.get_num_new_matched_tokens(r2, 5) == (0, False)
    sched.update_state_after_alloc(r2, Blocks([3, 1]), 0)
    meta = sched.build_connector_meta(step(new=[("r2", prompt, [3, 1], 5)], scheduled={"r2": 2}))
    assert meta.loads == [] and [c.slots for c in meta.captures] == [((13, 14, 15),)]
    run_worker(worker, meta, fc)
    (got,) = process_segments().take_capture("k2").segments
    assert got.token_ids == (12, 13, 14)
    assert torch.allclose(got.keys, seg.keys[:, 1:4], atol=1e-5) and torch.equal(got.values, seg.values[:, 1:4])
    counted = segment_stats() - before
    assert counted.load_seconds > 0 and replace(counted, load_seconds=0.0) == SegmentStats(injections=1, injected_tokens=5, captures=1)


def test_refused_injections_are_counted_and_recomputed(pair: tuple[Any, Any]) -> None:
    sched, _ = pair
    before = segment_stats()
    process_segments().offer("k", (segment((1, 2, 3)),))
    assert sched.get_num_new_matched_tokens(request("a", [1, 2, 9, 4], key="k", inject_end=3), 0) == (0, False)  # tokens differ
    assert sched.get_num_new_matched_tokens(request("b", [1, 2, 3], key="k", inject_end=3), 0) == (0, False)  # nothing left to compute
    assert sched.get_num_new_matched_tokens(request("c", [1, 2, 3, 4], key="gone", inject_end=3), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(request("d", [1, 2, 3, 4], key="k", inject_end=3), 2) == (1, False)  # local hit of 2
    assert segment_stats() - before == SegmentStats(unavailable=3)


def run_withdrawn_load(sched: Any, worker: Any, in_background: bool) -> None:
    """Schedule a 6-token load of request "r" into blocks [2, 5], withdraw its segments (the
    submitter gave up between scheduling and the load), then run the worker's step."""
    process_segments().offer("k", (segment((1, 2, 3, 4, 5, 6)),))
    r = request("r", [1, 2, 3, 4, 5, 6, 7], key="k", inject_end=6)
    assert sched.get_num_new_matched_tokens(r, 0) == (6, in_background)
    sched.update_state_after_alloc(r, Blocks([2, 5]), 6)
    meta = sched.build_connector_meta(step())
    process_segments().discard("k")
    run_worker(worker, meta, forward_context())


def test_a_load_whose_segments_were_withdrawn_fails_its_blocks(pair: tuple[Any, Any]) -> None:
    sched, worker = pair
    before = segment_stats()
    run_withdrawn_load(sched, worker, in_background=False)
    assert worker.get_block_ids_with_load_errors() == {2, 5}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    assert segment_stats() - before == SegmentStats(load_failures=1)


def test_a_capture_waits_for_the_chunk_that_completes_the_prompt(pair: tuple[Any, Any]) -> None:
    sched, _ = pair
    prompt = list(range(100, 110))
    r = request("r", prompt, key="k", capture=[[0, 6]])
    sched.update_state_after_alloc(r, Blocks([4]), 0)
    first = sched.build_connector_meta(step(new=[("r", prompt, [4], 0)], scheduled={"r": 4}))
    assert first.captures == [] and sched.scheduler_side.in_flight == 1
    last = sched.build_connector_meta(step(cached=[("r", [0, 2], 4)], scheduled={"r": 6}))
    assert [c.slots for c in last.captures] == [((16, 17, 18, 19, 0, 1),)]
    assert sched.scheduler_side.in_flight == 0


def test_capture_ranges_outside_the_prompt_are_reported_not_run(pair: tuple[Any, Any]) -> None:
    sched, _ = pair
    before = segment_stats()
    prompt = [1, 2, 3]
    r = request("r", prompt, key="bad", capture=[[1, 5]])
    sched.update_state_after_alloc(r, Blocks([0]), 0)
    assert sched.build_connector_meta(step(new=[("r", prompt, [0], 0)], scheduled={"r": 3})).captures == []
    assert "outside the prompt" in process_segments().take_capture("bad").error
    assert segment_stats() - before == SegmentStats(capture_failures=1)


def test_a_finished_request_leaves_no_scheduler_state(pair: tuple[Any, Any]) -> None:
    sched, _ = pair
    process_segments().offer("k", (segment((1, 2)),))
    r = request("r", [1, 2, 3], key="k", inject_end=2, capture=[[0, 2]])
    assert sched.get_num_new_matched_tokens(r, 0) == (2, False)
    assert sched.request_finished(r, []) == (False, None)
    assert sched.scheduler_side.in_flight == 0


def llama31_config() -> Any:
    """A Llama-3.1-style model: llama3 RoPE scaling (re-rotated exactly with vLLM's own table)."""
    cfg = vllm_config()
    cfg.model_config.hf_config.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}
    return cfg


def mrope_config() -> Any:
    """A multimodal-style model: M-RoPE (positions per section), which cannot be re-rotated by one
    position per token."""
    cfg = vllm_config()
    cfg.model_config.hf_config.rope_scaling = {"rope_type": "default", "mrope_section": [2, 1, 1]}
    return cfg


def test_a_scaled_rope_keeps_injection_on_with_the_engines_own_table() -> None:
    sched = SegmentConnector(llama31_config(), KVConnectorRole.SCHEDULER)
    worker = SegmentConnector(llama31_config(), KVConnectorRole.WORKER)
    assert sched.scheduler_side is not None and sched.scheduler_side.disabled is None
    rope = worker.worker_side.rope if worker.worker_side else None
    assert rope is not None and rope.source.startswith("Llama3RotaryEmbedding")
    assert not rope.same_rotation(SPEC)  # the llama3 table differs from plain RoPE


def test_a_rope_that_cannot_be_re_rotated_turns_injection_off_and_the_engine_still_starts() -> None:
    sched = SegmentConnector(mrope_config(), KVConnectorRole.SCHEDULER)
    worker = SegmentConnector(mrope_config(), KVConnectorRole.WORKER)  # constructed: no failed start
    assert "MRotaryEmbedding" in (sched.scheduler_side.disabled or "")
    assert worker.worker_side is not None and worker.worker_side.rope is None
    before = segment_stats()
    prompt = [11, 12, 13, 14, 15, 16, 17]
    process_segments().offer("k1", (segment((11, 12, 13, 14, 15)),))
    try:
        r1 = request("r1", prompt, key="k1", inject_end=5)
        assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)  # computed from tokens instead
        assert segment_stats().unavailable == before.unavailable + 1
        r2 = request("r2", prompt, key="k2", capture=[[1, 4]])
        sched.update_state_after_alloc(r2, Blocks([3, 1]), 0)
        result = process_segments().take_capture("k2")
        assert result is not None and result.segments == () and "MRotaryEmbedding" in (result.error or "")  # failed at once, with why
        meta = sched.build_connector_meta(step(new=[("r2", prompt, [3, 1], 0)], scheduled={"r2": 7}))
        assert meta.loads == [] and meta.captures == []
        run_worker(worker, meta, forward_context())  # nothing to do; nothing raised
    finally:
        for key in ("k1", "k2"):
            process_segments().discard(key)
