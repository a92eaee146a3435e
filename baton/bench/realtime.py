"""`baton bench realtime`: Metronome — bounded (sink + window) vs unbounded real-time sessions.

Real components only, in this process: one vLLM engine per mode (SmolLM2 on CPU with the segment
connector, baton/engine/runner.py) with a deliberately small KV pool, fresh for each mode so the modes
share no cache state; the replica's session manager (baton/engine/realtime/manager.py); the client-side
ledgers (baton/bench/collapse.py); the token cliff predictor (router/cliff.py, fed by the manager's
token counts as a replica's report is) with its scoring (baton/bench/cliff_score.py) and the AIMD
controller (router/admission.py).

Workload: `sessions` long sessions per mode, one opening every `start_every_s` (a ramp), each a
client task that sends one LoCoMo dialog turn (tokenized with the model's tokenizer) every tick
period P. A tick's deadline is D after its *scheduled* send time; a session's ticks run in order
on the replica, so a slow tick delays the next and lateness is what the client sees. A tick still
unanswered `grace_s` after the session's last deadline is cancelled and counts as missing.

Definitions (reported as measured, nothing simulated):
- miss: a tick whose reply is late, empty, errored or missing (collapse.classify); collapse: a
  session with >= DEFAULT_CONSECUTIVE (3) consecutive misses; naive view: the server-side counter
  (ticks answered without error, errors, misses by its own receive -> last-token time).
- occupancy ρ: the fraction of the engine's usable KV blocks holding a live session's KV, read from
  the scheduler's block pool every SAMPLE_S. Unbounded: blocks in use or holding cached prefix KV
  (each session has its own cache salt, so every cached block is some session's history while no
  session has ended). Bounded: blocks in use only — its per-tick salts make every cached block
  single-use, dead KV that vLLM evicts on demand (reported as `cached_blocks`, not in ρ).
- cliff: every SAMPLE_S the predictor forecasts from the sessions' token counts (retained history
  in whole KV blocks, a tick in flight as every block its request holds; growth = min(offered,
  served); RealtimeSessions.token_growth) the seconds until retained tokens reach SAT_RHO of the
  pool's capacity; side by side, the same forecast from completed ticks only (`cliff.completed_ticks`)
  and counting whole histories (partial tail blocks as if held, ticks in flight not: `cliff.whole_history`).
  Measured saturation t_sat: the first sample with ρ >= SAT_RHO.
  Collapse onset: collapse.collapse_onset — the deadline of the first of DEFAULT_CONSECUTIVE (3)
  consecutive late-or-missing ticks of the engine, all sessions' ticks in scheduled-send order.
  Scored (cliff_score.score_cliff) at fits 25 / 50 / 75 % of the way from the first live sample to
  t_sat: e = |t̂ − t_sat| / (t_sat − t_fit) (and the same against the onset); `error` is the median
  of e over the fit points (RESULT cliff_prediction_error), `error_vs_onset` the onset's.
- AIMD (bounded engine, after its ramp): the phase ticks at its own P = D (Workload.aimd_period_s,
  shorter than the ramp's, so a few dozen sessions exceed what two cores hold at target) and
  offered load follows a step schedule (admission_sim.step_schedule): aimd_low sessions, aimd_high
  from 30 % of the phase, aimd_low again from 70 %; the cap starts at aimd_low, so the low part
  shows the additive increase and the high part (if it really exceeds the engine) the ×0.7
  decrease. N_sust (the ramp's largest live-session bucket within target) is reported, not used.
  Sessions last long enough to fill their window (admission_sim.ticks_to_fill, + 2
  ticks). Clients ask `can_admit(live)`, refused ones retry after `retry_after_s`; every tick
  latency is observed (a missing tick as a miss) and `update(now, live)` runs every SAMPLE_S; the
  decisions are logged (`caps`) and counted (RESULT aimd_decreases = decisions that decreased the
  cap). a = p99 of the admitted sessions' ticks in the second half / target (a missing tick is +inf).
  The controller runs with `overload: shed`: a decrease below the live sessions sheds the newest
  (router/shedding.choose_shed) as the ingress does — each is told at its next tick boundary (its
  ticks in flight are answered and counted; it sends none after) with the ingress's own error frame
  (deployments/realtime_sessions.ShedNotice) and close 1013, which the client reads as shed
  (`session_ending`), then retries after retry_after_s like a refused one. A shed session counts
  as shed, not as collapsed (the collapse count reads the other sessions); the log has each
  decision's `shed`, the JSON `aimd.shed_sessions`, the RESULT line `aimd_shed` (last).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from baton.bench.admission_sim import step_schedule, ticks_to_fill
from baton.bench.cliff_score import FIT_FRACTIONS, ForecastSample, score_cliff
from baton.bench.collapse import (
    DEFAULT_CONSECUTIVE,
    SessionLedger,
    TickOutcome,
    collapse_onset,
    is_miss,
    summarize,
)
from baton.paths import REPO_ROOT
from deployments.realtime_frames import CLOSE_TRY_LATER
from deployments.realtime_sessions import SessionRegistry, ShedNotice
from router.cliff import DecoderTokens, forecast_cliff
from router.shedding import SHED_CODE, choose_shed

ROOT = REPO_ROOT
LOCOMO = ROOT.parent / "shared" / "data" / "locomo"
PREAMBLE = "You are listening to a live conversation between two friends. After each line, reply with one short comment.\n"
SAMPLE_S = 0.5
SAT_RHO = 0.97
BUCKET = 4  # live-session buckets of the latency curve: 1-4, 5-8, ...


@dataclass(frozen=True)
class Workload:
    sessions: int  # long sessions per mode
    ticks: int  # ticks per long session
    start_every_s: float  # ramp: one session opens every this many seconds
    period_s: float  # P
    deadline_s: float  # D, from the scheduled send time
    sink_tokens: int  # S
    window_tokens: int  # W
    max_tokens: int  # reply tokens per tick
    kv_cache_tokens: int  # the engine's KV pool in tokens, whatever the dtype (small on purpose; _pool_gib)
    max_model_len: int
    grace_s: float  # unanswered this long after a session's last deadline: cancelled, missing
    target_p99_ms: float  # AIMD target, the SLO (tick latency p99, at the AIMD phase's period)
    aimd_s: float  # AIMD phase length
    aimd_ticks: int  # ticks per AIMD session, at least (more when the window needs more to fill)
    aimd_period_s: float  # P = D in the AIMD phase
    aimd_low: int  # sessions offered before the step up and after the step down
    aimd_high: int  # sessions offered during the step (meant to exceed what the engine holds at target)
    # the controller's own target as a share of the SLO: router/admission.py's advice for holding an
    # SLO (only probe periods run over the controller's target, so a whole-run p99 sits just over it)
    aimd_setpoint: float = 0.9


# P = D = 8 s, 4 reply tokens: a probe of 20 bounded sessions ticking together at P = 2 s with 8
# reply tokens took p50 2.2 s per tick on 2 shared cores with the machine otherwise quiet; quick runs
# at P = 4 s and 6 s collapsed both modes whenever other jobs held the load average at 15-20 (this
# process then gets ~0.35 cores), so the quick workload leaves ~2.5x that margin. A 6.9k-token pool
# (0.15 GiB in bf16, where these runs were made): 20 unbounded sessions grow ~5 tokens/s each (a
# ~36-token LoCoMo turn + 4 reply tokens per tick; measured N·r ≈ 100 tokens/s) and fill it ~90 s
# after the ramp began, leaving ~55 s of each session past the wall; with 0.2-0.25 GiB (9-11.5k
# tokens) the wall came at 123-150 s, too close to the sessions' end (~145 s) to tell a collapse
# from a slow patch. Pools are set in tokens, so a
# float32 host (no native bf16) gets the same pool at twice the bytes; the full workload's 9,216
# tokens are what its first run had (0.4 GiB in float32, 2026-12-06).
# AIMD phase: at P = 8 s the engine held 28 live sessions at p99 0.7 s (2026-12-02), and the cap
# (+1 per control period) could not climb past ~35 in the phase, so the step never crossed the
# target and no decrease was ever taken. The phase ticks at P = D = 2 s instead (4x the work per
# session; a probe of 20 sessions at P = 2 s took p50 2.2 s per tick), with the target at 0.75 P:
# 4 sessions sit well under it, a step to 32 is far past it, and the cap, evaluated every P, can
# climb from 4 to past the knee within the step. Whether it crosses, decreases and holds is measured.
# On 2026-12-04, with the machine otherwise quiet (load average < 1), two runs of the earlier quick
# workload (18 ticks; AIMD 4 -> 32 over 200 s) saw neither: unbounded p99 0.94-1.02 s, 0/20 collapsed
# (saturation at ~100 s left 5 ticks past the wall, too few for the recompute to outgrow the core),
# and 32 sessions at P = 2 s held p99 1.1 s, under the controller's 1.35 s, with the cap (34) above
# the offered load: no decrease. With a step to 64 sessions over 300 s (120 s of step: room for the
# cap, +1 per period, to climb past a knee above 32) the next run cut twice (a = 0.94); with 24 ticks
# unbounded p99 rose to 5.5 s but still under D. Hence 30 ticks per session (histories reach ~3.5x
# the pool, not ~2.1x: ~10 ticks past the wall).
QUICK = Workload(sessions=20, ticks=30, start_every_s=1.5, period_s=8.0, deadline_s=8.0, sink_tokens=16,
                 window_tokens=256, max_tokens=4, kv_cache_tokens=6912, max_model_len=4096, grace_s=4.0,
                 target_p99_ms=1500.0, aimd_s=300.0, aimd_ticks=8, aimd_period_s=2.0, aimd_low=4, aimd_high=64)
FULL = Workload(sessions=20, ticks=40, start_every_s=3.0, period_s=8.0, deadline_s=8.0, sink_tokens=16,
                window_tokens=256, max_tokens=4, kv_cache_tokens=9216, max_model_len=8192, grace_s=4.0,
                target_p99_ms=1500.0, aimd_s=300.0, aimd_ticks=10, aimd_period_s=2.0, aimd_low=4, aimd_high=40)


def _pool_gib(model_path: str, tokens: int) -> float:
    """The KV pool size (GiB) that holds `tokens` tokens of the model in the dtype the engine will
    run (engine_dtype "auto": bf16 where the CPU computes it natively, else float32), plus half a
    block of slack for rounding, so a workload gets the same pool in tokens on every host."""
    from baton.engine.args import engine_dtype
    from baton.engine.simulated.geometry import GIB, geometry_of
    from baton.engine.vllm_engine import native_cpu_bf16

    with open(os.path.join(model_path, "config.json")) as f:
        geo = geometry_of(json.load(f))
    dtype_bytes = 4 if engine_dtype("auto", on_gpu=False, cpu_bf16=native_cpu_bf16()) == "float32" else 2
    return (tokens + 64) * geo.bytes_per_token_in(dtype_bytes) / GIB


def _runner(model_path: str, wl: Workload) -> Any:
    from baton.bench.local_engine import local_engine

    # one engine thread: on 2 shared cores a 2-thread OMP pool spins against itself (~10x slower steps)
    return local_engine(model_path, max_model_len=wl.max_model_len, kv_cache_gib=_pool_gib(model_path, wl.kv_cache_tokens),
                        cpu_threads=1, max_num_seqs=64)


async def _warm(runner: Any) -> None:
    import uuid

    from baton.engine.types import GenerationRequest, SamplingSpec

    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(range(100, 164)),
                            sampling=SamplingSpec(max_tokens=4, temperature=0.0), cache_salt=uuid.uuid4().hex)
    async for _ in runner.generate(req):
        pass


def _dialog_chunks(tok: Any, n_sessions: int, ticks: int) -> list[list[tuple[int, ...]]]:
    """One list of tokenized LoCoMo turns per session ("speaker: text\\n"), one per tick."""
    files = sorted(LOCOMO.glob("conv-*.json"))
    if not files:
        raise SystemExit(f"LoCoMo data not found at {LOCOMO}")
    convs = []
    for f in files:
        d = json.loads(f.read_text())
        d = d.get("conversation", d)
        keys = sorted((k for k in d if k.startswith("session_") and isinstance(d[k], list)), key=lambda k: int(k.split("_")[1]))
        convs.append([f"{t['speaker']}: {t['text']}\n" for k in keys for t in d[k]])
    out = []
    for i in range(n_sessions):
        turns = convs[i % len(convs)]
        start = (i // len(convs)) * 11
        out.append([tuple(tok(turns[(start + k) % len(turns)], add_special_tokens=False)["input_ids"]) for k in range(ticks)])
    return out


@dataclass(frozen=True)
class TickRecord:
    session: str
    seq: int
    sent_at: float  # scheduled send, s since the phase began
    live: int  # live sessions at send
    latency_s: float | None  # None: no reply
    miss: bool
    prompt_tokens: int
    computed_tokens: int


class _Phase:
    """One mode on one engine: owns the session manager, ledgers, tick records and pool samples."""

    def __init__(self, runner: Any, mode: str, wl: Workload, preamble: tuple[int, ...], controller: Any = None):
        from baton.engine.realtime.manager import RealtimeSessions

        self.runner, self.mode, self.wl, self.preamble, self.controller = runner, mode, wl, preamble, controller
        self.sessions = RealtimeSessions(runner)
        self.t0 = time.monotonic()
        self.registry = SessionRegistry()  # admission slots, as the ingress keeps them
        self.endings: dict[str, str] = {}  # session -> how its client saw it end (session_ending)
        self.ledgers: list[SessionLedger] = []
        self.ticks: list[TickRecord] = []
        self.pool: list[dict[str, Any]] = []
        self.first_close: float | None = None  # when the first session ended (the ramp-down began)
        self.cpu0 = time.process_time()

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def live(self) -> int:
        return self.registry.live

    def shed(self, cap: int, retry_after_s: float) -> int:
        """Shed the newest sessions above `cap` (they stop at their next tick boundary); how many."""
        plan = choose_shed(self.registry.holding(), cap)
        return len(self.registry.shed(plan, ShedNotice(cap, plan.live, retry_after_s)))

    async def session(self, sid: str, start_at: float, chunks: Sequence[tuple[int, ...]], stop_at: float = math.inf) -> SessionLedger:
        """Open, send one chunk every P from start_at (not after stop_at), wait for the replies, close."""
        from baton.engine.realtime.messages import RealtimeOpen

        wl = self.wl
        if start_at > self.now():
            await asyncio.sleep(start_at - self.now())
        self.sessions.open(RealtimeOpen(sid, self.mode, self.preamble, wl.sink_tokens, wl.window_tokens, wl.max_tokens,  # type: ignore[arg-type]
                                        tick_s=wl.period_s))
        entry = self.registry.admit(sid, self.now())
        ledger = SessionLedger(sid)
        self.ledgers.append(ledger)
        tasks: list[asyncio.Task[None]] = []
        try:
            last = start_at
            for seq, ids in enumerate(chunks):
                at = start_at + seq * wl.period_s
                if at > stop_at:
                    break
                if at > self.now():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(entry.stop.wait(), at - self.now())
                if entry.notice is not None:  # shed: no tick after this boundary (those in flight are answered)
                    break
                tasks.append(asyncio.create_task(self._tick(sid, ledger, seq, at, ids)))
                last = at
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, last + wl.deadline_s + wl.grace_s - self.now()))
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            self.sessions.close(sid)
            # the ingress's close: its shed error frame and 1013 once shed (even after the last tick), else 1000
            shed = entry.notice
            self.endings[sid] = session_ending(shed.frame(), CLOSE_TRY_LATER) if shed is not None else session_ending(None, 1000)
            self.registry.release(sid)  # frees the slot unless the shed did
            if self.first_close is None:
                self.first_close = self.now()
        ledger.check_integrity()
        return ledger

    async def _tick(self, sid: str, ledger: SessionLedger, seq: int, at: float, ids: tuple[int, ...]) -> None:
        from baton.engine.realtime.messages import RealtimeTick

        live, res, replied = self.live, None, None
        try:
            res = await self.sessions.tick(RealtimeTick(sid, seq, ids))
            replied = self.now()
        except asyncio.CancelledError:
            pass  # never answered: recorded as missing
        ok = res is not None and res.error is None
        out = TickOutcome(seq=seq, sent_at=at, deadline_at=at + self.wl.deadline_s, replied_at=replied,
                          text_len=len(res.text) if ok and res is not None else 0,
                          server_s=res.server_s if ok and res is not None else None,
                          server_error=res is not None and res.error is not None)
        ledger.record(out)
        self.ticks.append(TickRecord(sid, seq, at, live, out.latency_s, is_miss(out),
                                     res.prompt_tokens if res else 0, res.computed_tokens if res else 0))
        if self.controller is not None:
            if out.latency_s is None:
                self.controller.observe_miss(self.now())
            else:
                self.controller.observe(out.latency_s, self.now())

    async def sample_pool(self, stop: asyncio.Event) -> None:
        bp = self.runner._scheduler.kv_cache_manager.block_pool
        usable = bp.num_gpu_blocks - 1  # block 0 is vLLM's null block
        while not stop.is_set():
            in_use = held = 0
            for b in bp.blocks:
                if b.is_null:
                    continue
                if b.ref_cnt > 0:
                    in_use += 1
                    held += 1
                elif b.block_hash is not None:
                    held += 1
            rho = (held if self.mode == "unbounded" else in_use) / usable
            g = self.sessions.token_growth(time.monotonic())
            capacity = self.runner.stats.kv_capacity_tokens
            fc = forecast_cliff(DecoderTokens(capacity, g.retained_tokens, g.offered_tokens_per_s, g.served_tokens_per_s), self.now())
            # side by side, the same forecast from completed ticks only (the predictor before ticks in flight
            # were counted) and from whole histories (before whole-block counting)
            gc = self.sessions.token_growth(time.monotonic(), in_flight=False)
            fcc = forecast_cliff(DecoderTokens(capacity, gc.retained_tokens, gc.offered_tokens_per_s, gc.served_tokens_per_s), self.now())
            gh = self.sessions.token_growth(time.monotonic(), block_tokens=0, in_flight=False)
            fh = forecast_cliff(DecoderTokens(capacity, gh.retained_tokens, gh.offered_tokens_per_s, gh.served_tokens_per_s), self.now())
            self.pool.append({"t": self.now(), "live": self.live, "rho": min(1.0, rho), "in_use_blocks": in_use,
                              "retained_tokens": g.retained_tokens, "capacity_tokens": capacity,
                              "offered_tokens_per_s": g.offered_tokens_per_s, "served_tokens_per_s": g.served_tokens_per_s,
                              "growth_tokens_per_s": fc.growth_tokens_per_s, "growth_capped": fc.capped,
                              "growing_sessions": g.growing_sessions, "eta_s": fc.eta_s, "eta_sat_s": fc.seconds_to(SAT_RHO),
                              "retained_completed_tokens": gc.retained_tokens, "eta_sat_completed_s": fcc.seconds_to(SAT_RHO),
                              "retained_history_tokens": gh.retained_tokens, "eta_sat_history_s": fh.seconds_to(SAT_RHO),
                              "block_tokens": self.runner.stats.kv_block_tokens,
                              "cached_blocks": len(bp.cached_block_hash_to_block), "held_blocks": held,
                              "usable_blocks": usable, "kv_usage": self.runner.stats.kv_usage,
                              "loadavg_1m": os.getloadavg()[0]})
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_S)
            except TimeoutError:
                pass


# ---- analysis (pure) -----------------------------------------------------------------------------


def _p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]


def _p50(values: Sequence[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else x


def latency_by_live(ticks: Sequence[TickRecord]) -> list[dict[str, Any]]:
    """p99 of replied ticks and miss share, per bucket of live sessions at send."""
    out = []
    top = max((t.live for t in ticks), default=0)
    for lo in range(1, top + 1, BUCKET):
        hi = lo + BUCKET - 1
        ts = [t for t in ticks if lo <= t.live <= hi]
        if not ts:
            continue
        lat = [t.latency_s for t in ts if t.latency_s is not None]
        out.append({"live_lo": lo, "live_hi": hi, "live_max": max(t.live for t in ts), "ticks": len(ts), "p50_s": _p50(lat),
                    "p99_s": _p99(lat), "p99_with_missing_s": _finite(_p99([t.latency_s if t.latency_s is not None else math.inf for t in ts])),
                    "miss_share": sum(t.miss for t in ts) / len(ts), "missing": sum(t.latency_s is None for t in ts)})
    return out


def session_ending(last_frame: dict[str, Any] | None, close_code: int) -> str:
    """How a client reads its session's end from the last frame and the close code: "ended" (1000),
    "shed" (1013 after an error frame `shed_overload`), "refused" (another 1013: at the cap, the
    cliff) or "failed" (any other close)."""
    code = last_frame.get("code") if last_frame is not None and last_frame.get("type") == "error" else None
    if close_code == 1000:
        return "ended"
    if close_code == CLOSE_TRY_LATER:
        return "shed" if code == SHED_CODE else "refused"
    return "failed"


def run_result(modes: dict[str, Any], aimd: dict[str, Any]) -> dict[str, Any]:
    """The figures of the RESULT line, in its order (aimd_shed last: added after the others)."""
    return {"bounded_collapsed": modes["bounded"]["collapsed"], "unbounded_collapsed": modes["unbounded"]["collapsed"],
            "cliff_prediction_error": modes["unbounded"]["cliff"]["error"], "aimd_p99_over_target": aimd.get("p99_over_target"),
            "aimd_decreases": aimd.get("decreases"), "aimd_shed": aimd.get("shed_sessions")}


def result_line(result: dict[str, Any]) -> str:
    """The RESULT line: key=value in the dict's order (None: nan; floats to 3 places)."""
    fmt = lambda v: "nan" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
    return "RESULT " + " ".join(f"{k}={fmt(v)}" for k, v in result.items())


