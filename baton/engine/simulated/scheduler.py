"""The simulated engine's scheduler: vLLM v1's Scheduler.schedule() for full attention, no spec decode.

Each step:
1. running requests first, in order: each gets min(its remaining tokens, the token budget) — one
   token for a decode, a chunk for a prefill (chunked prefill under max_num_batched_tokens). When
   its blocks do not fit, the last running request is preempted (recompute: blocks freed,
   progress reset, back to the front of the waiting queue) until they do, or it preempts itself;
2. then, only if nobody was preempted, waiting requests in order while fewer than max_num_seqs
   run: prefix-cache lookup (whole blocks, at most num_tokens - 1 tokens), admission only if the
   whole sequence fits (vLLM's scheduler_reserve_full_isl), a chunk under the remaining budget.
   A request whose prompt KV comes from a prefill engine is admitted with all its prompt blocks,
   waits (WAITING_FOR_REMOTE_KVS) until the transfer is done, then computes its last prompt token.
After the step, every request whose computed tokens reached its length samples one token; one that
reached max_tokens or max_model_len finishes ("length"). A prefill engine's handoff request keeps
its blocks for the reader (`held`) and returns NIXL-shaped params.

Invariants (check_integrity): running ≤ max_num_seqs; every request is in exactly one of running,
waiting (incl. waiting for remote KV); only their blocks and held handoffs hold references, so
the block pool's integrity plus: blocks in use == blocks held by requests and handoffs.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baton.engine.simulated.blocks import Block
from baton.engine.simulated.handoff import HandoffAccounting, producer_params
from baton.engine.simulated.kv_cache import KVCacheManager, cdiv
from baton.engine.simulated.request import SimRequest, Status
from baton.engine.simulated.timing import PrefillChunk, StepBatch


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ScheduledStep:
    """What one step runs: tokens per request id, each request's computed tokens before it (for
    one admitted this step: its prefix hit), who was admitted from waiting, who was preempted."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    computed_before: dict[str, int] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class StepEvent:
    """A request that sampled a token this step, or finished."""

    request: SimRequest
    new_token_ids: tuple[int, ...]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _Held:
    blocks: list[Block]
    release_at: float


