"""Load figures read from vLLM's in-process scheduler (engine thread only; pure reads, no vLLM import),
and the few facts about it the engine loop and the segment connector act on.

The scheduler exists in this process when VLLM_ENABLE_V1_MULTIPROCESSING=0; with any other engine
(a fake in tests, a multiprocess engine) `find_scheduler` returns None and the stats carry only
the runner's own counters.
"""
from __future__ import annotations

from typing import Any

from baton.engine.types import EngineStats


def find_scheduler(engine: Any) -> Any:
    """The in-process scheduler (present with VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def kv_capacity_tokens(sched: Any) -> int:
    try:
        return int(sched.kv_cache_manager.block_pool.num_gpu_blocks * sched.block_size)
    except AttributeError:
        return 0


def block_tokens(sched: Any) -> int:
    """Tokens per KV block of the scheduler's pool (0: unknown)."""
    size = getattr(sched, "block_size", 0)
    return size if isinstance(size, int) and size > 0 else 0


def cached_fraction(sched: Any) -> float:
    """Blocks holding prefix-cached KV (in use or free for reuse) over the pool: what a session's
    retained history occupies even between its requests."""
    try:
        pool = sched.kv_cache_manager.block_pool
        return min(1.0, len(pool.cached_block_hash_to_block) / max(1, pool.num_gpu_blocks - 1))
    except (AttributeError, TypeError):
        return 0.0


def scheduler_stats(sched: Any, capacity_tokens: int, in_flight: int, steps: int) -> EngineStats:
    """A healthy engine's snapshot: the scheduler's queues and KV pool, plus the runner's counters."""
    if sched is None:
        return EngineStats(kv_capacity_tokens=capacity_tokens, in_flight=in_flight, steps=steps)
    requests = list(sched.running) + list(sched.waiting)
    usage = float(sched.kv_cache_manager.usage)
    return EngineStats(
        kv_usage=usage,
        kv_resident=max(usage, cached_fraction(sched)),
        kv_capacity_tokens=capacity_tokens,
        kv_block_tokens=block_tokens(sched),
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        pending_prefill_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in requests),
        in_flight=in_flight,
        steps=steps,
    )


def wire_segment_scheduler(scheduler: Any) -> None:
    """Let the segment connector's scheduler side see whether other requests run (it loads in the
    background only then: kv_transfer/segment_scheduler.py)."""
    if getattr(scheduler, "connector", None) is None:  # no connector (or a stand-in engine): nothing to wire, no vLLM import
        return
    from kv_transfer.segment_scheduler import segment_scheduler_of

    side = segment_scheduler_of(scheduler)
    if side is not None:
        side.others_running = lambda: bool(scheduler.running)


def none_running(scheduler: Any) -> bool:
    """Whether vLLM's scheduler runs no request (asked of an engine with unfinished requests: they
    all wait, on KV being loaded); False when it cannot tell (no scheduler found)."""
    running = getattr(scheduler, "running", None)
    return isinstance(running, list) and not running