def sustainable(curve: Sequence[dict[str, Any]], target_s: float) -> int:
    """The most live sessions seen in the highest bucket whose p99 (and every smaller bucket's) is
    within target, misses as +inf."""
    n = 0
    for b in curve:
        p = b["p99_with_missing_s"]
        if p is None or p > target_s:
            break
        n = b["live_max"]
    return n


def cliff(pool: Sequence[dict[str, Any]], outcomes: Sequence[TickOutcome], first_collapse: float | None) -> dict[str, Any]:
    """Score the token predictor's forecasts (seconds to SAT_RHO of the pool) against the measured
    saturation (first sample with ρ >= SAT_RHO) and the engine's collapse onset."""
    measured = next((s["t"] for s in pool if s["rho"] >= SAT_RHO), None)
    start = next((s["t"] for s in pool if s["live"] > 0), None)
    onset = collapse_onset(outcomes)
    samples = [ForecastSample(s["t"], s["eta_sat_s"]) for s in pool if s["live"] > 0]
    score = score_cliff(samples, start=start, saturation=measured, onset=onset)
    completed, history = (score_cliff([ForecastSample(s["t"], s.get(key)) for s in pool if s["live"] > 0],
                                      start=start, saturation=measured, onset=onset)
                          for key in ("eta_sat_completed_s", "eta_sat_history_s"))
    capped = [s for s in pool if s["live"] > 0 and measured is not None and s["t"] < measured]
    return {"predictor": "tokens: (SAT_RHO x capacity - retained) / min(offered, served)", "saturation_rho": SAT_RHO,
            "fit_fractions": list(FIT_FRACTIONS), "measured_saturation_s": measured, "onset_s": onset,
            "onset_rule": f"deadline of the first of {DEFAULT_CONSECUTIVE} consecutive late or missing ticks, all sessions in send order",
            "first_session_collapse_s": first_collapse, "start_s": start, "forecasts": score.samples,
            "capped_share": sum(s["growth_capped"] for s in capped) / len(capped) if capped else None,
            "points": [{**asdict(p), "at_fit": _at_fit(pool, p.t_fit)} for p in score.points],
            "error": score.horizon_error, "error_vs_onset": score.onset_error,
            # the ablations: ticks in flight not counted (whole blocks of completed ticks only), and retained
            # tokens as whole histories (partial tail blocks counted as held, ticks in flight not)
            **{name: {"points": [asdict(p) for p in sc.points], "error": sc.horizon_error, "error_vs_onset": sc.onset_error}
               for name, sc in (("completed_ticks", completed), ("whole_history", history))}}