class Scheduler:
    """Owns the waiting and running queues; the KVCacheManager owns their blocks."""

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, handoff: HandoffAccounting | None = None,
                 engine_id: str = "simulated", tp: int = 1, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.kv_cache_manager = kv
        self.block_size = kv.block_size
        self.handoff = handoff
        self.engine_id = engine_id
        self.tp = tp
        self.clock = clock
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.requests: dict[str, SimRequest] = {}
        self.held: dict[str, _Held] = {}

    # ---- queues ------------------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, request_id: str) -> bool:
        """Abort: drop the request and free its blocks. False if it is not here (finished)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status == Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if req.status == Status.WAITING_FOR_REMOTE_KVS and self.handoff is not None:
            self.handoff.end_receive(request_id, ok=False)
        req.status = Status.FINISHED
        self.kv_cache_manager.free(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones whose blocks wait for a handoff's reader."""
        return self.has_unfinished_requests() or bool(self.held)

    def next_event_at(self) -> float | None:
        """When a transfer completes or a handoff's blocks are released, if anything waits on time."""
        times = [h.release_at for h in self.held.values()]
        times += [r.kv_ready_at for r in self.waiting if r.status == Status.WAITING_FOR_REMOTE_KVS]
        return min(times) if times else None

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        self._release_held()
        step = ScheduledStep()
        budget = self.limits.max_num_batched_tokens
        budget = self._schedule_running(step, budget)
        if not step.preempted:
            self._schedule_waiting(step, budget)
        for rid, n in step.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        return step

    def _schedule_running(self, step: ScheduledStep, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.limits.max_model_len - req.num_computed_tokens - 1)
            if n <= 0:
                i += 1
                continue
            while (self.kv_cache_manager.allocate_slots(req, n)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != Status.RUNNING:  # it preempted itself: nothing more fits
                break
            step.num_scheduled_tokens[req.request_id] = n
            step.computed_before[req.request_id] = req.num_computed_tokens
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, step: ScheduledStep, budget: int) -> None:
        skipped: list[SimRequest] = []
        while budget > 0 and self.waiting and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            if req.status == Status.WAITING_FOR_REMOTE_KVS and not self._remote_kv_arrived(req):
                skipped.append(self.waiting.popleft())
                continue
            ext = 0
            hit: list[Block] = []
            num_local = 0
            if req.num_computed_tokens == 0:
                hit, num_local = self.kv_cache_manager.get_computed_blocks(req)
                if req.is_remote_prefilled and self.handoff is not None:
                    ext = max(0, req.num_prompt_tokens - num_local)
                computed = num_local + ext
            else:
                computed = req.num_computed_tokens
            n = 0 if ext else min(req.num_tokens - computed, budget)
            if self.kv_cache_manager.allocate_slots(req, n, num_local, hit, ext, delay_cache_blocks=bool(ext),
                                                    full_sequence_must_fit=True) is None:
                break
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
            req.num_computed_tokens = computed
            if ext:
                self._begin_receive(req, num_local)
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.running.append(req)
            req.status = Status.RUNNING
            step.num_scheduled_tokens[req.request_id] = n
            step.computed_before[req.request_id] = computed
            step.admitted.append(req.request_id)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, req: SimRequest) -> None:
        self.kv_cache_manager.free(req.request_id)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- handoff -----------------------------------------------------------------------------
    def _begin_receive(self, req: SimRequest, num_local: int) -> None:
        assert self.handoff is not None
        blocks = cdiv(req.num_prompt_tokens, self.block_size) - num_local // self.block_size
        req.status = Status.WAITING_FOR_REMOTE_KVS
        req.kv_ready_at = self.clock() + self.handoff.begin_receive(req.request_id, blocks, req.kv_transfer_params or {})

    def _remote_kv_arrived(self, req: SimRequest) -> bool:
        """vLLM's _update_waiting_for_remote_kv: cache the loaded blocks, recompute the last token."""
        if self.clock() < req.kv_ready_at:
            return False
        assert self.handoff is not None
        self.handoff.end_receive(req.request_id, ok=True)
        self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens -= 1
        req.status = Status.WAITING
        return True

    def _release_held(self) -> None:
        now = self.clock()
        for rid in [rid for rid, h in self.held.items() if h.release_at <= now]:
            held = self.held.pop(rid)
            self.kv_cache_manager.block_pool.free_blocks(reversed(held.blocks))
            if self.handoff is not None:
                self.handoff.release(rid)

    # ---- after the step ----------------------------------------------------------------------
    def batch_of(self, step: ScheduledStep) -> StepBatch:
        """The step's work as the timing model sees it: decodes (one new token after outputs) and chunks."""
        prefills: list[PrefillChunk] = []
        decodes: list[int] = []
        for rid, n in step.num_scheduled_tokens.items():
            req = self.requests[rid]
            before = step.computed_before[rid]
            if n == 1 and req.output_token_ids and before == req.num_tokens - 1:
                decodes.append(before)
            else:
                prefills.append(PrefillChunk(n, before))
        return StepBatch(tuple(prefills), tuple(decodes))

    def update_from_output(self, step: ScheduledStep, next_token: Callable[[SimRequest], int]) -> list[StepEvent]:
        """Sample for every request whose prompt (and outputs) are all computed; finish those done."""
        events: list[StepEvent] = []
        for rid in step.num_scheduled_tokens:
            req = self.requests[rid]
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk short of the end: nothing to sample
                continue
            token = next_token(req)
            req.append_output(token)
            if len(req.output_token_ids) < req.max_tokens and req.num_tokens < self.limits.max_model_len:
                events.append(StepEvent(req, (token,), None))
                continue
            events.append(StepEvent(req, (token,), "length", self._finish(req)))
        return events

    def _finish(self, req: SimRequest) -> dict[str, Any] | None:
        """Leave the engine; a handoff's producer keeps its blocks for the reader and returns params."""
        self.running.remove(req)
        self.requests.pop(req.request_id)
        req.status = Status.FINISHED
        if not (req.is_prefill_producer and self.handoff is not None and self.kv_cache_manager.num_blocks(req.request_id)):
            self.kv_cache_manager.free(req.request_id)
            return None
        blocks = self.kv_cache_manager.take_blocks(req.request_id)
        hold_s = self.handoff.offer(req.request_id, len(blocks))
        self.held[req.request_id] = _Held(blocks, self.clock() + hold_s)
        return producer_params(self.engine_id, req.request_id, [b.block_id for b in blocks], req.num_computed_tokens, self.tp)

    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant in the module docstring does not hold."""
        pool = self.kv_cache_manager.block_pool
        pool.check_integrity()
        assert len(self.running) <= self.limits.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        queued = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(queued) == len(set(queued)) == len(self.requests), "a request is queued twice, or not at all"
        refs: dict[int, int] = {}
        for blocks in [*self.kv_cache_manager.req_to_blocks.values(), *(h.blocks for h in self.held.values())]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, held {refs.get(b.block_id, 0)} times"
