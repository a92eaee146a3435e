"""A stand-in for vLLM's LLMEngine, driven by EngineRunner exactly as vLLM is.

The surface is what the runner and baton/engine/scheduler_stats.py use: `add_request(rid, prompt,
params)` (prompt: {"prompt_token_ids", "cache_salt"?}, params: vLLM SamplingParams),
`abort_request([rid])`, `step()` → RequestOutput-likes (outputs.py), `has_unfinished_requests()`,
`shutdown()`, and `engine_core.engine_core.scheduler` with running, waiting, kv_cache_manager
(usage, block_pool.num_gpu_blocks, cached_block_hash_to_block), block_size and has_requests().

step() is schedule → sleep the step's predicted GPU time (step_table.py by default, or timing.py;
× time_scale) → sample and
finish. A step with nothing to run waits for the next transfer or handoff release (at most
IDLE_WAIT_S, so the runner drains new requests meanwhile).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from baton.engine.args import EngineSpec
from baton.engine.simulated.blocks import BlockPool
from baton.engine.simulated.config import SimulatedSpec
from baton.engine.simulated.geometry import kv_geometry
from baton.engine.simulated.handoff import HandoffAccounting, HandoffLink
from baton.engine.simulated.kv_cache import KVCacheManager
from baton.engine.simulated.outputs import RequestOutput, delta_output, placeholder_token
from baton.engine.simulated.request import SimRequest
from baton.engine.simulated.scheduler import Scheduler, SchedulerLimits
from baton.engine.simulated.step_table import TableStepTimer
from baton.engine.simulated.step_table_cache import load_or_build
from baton.engine.simulated.timing import AicStepTimer, StepBatch, StepTime

IDLE_WAIT_S = 0.01


class StepTimer(Protocol):
    def step_time(self, batch: StepBatch) -> StepTime: ...


@dataclass(frozen=True)
class _Core:
    """Where scheduler_stats looks for the scheduler: engine.engine_core.engine_core.scheduler."""

    scheduler: Scheduler


@dataclass(frozen=True)
class _CoreClient:
    engine_core: _Core


@dataclass(frozen=True)
class SimParams:
    """The part of vLLM's SamplingParams a simulated engine reads (placeholder tokens: no sampling)."""

    max_tokens: int | None
    extra_args: dict[str, Any] | None = None
    logprobs: int | None = None


class SimulatedEngine:
    """One simulated engine; like vLLM's, used from one thread only."""

    def __init__(self, scheduler: Scheduler, timer: StepTimer, time_scale: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.scheduler = scheduler
        self.timer = timer
        self.time_scale = time_scale
        self.sleep = sleep
        self.engine_core = _CoreClient(_Core(scheduler))
        self.steps = 0
        self.busy_seconds = 0.0  # predicted GPU time of all steps so far (before time_scale)

    def engine_inputs(self, req: Any, kv_transfer_params: dict[str, Any] | None) -> tuple[dict[str, Any], SimParams]:
        """(prompt, params) for add_request, without vLLM: the runner asks its engine for these when
        the engine offers them (importing vLLM for its SamplingParams cost a stand-in replica
        seconds of CPU on its first request and ~0.5 GiB of RSS, for three fields)."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        return prompt, SimParams(max_tokens=req.sampling.max_tokens, extra_args=extra, logprobs=0 if req.sampling.logprobs else None)

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        tokens = list(prompt["prompt_token_ids"])
        limit = self.scheduler.limits.max_model_len
        if not tokens or len(tokens) >= limit:
            raise ValueError(f"the prompt has {len(tokens)} tokens; it must have 1 to {limit - 1} (max_model_len {limit})")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request {request_id!r} is already running")
        extra = getattr(params, "extra_args", None) or {}
        self.scheduler.add_request(SimRequest(
            request_id=request_id,
            prompt_token_ids=tokens,
            max_tokens=params.max_tokens if params.max_tokens is not None else limit - len(tokens),
            block_size=self.scheduler.block_size,
            cache_salt=prompt.get("cache_salt"),
            kv_transfer_params=extra.get("kv_transfer_params"),
            want_logprobs=getattr(params, "logprobs", None) is not None,
        ))

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.finish_requests(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        step = sched.schedule()
        if step.num_scheduled_tokens:
            t = self.timer.step_time(sched.batch_of(step)).seconds
            self.busy_seconds += t
            self.sleep(t * self.time_scale)
        else:
            due = sched.next_event_at()
            self.sleep(IDLE_WAIT_S if due is None else min(IDLE_WAIT_S, max(0.0, due - sched.clock())))
        self.steps += 1
        events = sched.update_from_output(step, lambda r: placeholder_token(len(r.output_token_ids)))
        return [delta_output(e.request.request_id, e.request.prompt_token_ids, e.request.num_cached_tokens, e.new_token_ids,
                             e.finish_reason, e.request.want_logprobs, e.kv_transfer_params) for e in events]

    def shutdown(self) -> None:
        for rid in list(self.scheduler.requests):
            self.scheduler.finish_requests(rid)


def build_simulated_engine(spec: EngineSpec) -> SimulatedEngine:
    """The engine factory for `engine.kind: simulated` (EngineRunner's engine_factory)."""
    s = spec.simulated
    if s is None:
        raise ValueError("build_simulated_engine needs an EngineSpec with `simulated` set")
    geometry = kv_geometry(s.sim.model)
    tokens = s.sim.kv_capacity_tokens or geometry.tokens_in(s.sim.kv_cache_gib or 0.0, s.sim.tp)
    pool = BlockPool(max(2, tokens // s.block_size), s.block_size, s.enable_prefix_caching)
    handoff = None
    if s.handoff:
        from kv_transfer.ledger import process_ledger

        handoff = HandoffAccounting(HandoffLink(s.sim.link_gbps, s.block_size * geometry.bytes_per_token), process_ledger(),
                                    s.sim.time_scale)
    limits = SchedulerLimits(s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len)
    scheduler = Scheduler(limits, KVCacheManager(pool, s.max_model_len), handoff, engine_id=f"sim-{uuid.uuid4().hex[:12]}", tp=s.sim.tp)
    return SimulatedEngine(scheduler, step_timer_for(s), s.sim.time_scale)


def step_timer_for(s: SimulatedSpec) -> StepTimer:
    """`timer: table` (the default): the cached step table, built by the first replica that needs it;
    refused when the engine's limits reach past its grid. `timer: aiconfigurator`: AicStepTimer."""
    if s.sim.timer == "aiconfigurator":
        return AicStepTimer(s.sim.gpu, s.sim.model, s.sim.tp)
    table = load_or_build(s.step_table_dir, s.sim.gpu, s.sim.model, s.sim.tp)
    beyond = table.uncovered(s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len)
    if beyond:
        raise ValueError(f"the step table of {table.key.filename} does not reach this engine's limits: {'; '.join(beyond)}; "
                         f"set engine.simulated.timer: aiconfigurator")
    return TableStepTimer(table)