def _at_fit(pool: Sequence[dict[str, Any]], t_fit: float | None) -> dict[str, Any] | None:
    """What the predictor saw at a fit point (the pool sample of that time), to explain its error."""
    s = next((s for s in pool if s["t"] == t_fit), None)
    keys = ("live", "growing_sessions", "retained_tokens", "offered_tokens_per_s", "served_tokens_per_s", "growth_tokens_per_s",
            "growth_capped", "rho")
    return {k: s[k] for k in keys} if s is not None else None


def mode_report(phase: _Phase) -> dict[str, Any]:
    s = summarize(phase.ledgers)
    truths = [led.truth() for led in phase.ledgers]
    naive = [led.naive_view() for led in phase.ledgers]
    lat = [t.latency_s for t in phase.ticks if t.latency_s is not None]
    ramp = [t for t in phase.ticks if phase.first_close is None or t.sent_at < phase.first_close]
    wall = phase.now()
    loads = [p["loadavg_1m"] for p in phase.pool]
    return {
        "sessions": s.sessions, "collapsed": s.collapsed, "collapse_consecutive": DEFAULT_CONSECUTIVE, "ticks": s.ticks,
        "truth": {"misses": s.true_misses, "late": sum(t.late for t in truths), "empty": sum(t.empty for t in truths),
                  "missing": sum(t.missing for t in truths), "on_time": sum(t.on_time for t in truths)},
        "naive": {"ticks_served": sum(n.ticks_served for n in naive), "errors": s.naive_errors,
                  "deadline_misses": s.naive_deadline_misses},
        "first_collapse_s": s.earliest_collapse_onset,
        "collapse_onsets_s": sorted(t.collapse_onset for t in truths if t.collapse_onset is not None),
        "p50_s": _p50(lat), "p99_s": _p99(lat),
        "mean_prompt_tokens": sum(t.prompt_tokens for t in phase.ticks) / max(1, len(phase.ticks)),
        "mean_computed_tokens": sum(t.computed_tokens for t in phase.ticks) / max(1, len(phase.ticks)),
        "latency_by_live": latency_by_live(ramp), "latency_by_live_ticks_before_s": phase.first_close,
        "cpu": {"process_cpu_s": time.process_time() - phase.cpu0, "wall_s": wall,
                "cores_used": (time.process_time() - phase.cpu0) / max(1e-9, wall),
                "loadavg_1m_mean": sum(loads) / max(1, len(loads)), "loadavg_1m_max": max(loads, default=0.0)},
        "occupancy": phase.pool,
        "ticks_log": [[t.session, t.seq, round(t.sent_at, 3), t.live, None if t.latency_s is None else round(t.latency_s, 3), t.miss]
                      for t in phase.ticks],  # session, seq, sent_at_s, live, latency_s, miss
        "peak_rho": max((p["rho"] for p in phase.pool), default=0.0),
    }


