"""The segment connector's worker side: lays segments into the paged KV cache and reads captures
out of it, as each step's SegmentConnectorMetadata says (kv_transfer/segment_connector.py).

A load writes the offered KV with the attention backend's own cache write. When the submitter
offered a PreparedInjection (kv_transfer/prepared.py: keys rotated to their prompt positions and
cast in the pull path, by `prepare` in another thread), the load only slices its range and writes
it; plain segments are copied into staging, re-rotated and cast by the load. An asynchronous load
(the scheduler side's `async_min_tokens`) runs on the loader's background thread
(kv_transfer/segment_loader.py) and is reported by `get_finished`; a synchronous (inline) one is
written during the step that schedules it: on an eager engine layer by layer on a helper thread
while the forward pass runs, each attention layer waiting for its own (kv_transfer/layered_load.py),
else on the engine thread before the forward pass. A load that raises marks its blocks as failed, and with
kv_load_failure_policy="recompute" vLLM recomputes them (the request still succeeds). A capture
reads the KV of its ranges after the step that completes the prompt, removes RoPE, and puts the
segments (or the error) under its key in the process SegmentTable.

Only one worker per process (in-process engine, tensor parallel size 1). The capture path learns
the backend's in-block layout (kv_transfer/paged_kv.py); a backend it cannot learn raises
UnsupportedLayout on capture, which the submitter turns into a recompute.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kv_transfer.buffer_pool import BufferPool
from kv_transfer.layered_load import LayeredLoad
from kv_transfer.paged_kv import layer_writer
from kv_transfer.paged_layouts import CacheLayout, learn_cache_layout
from kv_transfer.prepared import PreparedInjection, prepare
from kv_transfer.rope import RopeSpec, Rotator, UnsupportedRope, remove_rope, rope_from_model, rope_from_vllm_config
from kv_transfer.segment_loader import AsyncLoader
from kv_transfer.segment_meta import SegmentCapture, SegmentConnectorMetadata, SegmentLoad
from kv_transfer.segment_stats import SegmentCounters, new_counters
from kv_transfer.segments import CaptureResult, Injection, KVSegment, SegmentTable, process_segments
from kv_transfer.staging import Staging, device_sync

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = logging.getLogger("baton.kv_transfer.segments")

# a layer's index: the first integer component of its module name, whatever the model calls its
# blocks (model.layers.3.self_attn.attn, transformer.h.3.attn.attn)
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


class SegmentWorker:
    """Worker-side state: the attention layers, the rope table, staging buffers, failed blocks."""

    def __init__(self, block_size: int, dtype: torch.dtype, rope: RopeSpec | None, max_positions: int,
                 table: SegmentTable | None = None, counters: SegmentCounters | None = None,
                 overlap_layers: bool = False):
        """overlap_layers: a step's inline loads are written layer by layer while its forward pass
        runs (kv_transfer/layered_load.py; eager execution only)."""
        if block_size <= 0 or max_positions <= 0:
            raise ValueError(f"block size {block_size} and max positions {max_positions} must be positive")
        self._block_size = block_size
        self._dtype = dtype
        self._rope = rope
        self._max_positions = max_positions
        self._table = table if table is not None else process_segments()
        self.counters = counters if counters is not None else new_counters()
        self._rotator: Rotator | None = None  # built on first use (a load, or a prepare in another thread)
        self._rotator_lock = threading.Lock()
        self._staging = Staging()  # the engine thread's (synchronous loads)
        self._loader_staging = Staging()  # the loader thread's
        self._buffers = BufferPool()  # prepared injections' tensors, reused across requests
        self._loader: AsyncLoader | None = None  # started by the first asynchronous load
        self._overlap_layers = overlap_layers
        self._layer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-segment-layers") if overlap_layers else None
        self._layered: LayeredLoad[SegmentLoad] | None = None
        self.layer_waits = 0  # attention layers that waited on an overlapped load (vLLM calls wait_for_layer_load)
        self._layers: list[Any] | None = None
        self._layer_index: dict[str, int] = {}
        self._layout: CacheLayout | None = None
        self._failed_blocks: set[int] = set()

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> SegmentWorker:
        """The rope is vLLM's own rotary module for this model (kv_transfer/rope.py
        rope_from_vllm_config), confirmed against the loaded model by `bind_model`.

        rope None: a RoPE this module cannot re-rotate; the scheduler side then schedules no
        load or capture (SegmentScheduler.disabled), and one that came anyway fails into the
        recompute fallback, never into a failed start."""
        mc = vllm_config.model_config
        try:
            rope: RopeSpec | None = rope_from_vllm_config(vllm_config)
        except UnsupportedRope as e:
            logger.warning("segment worker: %s", e)
            rope = None
        return cls(vllm_config.cache_config.block_size, mc.dtype, rope, mc.max_model_len,
                   overlap_layers=bool(getattr(mc, "enforce_eager", False)))

    @property
    def rope(self) -> RopeSpec | None:
        return self._rope

    def bind_model(self, model: Any) -> str:
        """Take the rotation from the loaded model's own rotary embedding (rope_from_model); it
        replaces the one built from the config. A model whose rotation cannot be reproduced turns
        this side's injection and capture off (loads and captures then fail into recompute).
        Returns what was found, for the engine's log."""
        try:
            found = rope_from_model(model)
        except UnsupportedRope as e:
            with self._rotator_lock:
                self._rope, self._rotator = None, None
            return f"KV injection and capture off: {e}"
        agreed = self._rope is not None and self._rope.same_rotation(found)
        with self._rotator_lock:
            self._rope, self._rotator = found, None
        return f"rope from the model: {found.source}" + ("" if agreed else " (replaces the config's)")

    def _spec(self) -> RopeSpec:
        if self._rope is None:
            raise RuntimeError("this model's RoPE cannot be re-rotated: KV injection and capture are off")
        return self._rope

    def _rotator_for_use(self) -> Rotator:
        """The Rotator of the current rope, built once; the engine thread and preparing threads share it
        (it holds only the read-only table)."""
        with self._rotator_lock:
            if self._rotator is None:
                self._rotator = Rotator(self._spec(), self._max_positions)
            return self._rotator

    def prepare(self, segments: Sequence[KVSegment]) -> PreparedInjection:
        """The segments' KV rotated to positions 0..end-1 and cast to the engine's dtype, for a
        request not yet submitted. Safe in any thread, concurrently with loads: its tensors are its
        own (pooled buffers no live injection views, never the staging buffers loads go through)."""
        return prepare(segments, self._rotator_for_use(), self._dtype, self._buffers)

    def _attention_layers(self, forward_context: ForwardContext) -> list[Any]:
        if self._layers is None:
            named = [
                (int(m.group(1)), layer)
                for name, layer in forward_context.no_compile_layers.items()
                if (m := _LAYER_INDEX.search(name)) and isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
                and getattr(layer, "impl", None) is not None
            ]
            self._layers = [layer for _, layer in sorted(named, key=lambda x: x[0])]
            by_id = {id(layer): i for i, layer in enumerate(self._layers)}
            self._layer_index = {name: by_id[id(layer)] for name, layer in forward_context.no_compile_layers.items()
                                 if id(layer) in by_id}
        return self._layers

    # ---- loads (start_load_kv) --------------------------------------------------------------------
    def start_load_kv(self, meta: SegmentConnectorMetadata, forward_context: ForwardContext) -> None:
        if not meta.loads and not meta.captures:
            return
        layers = self._attention_layers(forward_context)
        inline = []
        for load in meta.loads:
            if load.request_id is not None:
                self._submit(load, layers)
            else:
                inline.append(load)
        if inline and self._overlap_layers:  # written while the forward pass runs (wait_for_layer_load)
            self._layered = LayeredLoad(self._layer_pool, [(ld, self._layer_writes(ld, layers, self._staging)) for ld in inline],
                                        len(layers))
            return
        for load in inline:
            try:
                self._load(load, layers, self._staging)
            except Exception as e:  # noqa: BLE001 - a failed load is recomputed; the step goes on
                self._inline_failed(load, e)

    def _inline_failed(self, load: SegmentLoad, error: BaseException) -> None:
        logger.error("segment load %s failed; its blocks will be recomputed", load.key,
                     exc_info=(type(error), error, error.__traceback__))
        self.counters.load_failed()
        self._failed_blocks.update(s // self._block_size for s in load.slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before `layer_name`'s attention: wait until this step's inline loads wrote its KV."""
        if self._layered is not None:
            self.layer_waits += 1
            self._layered.wait_layer(self._layer_index.get(layer_name, -1))

    def _join_layered(self) -> None:
        if self._layered is not None:
            layered, self._layered = self._layered, None
            for load, error in layered.join():
                self._inline_failed(load, error)

    def _submit(self, load: SegmentLoad, layers: list[Any]) -> None:
        assert load.request_id is not None
        if self._loader is None:
            self._loader = AsyncLoader(after_load=device_sync(layers))

        def run() -> None:
            try:
                self._load(load, layers, self._loader_staging)
            except Exception:
                self.counters.load_failed()
                raise

        self._loader.submit(load.request_id, frozenset(s // self._block_size for s in load.slots), run)

    def get_finished(self) -> set[str]:
        """Requests whose asynchronous loads ended since the last call; the blocks of those that
        failed join the load errors vLLM reads right after, in the same output."""
        if self._loader is None:
            return set()
        drained = self._loader.drain()
        self._failed_blocks.update(drained.failed_blocks)
        return set(drained.finished)

    @property
    def loader(self) -> AsyncLoader | None:
        return self._loader

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown()
        if self._layer_pool is not None:
            self._layer_pool.shutdown(wait=True)

    def _load(self, load: SegmentLoad, layers: list[Any], staging: Staging) -> None:
        for _ in self._layer_writes(load, layers, staging):
            pass

    def _layer_writes(self, load: SegmentLoad, layers: list[Any], staging: Staging) -> Iterator[None]:
        """Write `load` one layer per step of the generator (its checks, and for unprepared
        segments the rotation of the whole range, run before the first layer)."""
        t0 = time.perf_counter()
        inj = self._table.injection(load.key)
        if inj is None:
            raise RuntimeError(f"segments for {load.key} were withdrawn before the load")
        first = inj.segments[0]
        if first.keys.shape[0] != len(layers):
            raise RuntimeError(f"segments have {first.keys.shape[0]} layers, the model {len(layers)}")
        device = layers[0].kv_cache.device  # the host's KV goes to the cache's device (no copy on CPU)
        slots = torch.tensor(load.slots, dtype=torch.long, device=device)
        prepared = self._usable(inj.prepared, load.key)
        rotated = None if prepared is not None else self._rotated(inj, load, len(layers), staging)
        for i, layer in enumerate(layers):
            # prepared: rotated and cast in the pull path, only sliced here
            keys, values = prepared.layer_range(i, load.start, load.end) if prepared is not None else (rotated[0][i], rotated[1][i])
            layer.impl.do_kv_cache_update(layer, keys.to(device), values.to(device), layer.kv_cache, slots)
            yield
        self.counters.injected(load.end - load.start, time.perf_counter() - t0, prepared=prepared is not None,
                               background=load.request_id is not None)

    def _usable(self, prepared: PreparedInjection | None, key: str) -> PreparedInjection | None:
        """The prepared KV when it was made for this engine (its rotation and dtype), else None: the
        load then rotates the segments here (the old path), which is always right."""
        if prepared is None:
            return None
        if prepared.rope is not self._rope or prepared.dtype != self._dtype:
            logger.warning("prepared KV for %s is for another rotation or dtype (%s); rotating it on the engine thread",
                           key, prepared.dtype)
            return None
        return prepared

    def _rotated(self, inj: Injection, load: SegmentLoad, num_layers: int, staging: Staging) -> tuple[torch.Tensor, torch.Tensor]:
        """The unprepared path: the range copied into staging, rotated to its positions and cast
        (keys, values [layers, n, heads, dim] in the engine's dtype)."""
        first = inj.segments[0]
        rotator = self._rotator_for_use()
        n = load.end - load.start
        keys, keys16, values = staging.views(num_layers, n, first.keys.shape[2], first.keys.shape[3], self._dtype)
        inj.copy_range(load.start, load.end, keys, values)
        rotator.apply_(keys, torch.arange(load.start, load.end))
        keys16.copy_(keys)
        return keys16, values

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- captures (wait_for_save) -----------------------------------------------------------------
    def wait_for_save(self, meta: SegmentConnectorMetadata) -> None:
        self._join_layered()  # the step's inline loads are all written before its output is read
        for cap in meta.captures:
            try:
                self._table.put_capture(cap.key, CaptureResult(segments=self._capture(cap)))
                self.counters.captured()
            except Exception as e:
                logger.exception("segment capture %s failed", cap.key)
                self.counters.capture_failed()
                self._table.put_capture(cap.key, CaptureResult(error=f"{type(e).__name__}: {e}"))

    def _capture(self, cap: SegmentCapture) -> tuple[KVSegment, ...]:
        if self._layers is None:
            raise RuntimeError("no attention layers seen yet")
        layers = self._layers
        if self._layout is None:
            self._layout = learn_cache_layout(layer_writer(layers[0]), layers[0].kv_cache, self._block_size,
                                              self._spec().head_dim, self._dtype)
            logger.info("segment captures read the paged KV as layout %s", self._layout.name)
        device = layers[0].kv_cache.device
        out = []
        for (a, b), slots in zip(cap.ranges, cap.slots, strict=True):
            idx = torch.tensor(slots, dtype=torch.long, device=device)
            ks, vs = zip(*(self._layout.read(layer.kv_cache, idx) for layer in layers), strict=True)
            # segments live on the host: read on the cache's device, copy, de-rotate there
            keys = remove_rope(torch.stack(ks).cpu(), torch.arange(a, b), self._spec())
            out.append(KVSegment(cap.token_ids[a:b], keys, torch.stack(vs).cpu()))  # stack: a new tensor, not a cache view
        return tuple(out)


def process_segment_worker() -> SegmentWorker | None:
    """This process's segment connector worker side (alone or inside a MultiConnector), if the
    engine in this process has one."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    group = get_kv_transfer_group()
    for connector in [group, *getattr(group, "sub_connectors", [])]:
        worker = getattr(connector, "worker_side", None)
        if isinstance(worker, SegmentWorker):
            return worker
    return None


def prepare_injection(segments: Sequence[KVSegment]) -> PreparedInjection | tuple[KVSegment, ...]:
    """For the submitter, before `EngineRunner.generate` (any thread but the engine's): the
    segments prepared by this process's segment worker, or the segments themselves when this
    process has no segment worker or its rotation is off (the engine then loads them as before,
    or recomputes). Raises what `SegmentWorker.prepare` raises; the caller falls back to the
    plain segments."""
    segs = tuple(segments)
    worker = process_segment_worker()
    if worker is None or worker.rope is None or not segs:
        return segs
    return worker.prepare(segs)


def bind_model_rope(model: Any) -> str | None:
    """For `LLMEngine.apply_model` (runs in the worker's process, on its loaded model): hand the
    model to this process's segment worker, so its rotation is the model's own. None when the
    engine has no segment connector."""
    worker = process_segment_worker()
    return None if worker is None else worker.bind_model(model)
