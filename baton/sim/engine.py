"""One simulated engine in simulated time: baton/engine/simulated's Scheduler (vLLM v1's
continuous batching, chunked prefill under a token budget, block pool with prefix caching, NIXL-
shaped handoffs) driven by a simpy clock instead of the wall clock, each step timed by a StepTimer
(AIConfigurator's measured GPU kernels, timing.py, or a fitted CPU model, calibrate.py).

The scheduler already separates planning from time: schedule() → batch_of() → (the step's time
passes) → update_from_output(). SimulatedEngine sleeps in between; here a simpy timeout does.

    loop: schedule → timer.step_time(batch) → env.timeout(t) → update_from_output → callbacks
          nothing to run: wait for the next transfer/handoff release, or for add()

KV that enters a request from outside is a "remote prefill" in the scheduler's terms; this engine's
handoff accounting times it by kind: a P/D handoff crosses the fleet's link (`link_gbps`), a
real-time window re-injection (Metronome, transfer_mode "inject") is a copy inside the GPU
(`inject_gbps`). Bytes are counted per kind.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import simpy

from baton.engine.simulated.blocks import BlockPool
from baton.engine.simulated.handoff import HandoffAccounting, HandoffLink
from baton.engine.simulated.kv_cache import KVCacheManager
from baton.engine.simulated.outputs import placeholder_token
from baton.engine.simulated.request import SimRequest
from baton.engine.simulated.scheduler import Scheduler, SchedulerLimits
from baton.engine.simulated.timing import StepBatch, StepTime
from baton.sim.contention import SharedHost
from kv_transfer.ledger import TransferLedger
from router.report import MAX_REPORTED_CONVERSATIONS, ReplicaReport

INJECT = "inject"


class StepTimer(Protocol):
    def step_time(self, batch: StepBatch) -> StepTime: ...


@dataclass(frozen=True)
class EngineShape:
    """One engine's hardware and limits (vLLM's defaults on H100/H200-class GPUs unless set)."""

    gpu: str  # AIConfigurator system name (h200_sxm, l40s) or "cpu"
    kv_capacity_tokens: int
    bytes_per_token: int  # the model's KV bytes per token (all layers, bf16)
    link_gbps: float  # the P/D link, Gbit/s
    inject_gbps: float  # window re-injection inside the GPU, Gbit/s
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768


class SimHandoff(HandoffAccounting):
    """HandoffAccounting whose receive time and bytes depend on the kind of KV coming in."""

    def __init__(self, link: HandoffLink, inject: HandoffLink):
        super().__init__(link, TransferLedger(max_records=1))
        self.inject = inject
        self.bytes_in: dict[str, int] = {"pd": 0, INJECT: 0}
        self.transfers_in = 0

    def begin_receive(self, request_id: str, blocks: int, params: dict[str, Any]) -> float:
        if params.get("transfer_mode") == INJECT:
            self.bytes_in[INJECT] += blocks * self.inject.bytes_per_block
            return self.inject.transfer_seconds(blocks)
        self.bytes_in["pd"] += blocks * self.link.bytes_per_block
        self.transfers_in += blocks > 0
        return super().begin_receive(request_id, blocks, params)


@dataclass
class Outcome:
    """What one request did, filled in as its tokens come (times are simulated seconds)."""

    sent_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    cached_tokens: int = 0


class DesEngine:
    """One engine: owns its scheduler and its busy time; requests complete as simpy events."""

    def __init__(self, env: simpy.Environment, replica_id: str, pool: str, shape: EngineShape, timer: StepTimer,
                 host: SharedHost | None = None):
        self.env, self.replica_id, self.pool, self.shape, self.timer = env, replica_id, pool, shape, timer
        self.host = host  # engines sharing a machine slow each other (contention.py); None: a device of its own
        block_bytes = shape.block_size * shape.bytes_per_token
        self.handoff = SimHandoff(HandoffLink(shape.link_gbps, block_bytes), HandoffLink(shape.inject_gbps, block_bytes))
        blocks = max(2, shape.kv_capacity_tokens // shape.block_size + 1)  # + the null block
        kv = KVCacheManager(BlockPool(blocks, shape.block_size, True), shape.max_model_len)
        limits = SchedulerLimits(shape.max_num_seqs, shape.max_num_batched_tokens, shape.max_model_len)
        self.scheduler = Scheduler(limits, kv, self.handoff, engine_id=replica_id, clock=lambda: env.now)
        self.busy_s = 0.0
        self.steps = 0
        self._pending: dict[str, tuple[Outcome, simpy.Event]] = {}
        self._served: dict[str, float] = {}  # session id -> when its latest turn arrived, since the last report
        self._wake = env.event()
        env.process(self._run())

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, request_id: str, tokens: list[int], max_tokens: int, params: dict[str, Any] | None = None,
               session_id: str | None = None) -> simpy.Event:
        """Add a request; the returned event fires with its Outcome when it finishes. `session_id`:
        its conversation, listed in the next report as a Baton decoder lists what it served."""
        done = self.env.event()
        if session_id:
            self._served[session_id] = self.env.now
        self._pending[request_id] = (Outcome(self.env.now), done)
        self.scheduler.add_request(SimRequest(request_id, tokens, max_tokens, self.shape.block_size, kv_transfer_params=params))
        if not self._wake.triggered:
            self._wake.succeed()
        return done

    # ---- the loop ---------------------------------------------------------------------------
    def _run(self) -> Any:
        sched = self.scheduler
        while True:
            if not sched.has_requests():
                self._wake = self.env.event()
                yield self._wake
                continue
            step = sched.schedule()
            if step.num_scheduled_tokens:
                t = self.timer.step_time(sched.batch_of(step)).seconds
                if self.host is not None:
                    t *= self.host.begin(self.replica_id)
                self.busy_s += t
                self.steps += 1
                yield self.env.timeout(t)
                if self.host is not None:
                    self.host.end(self.replica_id)
            else:
                due = sched.next_event_at()
                self._wake = self.env.event()
                if due is None:
                    yield self._wake
                else:
                    yield self._wake | self.env.timeout(max(0.0, due - self.env.now))
                continue
            self._deliver(sched.update_from_output(step, lambda r: placeholder_token(len(r.output_token_ids))))

    def _deliver(self, events: list[Any]) -> None:
        now = self.env.now
        for e in events:
            out, done = self._pending[e.request.request_id]
            if out.first_token_at is None:
                out.first_token_at = now
                out.cached_tokens = max(0, e.request.num_cached_tokens)
            out.last_token_at = now
            out.tokens += len(e.new_token_ids)
            if e.finish_reason is not None:
                del self._pending[e.request.request_id]
                out.output_token_ids = list(e.request.output_token_ids)
                out.kv_transfer_params = e.kv_transfer_params
                done.succeed(out)

    # ---- what it reports ----------------------------------------------------------------------
    def report(self) -> ReplicaReport:
        """The figures a Baton engine replica reports (router/report.py), from the scheduler, and the
        conversations whose turns arrived since the previous report (whose unreported load the
        directory then drops: router/unreported.py); starts the next report."""
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1
        usage = pool.get_usage()
        pending = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.requests.values())
        # resident = in use or cached; cached blocks are counted by hash (in use ones twice at most), capped
        resident = min(1.0, usage + len(pool.cached_block_hash_to_block) / usable)
        served = tuple(sorted(((sid, self.env.now - at) for sid, at in self._served.items()), key=lambda e: (e[1], e[0])))
        served = served[:MAX_REPORTED_CONVERSATIONS]  # the most recent, as a decoder's report bounds them
        self._served.clear()
        return ReplicaReport(self.replica_id, self.pool, kv_usage=usage, kv_resident=resident,
                             kv_capacity_tokens=usable * pool.block_size, num_running=len(sched.running),
                             num_waiting=len(sched.waiting), pending_prefill_tokens=pending, in_flight=len(sched.requests),
                             conversations=served)


TimerFactory = Callable[[str], StepTimer]