# ---- phases --------------------------------------------------------------------------------------


async def _ramp(runner: Any, mode: str, wl: Workload, preamble: tuple[int, ...], chunks: list[list[tuple[int, ...]]]) -> dict[str, Any]:
    phase = _Phase(runner, mode, wl, preamble)
    stop = asyncio.Event()
    sampler = asyncio.create_task(phase.sample_pool(stop))
    await asyncio.gather(*(phase.session(f"{mode}-{i}", 1.0 + i * wl.start_every_s, chunks[i]) for i in range(wl.sessions)))
    stop.set()
    await sampler
    rep = mode_report(phase)
    rep["wall_s"] = phase.now()
    rep["cliff"] = cliff(phase.pool, [o for led in phase.ledgers for o in led.outcomes()], rep["first_collapse_s"])
    return rep


async def _aimd(runner: Any, wl: Workload, preamble: tuple[int, ...], chunks: list[list[tuple[int, ...]]], n_sust: int) -> dict[str, Any]:
    """The step schedule aimd_low -> aimd_high -> aimd_low at the AIMD period; n_sust (the ramp's,
    at the ramp's period) is reported only."""
    from router.admission import AdmissionConfig, AIMDController

    wl = replace(wl, period_s=wl.aimd_period_s, deadline_s=wl.aimd_period_s)
    # window and min_samples sized so that even a cap of 1 (one tick per P) can be evaluated; a cut sheds the newest live sessions
    cfg = AdmissionConfig(target_p99_ms=wl.target_p99_ms * wl.aimd_setpoint, initial_cap=wl.aimd_low, max_cap=2 * wl.aimd_high,
                          control_period_s=wl.period_s, window_s=6 * wl.period_s, min_samples=5, retry_after_s=wl.period_s,
                          overload="shed", cooldown_periods=2)  # a shed bites at the next tick (<= P), queued ticks drain ~target after
    ctl = AIMDController(cfg, now=0.0)
    phase = _Phase(runner, "bounded", wl, preamble, controller=ctl)
    schedule = step_schedule(wl.aimd_low, wl.aimd_high, wl.aimd_s)
    per_tick = sum(len(c) for src in chunks for c in src) / max(1, sum(len(src) for src in chunks)) + wl.max_tokens
    fill = ticks_to_fill(wl.window_tokens, wl.sink_tokens, len(preamble), per_tick)
    n_ticks = max(wl.aimd_ticks, fill + 2)
    refusals = 0
    caps: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def client(c: int) -> None:
        nonlocal refusals
        k, was_on = 0, False
        while phase.now() < wl.aimd_s:
            if c >= schedule.offered(phase.now()):  # this client is not part of the load now
                was_on = False
                await asyncio.sleep(SAMPLE_S)
                continue
            if not was_on:  # arrivals of one step spread over a tick period
                was_on = True
                await asyncio.sleep((c % 8) * wl.period_s / 8)
            adm = ctl.can_admit(phase.live)
            if not adm.admitted:
                refusals += 1
                await asyncio.sleep(adm.retry_after_s or wl.period_s)
                continue
            src = chunks[(c + k * schedule.peak()) % len(chunks)]
            off = (k * n_ticks) % max(1, len(src) - n_ticks)
            sid = f"aimd-{c}-{k}"
            await phase.session(sid, phase.now(), src[off: off + n_ticks], stop_at=wl.aimd_s)
            k += 1
            if phase.endings[sid] == "shed":  # told to try again later, like a refusal
                await asyncio.sleep(cfg.retry_after_s)

    async def control() -> None:
        while not done.is_set():
            live = phase.live
            d = ctl.update(phase.now(), live)
            shed = phase.shed(d.cap_after, cfg.retry_after_s) if d.shed else 0
            caps.append({"t": phase.now(), "cap": ctl.cap, "live": live, "action": d.action, "reason": d.reason,
                         "window_p99_s": _finite(d.p99_s), "shed": shed, "loadavg_1m": os.getloadavg()[0]})
            try:
                await asyncio.wait_for(done.wait(), SAMPLE_S)
            except TimeoutError:
                pass

    controller = asyncio.create_task(control())
    await asyncio.gather(*(client(c) for c in range(schedule.peak())))
    done.set()
    await controller
    steady_from = wl.aimd_s / 2
    steady = [t for t in phase.ticks if t.sent_at >= steady_from]
    p99 = _p99([t.latency_s if t.latency_s is not None else math.inf for t in steady])
    steady_caps = [c["cap"] for c in caps if c["t"] >= steady_from]
    shed_ids = {sid for sid, how in phase.endings.items() if how == "shed"}
    s = summarize(led for led in phase.ledgers if led.session_id not in shed_ids)  # a shed session is shed, not collapsed
    cpu_s = time.process_time() - phase.cpu0
    loads = [c["loadavg_1m"] for c in caps]
    return {"config": cfg.model_dump(), "cpu": {"cores_used": cpu_s / max(1e-9, phase.now()),
                                                "loadavg_1m_mean": sum(loads) / max(1, len(loads))},
                "sustainable_sessions": n_sust, "offered_sessions": schedule.peak(), "period_s": wl.period_s,
            "schedule": [asdict(st) for st in schedule.steps], "session_ticks": n_ticks, "ticks_to_fill_window": fill,
            "decreases": sum(c["action"] == "decrease" for c in caps), "increases": sum(c["action"] == "increase" for c in caps),
            "refusals": refusals, "admitted_sessions": len(phase.ledgers), "steady_from_s": steady_from,
            "steady_ticks": len(steady), "steady_p99_s": _finite(p99),
            "steady_p99_replied_s": _p99([t.latency_s for t in steady if t.latency_s is not None]),
            "steady_miss_share": sum(t.miss for t in steady) / max(1, len(steady)),
            "steady_cap_mean": sum(steady_caps) / max(1, len(steady_caps)),
            "steady_cap_range": [min(steady_caps, default=0), max(steady_caps, default=0)],
            "steady_live_mean": sum(c["live"] for c in caps if c["t"] >= steady_from) / max(1, len(steady_caps)),
            "slo_p99_s": wl.target_p99_ms / 1000, "setpoint": wl.aimd_setpoint,
            "p99_over_target": (p99 / (wl.target_p99_ms / 1000)) if p99 is not None else None,  # over the SLO
            "p99_over_setpoint": (p99 / cfg.target_p99_s) if p99 is not None else None,
            "shed_sessions": len(shed_ids), "shed_decisions": sum(c["shed"] > 0 for c in caps),
            "collapsed": s.collapsed, "sessions": s.sessions, "caps": caps,
            "latency_by_live": latency_by_live(phase.ticks), "wall_s": phase.now()}


