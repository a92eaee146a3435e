"""SegmentConnector: a vLLM KV connector that injects and captures position-free KV segments.

Per request, through `kv_transfer_params["baton_segments"]`:
- `{"key": K, "inject_end": E}`: prompt positions [0, E) are supplied from the segments offered
  under K in this process's SegmentTable (kv_transfer/segments.py), each key re-rotated to its
  position; vLLM computes only [E, prompt_len). Positions already in the local prefix cache are
  not loaded again (the load starts at the local hit length).
- `{"key": K, "capture": [[a, b], ...]}`: once the prompt is computed, read the KV of positions
  [a, b) from the paged cache, remove RoPE, and put the segments under K (take_capture).

vLLM builds one connector per role (as with its NixlConnector): the scheduler's and the
worker's. This class is the thin shell vLLM loads by name (kv_transfer/config.py); it builds the
side its role needs and forwards each KVConnectorBase_V1 method to the side that owns it:
- scheduler side (kv_transfer/segment_scheduler.py): matching, allocation, step metadata,
  capture tracking through chunked prefill and preemption;
- worker side (kv_transfer/segment_worker.py): loads (asynchronous ones on the loader thread of
  kv_transfer/segment_loader.py, reported by get_finished), captures, failed blocks;
- shared: the step metadata and request parameters (kv_transfer/segment_meta.py).
Invariant: exactly one side exists, the one of `role`; calling the other side's method raises.
Each side counts its own work; `kv_transfer.segment_stats.segment_stats()` reads the totals.

Both sides meet the submitting code in the process SegmentTable (one engine per process,
in-process engine with one worker).

Hybrid memory allocator (HMA): the class declares vLLM's `SupportsHMA`, so an engine that runs it
(alone or inside vLLM's MultiConnector, which supports HMA only when every child does) keeps vLLM's
hybrid KV cache manager on — without it a hybrid (Mamba/conv/GDN) model cannot start. Honouring it:
`request_finished_all_groups` (the per-group block ids HMA passes) ends a request like
`request_finished`; on an engine whose KV cache is not one full-attention group the scheduler side
is disabled with the reason (segment_scheduler.kv_cache_blocker), so no load or capture is ever
planned against a recurrent or sliding-window group and every injection is recomputed. This
connector never restores recurrent state, so it keeps the base class's
`supports_divergent_local_hybrid_hits = False`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kv_transfer.segment_meta import PARAMS_KEY, SegmentConnectorMetadata
from kv_transfer.segment_scheduler import SegmentScheduler
from kv_transfer.segment_worker import SegmentWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# PARAMS_KEY (defined in segment_meta): the runner names its request parameters by it
__all__ = ["PARAMS_KEY", "SegmentConnector", "SegmentConnectorMetadata"]


class SegmentConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._scheduler: SegmentScheduler | None = None
        self._worker: SegmentWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SegmentScheduler.from_config(vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self._worker = SegmentWorker.from_config(vllm_config)
        else:
            raise ValueError(f"unsupported KV connector role {role!r}")

    @property
    def scheduler_side(self) -> SegmentScheduler | None:
        return self._scheduler

    @property
    def worker_side(self) -> SegmentWorker | None:
        return self._worker

    def _sched(self) -> SegmentScheduler:
        if self._scheduler is None:
            raise RuntimeError(f"a scheduler-side method was called on the {self.role.name} connector")
        return self._scheduler

    def _work(self) -> SegmentWorker:
        if self._worker is None:
            raise RuntimeError(f"a worker-side method was called on the {self.role.name} connector")
        return self._worker

    def _meta(self) -> SegmentConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SegmentConnectorMetadata):
            raise TypeError(f"expected SegmentConnectorMetadata, got {type(meta).__name__}")
        return meta

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """HMA's end of a request (block ids per KV cache group): nothing is saved asynchronously,
        so no group's blocks are held; segments only ever used group 0."""
        return self._sched().request_finished(request, block_ids[0] if block_ids else [])

    # ---- worker side --------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv(self._meta(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # an asynchronous load ends before its request is scheduled (get_finished); this step's
        # inline loads may still be writing later layers (kv_transfer/layered_load.py)
        self._work().wait_for_layer_load(layer_name)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(nothing is sent, the requests whose asynchronous segment loads ended)."""
        return None, self._work().get_finished() or None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # captures read the paged cache after the step, in wait_for_save

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        super().shutdown()
