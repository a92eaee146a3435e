"""A fleet in simulated time: engine pools, Baton's conversation directory, and the clients.

Routing is Baton's own code, called as the ingress calls it: router/directory_state.DirectoryState
(its `route` runs router/policy.plan_turn, scoring, and placement.choose_prefill over the loads the
engines last reported, plus what it sent since), fed a ReplicaReport from every engine each
`report_period_s` (Baton's engines report every second). Real-time sessions are admitted by
router/admission.AIMDController (Metronome's AIMD cap on live sessions), fed every tick's latency.

A turn: route → (remote prefill: the prefill engine computes the prompt, max_tokens=1, and holds
its KV for the decoder; the decoder pulls the blocks its cache lacks over the link) → decode →
the reply is appended to the history. Conversations arrive open-loop (workloads.py); each sends
its next turn `think_s` after the previous reply ended; a real-time session sends a tick every
tick period (late when its previous reply was late: that latency counts from the tick's time).
At the end of the arrival horizon plus `drain_s`, whatever is unfinished has failed.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import simpy

from baton.sim.contention import SharedHost
from baton.sim.engine import INJECT, DesEngine, EngineShape, StepTimer
from baton.sim.slo import ConversationRun
from baton.sim.workloads import Conversation
from baton.traces.records import TurnRecord
from router.admission import AdmissionConfig, AIMDController
from router.directory_state import DirectorySettings, DirectoryState
from router.policy import Policy


@dataclass(frozen=True)
class PoolSpec:
    name: str  # "prefill" or "decode" (colocated: unified engines are the decode pool)
    count: int
    shape: EngineShape


@dataclass(frozen=True)
class FleetResult:
    runs: tuple[ConversationRun, ...]
    wall_s: float  # simulated seconds the fleet ran (every GPU powered throughout)
    busy_s: dict[str, float]  # replica -> seconds it ran steps
    gpu_of: dict[str, str]  # replica -> GPU name
    kv_bytes_pd: int  # P/D handoff bytes pulled by decoders
    kv_bytes_injected: int  # real-time window re-injection bytes (inside a GPU)
    handoffs: int
    directory_totals: dict[str, int]


class TokenIds:
    """Synthetic token ids: one range per shared prefix key, fresh ranges for everything else."""

    def __init__(self) -> None:
        self._next = 1000
        self._prefixes: dict[str, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        start = self._next
        self._next += n
        return list(range(start, start + n))

    def prefix(self, key: str, n: int) -> list[int]:
        if key not in self._prefixes:
            self._prefixes[key] = self.fresh(n)
        return self._prefixes[key]


class Fleet:
    """Owns the engines, the directory and the admission controller of one run."""

    def __init__(self, pools: Sequence[PoolSpec], policy: Policy, timer_for: Callable[[str], StepTimer],
                 report_period_s: float = 1.0, realtime_admission: AdmissionConfig | None = None, host_contention: float = 0.0):
        self.env = simpy.Environment()
        self.engines: dict[str, DesEngine] = {}
        # host_contention > 0: every engine on one machine, slowing each other (contention.py; the
        # CPU calibration); 0: each engine on a device of its own (the GPU fleets)
        host = SharedHost(host_contention) if host_contention else None
        for pool in pools:
            for i in range(pool.count):
                rid = f"{pool.name}-{pool.shape.gpu}-{i}"
                self.engines[rid] = DesEngine(self.env, rid, pool.name, pool.shape, timer_for(pool.shape.gpu), host)
        self.directory = DirectoryState(DirectorySettings(policy=policy))
        self.admission = AIMDController(realtime_admission or AdmissionConfig(target_p99_ms=450.0, initial_cap=8 * len(self.engines),
                                                                              max_cap=10_000))
        self.live_realtime = 0
        self.report_period_s = report_period_s
        self.ids = TokenIds()
        self._rid = itertools.count()
        self.runs: list[ConversationRun] = []
        self._open: dict[str, list[TurnRecord]] = {}  # the sent turns of conversations still running

    def run(self, conversations: Sequence[Conversation], until_s: float) -> FleetResult:
        self._report_all()
        self.env.process(self._reporter())
        self._all_done = self.env.event()
        self._expected = len(conversations)
        for c in conversations:
            self.env.process(self._conversation(c))
        if conversations:
            self.env.run(until=self._all_done | self.env.timeout(until_s))
        wall_s = max(self.env.now, 1e-9)
        done = {r.conversation_id for r in self.runs}
        for c in conversations:  # still running at the end: failed, never dropped
            if c.session_id not in done:
                self.runs.append(_unfinished(c, sent=self._open.get(c.session_id, [])))
        engines = self.engines.values()
        return FleetResult(
            runs=tuple(sorted(self.runs, key=lambda r: r.conversation_id)), wall_s=wall_s,
            busy_s={e.replica_id: e.busy_s for e in engines}, gpu_of={e.replica_id: e.shape.gpu for e in engines},
            kv_bytes_pd=sum(e.handoff.bytes_in["pd"] for e in engines),
            kv_bytes_injected=sum(e.handoff.bytes_in[INJECT] for e in engines),
            handoffs=sum(e.handoff.transfers_in for e in engines),
            directory_totals=dict(self.directory.totals))

    # ---- control plane ------------------------------------------------------------------------
    def _report_all(self) -> None:
        now = self.env.now
        for e in self.engines.values():
            self.directory.report(e.report(), now)

    def _reporter(self) -> Any:
        while True:
            yield self.env.timeout(self.report_period_s)
            self._report_all()
            self.admission.update(self.env.now, self.live_realtime)

    # ---- clients ------------------------------------------------------------------------------
    def _conversation(self, c: Conversation) -> Any:
        env = self.env
        yield env.timeout(c.arrival_s)
        realtime = c.window_tokens is not None
        if realtime:
            if not self.admission.can_admit(self.live_realtime).admitted:
                self._finished(_unfinished(c, rejected=True))
                return
            self.live_realtime += 1
        records: list[TurnRecord] = self._open.setdefault(c.session_id, [])
        sinks = self.ids.prefix(c.prefix_key, c.prefix_tokens)
        history = list(sinks)
        tick_at = env.now
        for k, turn in enumerate(c.turns):
            if realtime:
                tick_at += turn.think_s
                yield env.timeout(max(0.0, tick_at - env.now))
            elif k:
                yield env.timeout(turn.think_s)
            scheduled = tick_at if realtime else env.now
            history += self.ids.fresh(turn.new_tokens)
            record, reply = yield from self._turn(c, k, turn.effective, history, turn.max_tokens, scheduled)
            records.append(record)
            if realtime:
                self.admission.observe(record.e2e_s, env.now)
            if not record.ok:
                break
            history += reply
        if realtime:
            self.live_realtime -= 1
        self.directory.end_conversation(c.session_id, c.user)
        del self._open[c.session_id]
        self._finished(ConversationRun(c.session_id, tuple(t.effective for t in c.turns), tuple(t.deadline_s for t in c.turns),
                                       tuple(records)))

    def _finished(self, run: ConversationRun) -> None:
        self.runs.append(run)
        if len(self.runs) == self._expected and not self._all_done.triggered:
            self._all_done.succeed()

    def _turn(self, c: Conversation, k: int, effective: bool, history: list[int], max_tokens: int, scheduled: float) -> Any:
        env = self.env
        rid = f"{c.session_id}-{k}-{next(self._rid)}"
        prompt = history
        params: dict[str, Any] | None = None
        if c.window_tokens is not None:  # [sinks][last W tokens][chunk]: the window re-injected, not recomputed
            prompt = history[:c.prefix_tokens] + history[c.prefix_tokens:][-(c.window_tokens + c.turns[k].new_tokens):]
            params = {"do_remote_prefill": True, "transfer_mode": INJECT} if k else None
        limit = next(iter(self.engines.values())).shape.max_model_len
        if len(prompt) + max_tokens >= limit:
            return _record(c, k, effective, scheduled, None, error="prompt too long"), []
        plan = self.directory.route(c.session_id, c.user, len(prompt), env.now)
        if plan.remote_prefill and params is None and plan.prefill_replica is not None:
            out = yield self.engines[plan.prefill_replica].submit(rid + "-p", prompt, 1, {"do_remote_decode": True})
            params = out.kv_transfer_params
        out = yield self.engines[plan.decode_replica].submit(rid, prompt, max_tokens, params, session_id=c.session_id)
        self.directory.served(c.session_id, plan.decode_replica, env.now)
        return _record(c, k, effective, scheduled, out), out.output_token_ids


def _record(c: Conversation, k: int, effective: bool, sent: float, out: Any, error: str | None = None) -> TurnRecord:
    if out is None:
        return TurnRecord(c.session_id, k, "user", effective, sent, None, 0.0, None, None, None, None, error=error)
    return TurnRecord(c.session_id, k, "user", effective, sent, out.first_token_at - sent, out.last_token_at - sent,
                      None, out.tokens, out.cached_tokens, 200)


def _unfinished(c: Conversation, rejected: bool = False, sent: Sequence[TurnRecord] = ()) -> ConversationRun:
    return ConversationRun(c.session_id, tuple(t.effective for t in c.turns), tuple(t.deadline_s for t in c.turns), tuple(sent),
                           rejected=rejected)