async def _main(quick: bool, out_dir: Path) -> dict[str, Any]:
    from baton.engine.args import resolve_model_path

    wl = QUICK if quick else FULL
    model_path = resolve_model_path("SmolLM2-135M-Instruct", str(ROOT / ".cache" / "models"))
    t_start = time.perf_counter()
    modes: dict[str, Any] = {}
    aimd: dict[str, Any] = {}
    tok = None
    for mode in ("unbounded", "bounded"):  # a fresh engine (empty KV pool and prefix cache) per mode
        t0 = time.perf_counter()
        runner = _runner(model_path, wl)
        try:
            if tok is None:  # after the first engine: transformers pulls in torch, which must see OMP_NUM_THREADS
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(model_path)
                preamble = tuple(tok(PREAMBLE, add_special_tokens=False)["input_ids"])
                chunks = _dialog_chunks(tok, max(wl.sessions, 40), wl.ticks)
            await _warm(runner)
            print(f"[realtime] {mode}: engine up in {time.perf_counter() - t0:.1f}s, KV pool "
                  f"{runner.stats.kv_capacity_tokens} tokens (asked {wl.kv_cache_tokens})", flush=True)
            modes[mode] = await _ramp(runner, mode, wl, preamble, chunks)
            modes[mode]["kv_capacity_tokens"] = runner.stats.kv_capacity_tokens
            _print_mode(mode, modes[mode])
            if mode == "bounded":
                n_sust = sustainable(modes[mode]["latency_by_live"], wl.target_p99_ms / 1000) or 1
                print(f"[realtime] AIMD: the bounded ramp (P = {wl.period_s:.0f}s) held N = {n_sust} within {wl.target_p99_ms:.0f} ms; "
                      f"AIMD phase at P = {wl.aimd_period_s:.0f}s offers {wl.aimd_low} -> {wl.aimd_high} -> {wl.aimd_low} sessions "
                      f"over {wl.aimd_s:.0f}s", flush=True)
                aimd = await _aimd(runner, wl, preamble, chunks, n_sust)
        finally:
            runner.shutdown()

    result = run_result(modes, aimd)
    report = {"quick": quick, "workload": asdict(wl), "modes": modes, "aimd": aimd, "result": result,
              "wall_s": time.perf_counter() - t_start}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "realtime.json").write_text(json.dumps(report, indent=2))
    _plot(modes, aimd, wl, out_dir)
    _print_summary(modes, aimd, wl)
    print(f"[realtime] wrote {out_dir / 'realtime.json'} and 3 PNGs in {report['wall_s']:.0f}s")
    print(result_line(result))
    return report


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    return asyncio.run(_main(quick, out_dir))


