"""SegmentConnector: a vLLM KV connector that injects and captures position-free KV segments.

Per request, through `kv_transfer_params["baton_segments"]`:
- `{"key": K, "inject_end": E}`: prompt positions [0, E) are supplied from the segments offered
  under K in this process's SegmentTable (kv_transfer/segments.py), each key re-rotated to its
  position; vLLM computes only [E, prompt_len). Positions already in the local prefix cache are
  not loaded again (the load starts at the local hit length).
- `{"key": K, "capture": [[a, b], ...]}`: once the prompt is computed, read the KV of positions
  [a, b) from the paged cache, remove RoPE, and put the segments under K (take_capture).

Rules it enforces (from vLLM's scheduler): a connector can only extend the local hit with a
contiguous run, and at least one prompt token must stay to compute, so E < prompt length. The
offered segments' token ids must equal the prompt's first E tokens, else nothing is loaded.
A load that raises marks its blocks as failed; with kv_load_failure_policy="recompute" vLLM then
recomputes them and the request still succeeds. A capture reads the KV in the step that
completes its prompt (chunked prefill and preemption are followed).

Only one worker in this process is supported (in-process engine, tensor parallel size 1), and the
capture path knows the CPU backend's cache shape (kv_transfer/paged_kv.py); other backends raise
UnsupportedLayout on capture, which the caller turns into a recompute.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kv_transfer.paged_kv import PagedLayout, layer_writer, learn_layout, read_tokens
from kv_transfer.rope import Rotator, remove_rope, rope_spec_from_hf_config
from kv_transfer.segments import CaptureResult, KVSegment, process_segments

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("baton.kv_transfer.segments")

PARAMS_KEY = "baton_segments"
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class _Load:
    key: str
    start: int  # first prompt position to load
    end: int  # one past the last
    slots: tuple[int, ...]


@dataclass(frozen=True)
class _Capture:
    key: str
    ranges: tuple[tuple[int, int], ...]
    token_ids: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]  # per range


@dataclass
class _PendingCapture:
    """A capture request between its admission and the step that completes its prompt."""

    key: str
    ranges: tuple[tuple[int, int], ...]
    prompt: tuple[int, ...] = ()
    block_ids: list[int] = field(default_factory=list)


@dataclass
class SegmentConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    captures: list[_Capture] = field(default_factory=list)


def segment_params(request: Any) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    p = params.get(PARAMS_KEY)
    return p if isinstance(p, dict) and isinstance(p.get("key"), str) else None


def slots_for(block_ids: list[int], block_size: int, start: int, end: int) -> tuple[int, ...]:
    """Cache slots of prompt positions [start, end): block_ids[p // bs] · bs + p % bs."""
    return tuple(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))


