"""The segment connector's scheduler side: which prompt positions a request gets from segments,
and in which step a capture can read its prompt's KV (kv_transfer/segment_connector.py).

It decides and records; it never touches a KV cache. Its output is one SegmentConnectorMetadata
per step, which the worker side (kv_transfer/segment_worker.py) carries out.

Rules (from vLLM's scheduler): a connector can only extend the local prefix-cache hit with a
contiguous run, and at least one prompt token must stay to compute, so inject_end < prompt length.
The offered segments' token ids must equal the prompt's first inject_end tokens, else nothing is
loaded (counted as `unavailable`) and vLLM computes the whole prompt.

KV cache groups (vLLM's hybrid memory allocator, HMA): segments are attention K/V only, laid at
slots of one block table. So injection and capture run only when the engine has exactly one KV
cache group and it is full attention (every layer shares block_ids[0]); `kv_cache_blocker` names
what else it finds — a recurrent (Mamba/conv/GDN) state group, whose state at the end of the
injected span no position-free segment can supply, or several attention groups (sliding window)
— and the side is then disabled: injections computed, captures failed at once with that reason.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv_transfer.segment_meta import SegmentCapture, SegmentConnectorMetadata, SegmentLoad, segment_params, slots_for
from kv_transfer.segment_stats import SegmentCounters, new_counters
from kv_transfer.segments import CaptureResult, SegmentTable, process_segments

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("baton.kv_transfer.segments")


def kv_cache_blocker(kv_cache_config: KVCacheConfig | None) -> str | None:
    """Pure: why segments cannot go into this engine's KV cache groups, or None when they can
    (one full-attention group; None config: the single-group layout connectors got before HMA)."""
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if kv_cache_config.has_mamba_layers:
        return ("the model keeps recurrent (Mamba/conv/GDN) state, and position-free attention segments cannot "
                "supply the state at the end of an injected span")
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        return f"{len(groups)} KV cache groups ({', '.join(kinds)}); segments are laid into one full-attention group"
    if not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        return f"the KV cache group is {type(groups[0].kv_cache_spec).__name__}, not full attention"
    return None


def async_min_tokens_configured(vllm_config: VllmConfig) -> int | None:
    """Pure: the connector's `kv_connector_extra_config["async_load_min_tokens"]` (kv_transfer/config.py
    sets it): loads of at least this many tokens run in the background; None (or absent): none do."""
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None) or {}
    value = extra.get("async_load_min_tokens")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"kv_connector_extra_config.async_load_min_tokens must be a count >= 0 or null, got {value!r}")
    return value


@dataclass
class _PendingCapture:
    """A capture request between its admission and the step that completes its prompt."""

    key: str
    ranges: tuple[tuple[int, int], ...]
    prompt: tuple[int, ...] = ()
    block_ids: list[int] = field(default_factory=list)


class SegmentScheduler:
    """Scheduler-side state: promised injections, loads to run this step, captures in flight."""

    def __init__(self, block_size: int, table: SegmentTable | None = None, counters: SegmentCounters | None = None,
                 disabled: str | None = None, async_min_tokens: int | None = None):
        """disabled: why this engine cannot inject or capture (a RoPE the worker cannot
        re-rotate exactly, kv_transfer/rope.py): every injection is refused (computed instead) and
        every capture fails at once with this reason, so callers fall back to recompute; the engine still serves.

        async_min_tokens: a load of at least this many tokens runs in the worker's background
        thread (kv_transfer/segment_loader.py) and its request waits in vLLM's
        WAITING_FOR_REMOTE_KVS while other requests step; a shorter one runs before the forward
        pass of the step that schedules it (writing it there costs less than the step its request
        would wait for). None: every load runs there. `others_running` (set by the engine runner:
        whether vLLM's scheduler runs any request): when it says none do, a load runs inline too,
        overlapped with the forward pass — in the background it would keep nothing else going and
        only cost its request a step."""
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        self._block_size = block_size
        self.disabled = disabled
        self.async_min_tokens = async_min_tokens
        self.others_running: Callable[[], bool] | None = None
        self._table = table if table is not None else process_segments()
        self.counters = counters if counters is not None else new_counters()
        self._matched: dict[str, tuple[int, bool]] = {}  # request id → (inject end promised, loaded asynchronously)
        self._pending_loads: list[SegmentLoad] = []
        self._pending_captures: dict[str, _PendingCapture] = {}

    @classmethod
    def from_config(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> SegmentScheduler:
        from kv_transfer.rope import UnsupportedRope, rope_from_vllm_config

        try:
            rope_from_vllm_config(vllm_config)
            why = kv_cache_blocker(kv_cache_config)
        except UnsupportedRope as e:
            why = str(e)
        disabled = None if why is None else f"KV injection and capture are off on this engine: {why}"
        if disabled is not None:
            logger.warning("%s; memories and real-time windows are computed from tokens instead", disabled)
        return cls(vllm_config.cache_config.block_size, disabled=disabled,
                   async_min_tokens=async_min_tokens_configured(vllm_config))

    @property
    def in_flight(self) -> int:
        """Requests this side still holds state for (promised injections and pending captures)."""
        return len(self._matched) + len(self._pending_captures)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        p = segment_params(request)
        end = int(p.get("inject_end") or 0) if p else 0
        if not end or num_computed_tokens >= end:
            return 0, False
        if self.disabled is not None:
            self.counters.refused()
            return 0, False
        inj = self._table.injection(p["key"])
        prompt = request.prompt_token_ids or []
        if inj is None or inj.end != end or end >= len(prompt):
            logger.warning("segment injection for %s unavailable (offered %s, asked %d): recomputing",
                           request.request_id, None if inj is None else inj.end, end)
            self.counters.refused()
            return 0, False
        if tuple(prompt[:end]) != inj.token_ids:
            logger.warning("segment tokens differ from request %s's prompt: recomputing", request.request_id)
            self.counters.refused()
            return 0, False
        n = end - num_computed_tokens
        # decided once per request: `async_min_tokens` may be changed while the engine runs (a
        # bench compares both ways), and vLLM's handling of this request follows the answer given here
        in_background = (self.async_min_tokens is not None and n >= self.async_min_tokens
                         and (self.others_running is None or self.others_running()))
        self._matched[request.request_id] = (end, in_background)
        return n, in_background

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        end, in_background = self._matched.pop(request.request_id, (0, False))
        p = segment_params(request)
        if num_external_tokens > 0 and end:
            block_ids = blocks.get_block_ids()[0]
            start = end - num_external_tokens
            # vLLM treats a positive external count after load_async=True as an asynchronous load
            rid = request.request_id if in_background else None
            self._pending_loads.append(SegmentLoad(p["key"], start, end, slots_for(block_ids, self._block_size, start, end), rid))
        if p and p.get("capture") and self.disabled is not None:
            self._table.put_capture(p["key"], CaptureResult(error=self.disabled))
        elif p and p.get("capture"):
            ranges = tuple((int(a), int(b)) for a, b in p["capture"])
            self._pending_captures[request.request_id] = _PendingCapture(p["key"], ranges)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SegmentConnectorMetadata:
        meta = SegmentConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self._pending_captures:
            self._track_captures(scheduler_output, meta)
        return meta

    def _track_captures(self, out: SchedulerOutput, meta: SegmentConnectorMetadata) -> None:
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
                self.counters.capture_failed()
                continue
            slots = tuple(slots_for(cap.block_ids, self._block_size, a, b) for a, b in cap.ranges)
            meta.captures.append(SegmentCapture(cap.key, cap.ranges, cap.prompt, slots))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._pending_captures.pop(request.request_id, None)
        return False, None


def segment_scheduler_of(scheduler: Any) -> SegmentScheduler | None:
    """The segment connector's scheduler side inside vLLM's scheduler (the connector alone or
    inside a MultiConnector), or None when the engine runs none."""
    connector = getattr(scheduler, "connector", None)
    for c in [connector, *getattr(connector, "_connectors", [])]:
        side = getattr(c, "scheduler_side", None)
        if isinstance(side, SegmentScheduler):
            return side
    return None