# ---- output --------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _print_mode(mode: str, r: dict[str, Any]) -> None:
    c = r["cliff"]
    print(f"[realtime] {mode}: {r['collapsed']}/{r['sessions']} collapsed; {r['ticks']} ticks, true misses "
          f"{r['truth']['misses']} (late {r['truth']['late']}, empty {r['truth']['empty']}, missing {r['truth']['missing']}); "
          f"naive: {r['naive']['ticks_served']} served, {r['naive']['errors']} errors, {r['naive']['deadline_misses']} "
          f"deadline misses; p99 {_ms(r['p99_s'])} ms; peak ρ {r['peak_rho']:.2f}; saturation "
          f"{_num(c['measured_saturation_s'], 1)} s, collapse onset {_num(c['onset_s'], 1)} s, first session collapse "
          f"{_num(r['first_collapse_s'], 1)} s; this process used "
          f"{r['cpu']['cores_used']:.2f} cores at load average {r['cpu']['loadavg_1m_mean']:.1f} (max {r['cpu']['loadavg_1m_max']:.1f})",
          flush=True)


def _print_summary(modes: dict[str, Any], aimd: dict[str, Any], wl: Workload) -> None:
    print(f"\n[realtime] P = D = {wl.period_s}s, S = {wl.sink_tokens}, W = {wl.window_tokens}, max_tokens = {wl.max_tokens}, "
          f"{wl.sessions} sessions x {wl.ticks} ticks, one opening every {wl.start_every_s}s")
    print(f"{'mode':<10} {'collapsed':>9} {'ticks':>6} {'true miss':>9} {'naive err':>9} {'naive miss':>10} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'peak ρ':>6} {'sat s':>6} {'1st coll s':>10}")
    for m, r in modes.items():
        sat, fc = r["cliff"]["measured_saturation_s"], r["first_collapse_s"]
        print(f"{m:<10} {r['collapsed']:>6}/{r['sessions']:<2} {r['ticks']:>6} {r['truth']['misses']:>9} {r['naive']['errors']:>9} "
              f"{r['naive']['deadline_misses']:>10} {_ms(r['p50_s']):>7} {_ms(r['p99_s']):>7} {r['peak_rho']:>6.2f} "
              f"{'-' if sat is None else f'{sat:.0f}':>6} {'-' if fc is None else f'{fc:.0f}':>10}")
    print("\nticks sent before the first session ended, by live sessions at send")
    print(f"{'live N':<8}" + "".join(f"{m + ' p99 ms / miss%':>30}" for m in modes))
    rows: dict[str, dict[str, str]] = {}
    for m, r in modes.items():
        for b in r["latency_by_live"]:
            rows.setdefault(f"{b['live_lo']}-{b['live_hi']}", {})[m] = f"{_ms(b['p99_s'])} / {100 * b['miss_share']:.0f}% ({b['ticks']})"
    for k, v in rows.items():
        print(f"{k:<8}" + "".join(f"{v.get(m, '-'):>30}" for m in modes))
    c = modes["unbounded"]["cliff"]
    print(f"\n[realtime] cliff (unbounded, token predictor): measured ρ≥{SAT_RHO} at {_num(c['measured_saturation_s'], 1)}s, "
          f"collapse onset {_num(c['onset_s'], 1)}s, {c['forecasts']} forecasts, growth capped at the served rate in "
          f"{_num(c['capped_share'], 2)} of them")
    for p in c["points"]:
        print(f"  fit {100 * p['fraction']:.0f}%: at {_num(p['t_fit'], 1)}s predicted {_num(p['predicted_s'], 1)}s -> "
              f"e={_num(p['horizon_error'])}, e_vs_onset={_num(p['onset_error'])}")
    print(f"  median: e={_num(c['error'])}, e_vs_onset={_num(c['error_vs_onset'])}")
    for key, what in (("completed_ticks", "not counting ticks in flight"), ("whole_history", "counting whole histories instead")):
        h = c[key]
        print(f"  {what}: e={_num(h['error'])} ({' / '.join(_num(p['horizon_error']) for p in h['points'])}), "
              f"e_vs_onset={_num(h['error_vs_onset'])}")
    if aimd:
        print(f"[realtime] AIMD: P = {aimd['period_s']:.0f}s, target {wl.target_p99_ms:.0f} ms (controller at "
              f"{wl.aimd_setpoint:.2f} of it), offered {wl.aimd_low} -> "
              f"{aimd['offered_sessions']} -> {wl.aimd_low} in sessions of {aimd['session_ticks']} ticks; {aimd['increases']} increases, "
              f"{aimd['decreases']} decreases; "
              f"{aimd['admitted_sessions']} sessions admitted, {aimd['refusals']} refusals; steady cap {aimd['steady_cap_mean']:.1f} "
              f"(range {aimd['steady_cap_range']}), live {aimd['steady_live_mean']:.1f}; steady p99 {_ms(aimd['steady_p99_s'])} ms "
              f"over {aimd['steady_ticks']} ticks (misses {100 * aimd['steady_miss_share']:.1f}%), a = {_num(aimd['p99_over_target'])}; "
              f"{aimd['shed_sessions']} sessions shed in {aimd['shed_decisions']} cuts; "
              f"{aimd['collapsed']}/{aimd['sessions']} other sessions collapsed; {aimd['cpu']['cores_used']:.2f} cores used at load "
              f"average {aimd['cpu']['loadavg_1m_mean']:.1f}")