class _Staging:
    """Reusable load buffers: fresh 100 MB tensors per request cost more in page faults (~0.3 s
    here) than the whole rotation, so loads copy into buffers that only ever grow."""

    def __init__(self) -> None:
        self._f32 = torch.empty(0)
        self._low = torch.empty(0, dtype=torch.bfloat16)
        self._val = torch.empty(0, dtype=torch.bfloat16)

    def views(self, layers: int, n: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = layers * n * heads * dim
        if self._f32.numel() < size:
            self._f32 = torch.empty(size)
        if self._low.numel() < size or self._low.dtype != dtype:
            self._low = torch.empty(size, dtype=dtype)
            self._val = torch.empty(size, dtype=dtype)
        shape = (layers, n, heads, dim)
        return self._f32[:size].view(shape), self._low[:size].view(shape), self._val[:size].view(shape)


class SegmentConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._table = process_segments()
        self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._matched: dict[str, int] = {}  # request id → inject end promised
        self._pending_loads: list[_Load] = []
        self._pending_captures: dict[str, _PendingCapture] = {}
        # worker side
        self._dtype = vllm_config.model_config.dtype
        self._rope = rope_spec_from_hf_config(vllm_config.model_config.hf_config, table_dtype=self._dtype)
        self._rotator: Rotator | None = None  # built on first load (worker side only)
        self._staging = _Staging()
        self._max_positions = vllm_config.model_config.max_model_len
        self._layers: list[Any] | None = None
        self._layout: PagedLayout | None = None
        self._failed_blocks: set[int] = set()

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        p = segment_params(request)
        end = int(p.get("inject_end") or 0) if p else 0
        if not end or num_computed_tokens >= end:
            return 0, False
        inj = self._table.injection(p["key"])
        prompt = request.prompt_token_ids or []
        if inj is None or inj.end != end or end >= len(prompt):
            logger.warning("segment injection for %s unavailable (offered %s, asked %d): recomputing",
                           request.request_id, None if inj is None else inj.end, end)
            self._table.stats.unavailable += 1
            return 0, False
        if tuple(prompt[:end]) != inj.token_ids:
            logger.warning("segment tokens differ from request %s's prompt: recomputing", request.request_id)
            self._table.stats.unavailable += 1
            return 0, False
        self._matched[request.request_id] = end
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        end = self._matched.pop(request.request_id, 0)
        p = segment_params(request)
        if num_external_tokens > 0 and end:
            block_ids = blocks.get_block_ids()[0]
            start = end - num_external_tokens
            self._pending_loads.append(_Load(p["key"], start, end, slots_for(block_ids, self._block_size, start, end)))
        if p and p.get("capture"):
            ranges = tuple((int(a), int(b)) for a, b in p["capture"])
            self._pending_captures[request.request_id] = _PendingCapture(p["key"], ranges)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SegmentConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self._pending_captures:
            self._track_captures(scheduler_output, meta)
        return meta

    def _track_captures(self, out: "SchedulerOutput", meta: SegmentConnectorMetadata) -> None:
        """Follow capture requests through their prefill chunks (block ids arrive per chunk, or
        all at once when a preempted request resumes); capture in the step that completes the
        prompt, when every position's KV is in the paged cache."""
        progress: list[tuple[str, int]] = []
        for new in out.scheduled_new_reqs:
            cap = self._pending_captures.get(new.req_id)
            if cap is not None:
                cap.prompt = tuple(new.prompt_token_ids or ())
                cap.block_ids = list(new.block_ids[0])
                progress.append((new.req_id, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            cap = self._pending_captures.get(rid)
            if cap is None:
                continue
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                cap.block_ids = list(blocks[0]) if blocks else []
            elif blocks:
                cap.block_ids.extend(blocks[0])
            progress.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in progress:
            cap = self._pending_captures[rid]
            if computed + out.num_scheduled_tokens.get(rid, 0) < len(cap.prompt):
                continue  # more chunks to come
            del self._pending_captures[rid]
            bad = [r for r in cap.ranges if not 0 <= r[0] < r[1] <= len(cap.prompt)]
            if bad:
                self._table.put_capture(cap.key, CaptureResult(error=f"capture ranges {bad} outside the prompt"))
                continue
            slots = tuple(slots_for(cap.block_ids, self._block_size, a, b) for a, b in cap.ranges)
            meta.captures.append(_Capture(cap.key, cap.ranges, cap.prompt, slots))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._pending_captures.pop(request.request_id, None)
        return False, None

    # ---- worker side --------------------------------------------------------------------------
    def _attention_layers(self, forward_context: "ForwardContext") -> list[Any]:
        if self._layers is None:
            named = [
                (int(m.group(1)), layer)
                for name, layer in forward_context.no_compile_layers.items()
                if (m := _LAYER_INDEX.search(name)) and isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
                and getattr(layer, "impl", None) is not None
            ]
            self._layers = [layer for _, layer in sorted(named, key=lambda x: x[0])]
        return self._layers

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SegmentConnectorMetadata)
        if not meta.loads and not meta.captures:
            return
        layers = self._attention_layers(forward_context)
        for load in meta.loads:
            try:
                self._load(load, layers)
            except Exception:  # noqa: BLE001 - a failed load is recomputed, the request lives on
                logger.exception("segment load %s failed; its blocks will be recomputed", load.key)
                self._table.stats.load_failures += 1
                self._failed_blocks.update(s // self._block_size for s in load.slots)

    def _load(self, load: _Load, layers: list[Any]) -> None:
        t0 = time.perf_counter()
        inj = self._table.injection(load.key)
        if inj is None:
            raise RuntimeError(f"segments for {load.key} were withdrawn before the load")
        first = inj.segments[0]
        if first.keys.shape[0] != len(layers):
            raise RuntimeError(f"segments have {first.keys.shape[0]} layers, the model {len(layers)}")
        if self._rotator is None:
            self._rotator = Rotator(self._rope, self._max_positions)
        n = load.end - load.start
        keys, keys16, values = self._staging.views(len(layers), n, first.keys.shape[2], first.keys.shape[3], self._dtype)
        inj.copy_range(load.start, load.end, keys, values)
        self._rotator.apply_(keys, torch.arange(load.start, load.end))
        keys16.copy_(keys)
        slots = torch.tensor(load.slots, dtype=torch.long)
        for i, layer in enumerate(layers):
            layer.impl.do_kv_cache_update(layer, keys16[i], values[i], layer.kv_cache, slots)
        self._table.stats.injections += 1
        self._table.stats.injected_tokens += load.end - load.start
        self._table.stats.load_seconds += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SegmentConnectorMetadata)
        for cap in meta.captures:
            try:
                self._table.put_capture(cap.key, CaptureResult(segments=self._capture(cap)))
                self._table.stats.captures += 1
            except Exception as e:  # noqa: BLE001 - reported to the submitter, who recomputes
                logger.exception("segment capture %s failed", cap.key)
                self._table.put_capture(cap.key, CaptureResult(error=f"{type(e).__name__}: {e}"))

    def _capture(self, cap: _Capture) -> tuple[KVSegment, ...]:
        if self._layers is None:
            raise RuntimeError("no attention layers seen yet")
        layers = self._layers
        if self._layout is None:
            self._layout = learn_layout(layer_writer(layers[0]), self._block_size, self._rope.head_dim, self._dtype)
        out = []
        for (a, b), slots in zip(cap.ranges, cap.slots):
            idx = torch.tensor(slots, dtype=torch.long)
            ks, vs = zip(*(read_tokens(layer.kv_cache, idx, self._layout) for layer in layers))
            keys = remove_rope(torch.stack(ks), torch.arange(a, b), self._rope)
            out.append(KVSegment(cap.token_ids[a:b], keys, torch.stack(vs).clone()))
        return tuple(out)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