def _plot(modes: dict[str, Any], aimd: dict[str, Any], wl: Workload, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in modes.items():
        bs = r["latency_by_live"]
        ax.plot([(b["live_lo"] + b["live_hi"]) / 2 for b in bs], [(b["p99_s"] or math.nan) * 1000 for b in bs], "o-", label=f"{m} p99")
    ax.axhline(wl.deadline_s * 1000, color="r", ls="--", label="deadline")
    ax.axhline(wl.target_p99_ms, color="g", ls=":", label="AIMD target (SLO)")
    ax.axhline(wl.target_p99_ms * wl.aimd_setpoint, color="g", ls="-.", lw=0.8, label="controller's target")
    ax.set_yscale("log")
    ax.set_xlabel(f"live sessions at send (buckets of {BUCKET})")
    ax.set_ylabel("tick latency p99 (ms, replied ticks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "realtime_latency.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(modes), figsize=(11, 4), sharey=True)
    for ax, (m, r) in zip(axes, modes.items(), strict=True):
        occ = r["occupancy"]
        ax.plot([p["t"] for p in occ], [p["rho"] for p in occ], label="ρ (blocks)")
        ax.plot([p["t"] for p in occ], [p["retained_tokens"] / max(1, p["capacity_tokens"]) for p in occ], label="retained tokens / C")
        ax.plot([p["t"] for p in occ], [p["live"] / wl.sessions for p in occ], alpha=0.5, label=f"live / {wl.sessions}")
        c = r["cliff"]
        for pt in c["points"] if m == "unbounded" else ():
            if pt["predicted_s"] is not None:
                ax.axvline(pt["predicted_s"], color="k", ls=":", lw=0.8, label=f"predicted at {100 * pt['fraction']:.0f}%")
        if c["measured_saturation_s"] is not None:
            ax.axvline(c["measured_saturation_s"], color="r", ls=":", label=f"measured {c['measured_saturation_s']:.0f}s")
        if c["onset_s"] is not None:
            ax.axvline(c["onset_s"], color="m", ls="-.", label=f"collapse onset {c['onset_s']:.0f}s")
        ax.set_title(f"{m}: {r['collapsed']}/{r['sessions']} collapsed")
        ax.set_xlabel("s since ramp start")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("KV pool occupancy ρ")
    fig.tight_layout()
    fig.savefig(out_dir / "realtime_occupancy.png", dpi=120)
    plt.close(fig)

    if aimd:
        fig, ax = plt.subplots(figsize=(7, 4))
        caps = aimd["caps"]
        ax.step([c["t"] for c in caps], [c["cap"] for c in caps], where="post", label="cap")
        ax.plot([c["t"] for c in caps], [c["live"] for c in caps], alpha=0.6, label="live sessions")
        ax.axhline(aimd["sustainable_sessions"], color="g", ls=":", label="N_sust (ramp)")
        ax.axvline(aimd["steady_from_s"], color="k", ls=":", label="steady part")
        ax2 = ax.twinx()
        ax2.plot([c["t"] for c in caps], [(c["window_p99_s"] or math.nan) * 1000 for c in caps], "r.", ms=3, label="window p99")
        ax2.axhline(wl.target_p99_ms, color="r", ls="--", lw=0.8)
        ax2.set_ylabel("window p99 (ms)")
        ax.set_xlabel("s")
        ax.set_ylabel("sessions")
        ax.step([st["start_s"] for st in aimd["schedule"]] + [wl.aimd_s], [st["sessions"] for st in aimd["schedule"]]
                + [aimd["schedule"][-1]["sessions"]], where="post", color="grey", ls="--", label="offered")
        ax.set_title(f"AIMD, {aimd['increases']} increases / {aimd['decreases']} decreases, {aimd['shed_sessions']} shed: "
                     f"a = {_num(aimd['p99_over_target'])}")
        ax.legend(loc="upper left", fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "realtime_aimd.png", dpi=120)
        plt.close(fig)
