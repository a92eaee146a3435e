"""Ingress metrics. `ServeIngressMetrics` exports through Ray Serve's metrics API (Prometheus on
the Ray metrics port); `RecordingMetrics` keeps observations in memory for tests and reports.
Engine replicas publish their segment connector's totals through `ServeSegmentMetrics`.
Labels never carry prompt text or user ids: only endpoint, status, pool, turn and outcome."""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kv_transfer.segment_stats import SegmentStats

_LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_TPOT_BOUNDARIES_S = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


def turn_label(turn_index: int | None) -> str:
    """A bounded label set: 0..4, "5+", "none" (no conversation id)."""
    if turn_index is None:
        return "none"
    return str(turn_index) if turn_index < 5 else "5+"


class IngressMetrics(Protocol):
    def request_done(self, endpoint: str, status: int) -> None: ...
    def ttft(self, endpoint: str, seconds: float, turn_index: int | None = None) -> None: ...
    def tpot(self, endpoint: str, seconds: float) -> None: ...
    def tokens(self, endpoint: str, prompt: int, cached: int, generated: int) -> None: ...


class ResumeMetrics(Protocol):
    """Streams whose decoder died mid-stream (deployments/resume.py), by outcome: resumed |
    finished | refused | failed (deployments.resume.ResumeOutcome)."""

    def stream_resume(self, outcome: str) -> None: ...


class AdmissionMetrics(Protocol):
    """Chat admission at one ingress (deployments/inflight.py): each request admitted or refused
    (outcome: admitted | refused), and the in-flight limit whenever it changes."""

    def admission(self, outcome: str) -> None: ...
    def admission_limit(self, limit: int) -> None: ...


class RecordingMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.admissions: dict[str, int] = defaultdict(int)
        self.admission_limits: list[int] = []
        self.ttfts: list[float] = []
        self.ttft_turns: list[int | None] = []
        self.tpots: list[float] = []
        self.token_totals: dict[str, int] = defaultdict(int)
        self.resume_totals: dict[str, int] = defaultdict(int)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def ttft(self, endpoint: str, seconds: float, turn_index: int | None = None) -> None:
        self.ttfts.append(seconds)
        self.ttft_turns.append(turn_index)

    def tpot(self, endpoint: str, seconds: float) -> None:
        self.tpots.append(seconds)

    def tokens(self, endpoint: str, prompt: int, cached: int, generated: int) -> None:
        self.token_totals["prompt"] += prompt
        self.token_totals["cached"] += cached
        self.token_totals["generated"] += generated

    def stream_resume(self, outcome: str) -> None:
        self.resume_totals[outcome] += 1

    def admission(self, outcome: str) -> None:
        self.admissions[outcome] += 1

    def admission_limit(self, limit: int) -> None:
        self.admission_limits.append(limit)


class ServeIngressMetrics:
    def __init__(self) -> None:
        from ray.serve import metrics

        self._requests = metrics.Counter("baton_requests", "requests answered, by endpoint and HTTP status", tag_keys=("endpoint", "status"))
        self._ttft = metrics.Histogram(
            "baton_ttft_seconds", "time to first token, by the turn's index in its conversation (0..4, 5+, none)",
            boundaries=_LATENCY_BOUNDARIES_S, tag_keys=("endpoint", "turn"),
        )
        self._tpot = metrics.Histogram("baton_time_per_output_token_seconds", "mean time per output token after the first",
                                       boundaries=_TPOT_BOUNDARIES_S, tag_keys=("endpoint",))
        self._prompt = metrics.Counter("baton_prompt_tokens", "prompt tokens", tag_keys=("endpoint",))
        self._cached = metrics.Counter("baton_cached_prompt_tokens", "prompt tokens served from the prefix cache", tag_keys=("endpoint",))
        self._generated = metrics.Counter("baton_generated_tokens", "generated tokens", tag_keys=("endpoint",))
        self._resumes = metrics.Counter(
            "baton_stream_resumes", "streams whose decoder died mid-stream, by outcome (resumed, finished, refused, failed)",
            tag_keys=("outcome",),
        )
        self._admissions = metrics.Counter("baton_admission_requests", "generation requests admitted or refused (429) by this ingress, by outcome",
                                           tag_keys=("outcome",))
        self._admission_limit = metrics.Gauge("baton_admission_limit", "this ingress's current in-flight limit (fixed: the hard cap)")
        self.resume_totals: dict[str, int] = defaultdict(int)  # this ingress replica's, for /baton/stats

    def request_done(self, endpoint: str, status: int) -> None:
        self._requests.inc(1, tags={"endpoint": endpoint, "status": str(status)})

    def ttft(self, endpoint: str, seconds: float, turn_index: int | None = None) -> None:
        self._ttft.observe(seconds, tags={"endpoint": endpoint, "turn": turn_label(turn_index)})

    def tpot(self, endpoint: str, seconds: float) -> None:
        self._tpot.observe(seconds, tags={"endpoint": endpoint})

    def tokens(self, endpoint: str, prompt: int, cached: int, generated: int) -> None:
        tags = {"endpoint": endpoint}
        if prompt:
            self._prompt.inc(prompt, tags=tags)
        if cached:
            self._cached.inc(cached, tags=tags)
        if generated:
            self._generated.inc(generated, tags=tags)

    def stream_resume(self, outcome: str) -> None:
        self._resumes.inc(1, tags={"outcome": outcome})
        self.resume_totals[outcome] += 1

    def admission(self, outcome: str) -> None:
        self._admissions.inc(1, tags={"outcome": outcome})

    def admission_limit(self, limit: int) -> None:
        self._admission_limit.set(float(limit))


# ---- engine replica: segment connector (kv_transfer/segment_stats.py) ------------------------------

SEGMENT_COUNTERS = {
    "injections": "segment loads laid into the paged KV cache",
    "injected_tokens": "prompt tokens supplied by segment loads",
    "load_seconds": "seconds spent laying segments into the paged KV cache",
    "prepared_loads": "segment loads whose KV was rotated and cast before the engine thread (the rest: on it)",
    "background_loads": "segment loads written on the connector's loader thread while the engine stepped others",
    "load_failures": "segment loads that failed (their blocks were recomputed)",
    "unavailable": "injections asked for whose segments were missing or did not match (recomputed)",
    "captures": "segment captures handed back to their submitter",
    "capture_failures": "segment captures that failed (the submitter recomputes)",
}


def segment_increments(published: SegmentStats, now: SegmentStats) -> dict[str, float]:
    """Pure: how much each `baton_segment_<counter>` grew since the totals last published
    (counters that did not grow are left out: Prometheus counters only take positive steps)."""
    step = now - published  # raises if the totals went down
    return {name: float(getattr(step, name)) for name in SEGMENT_COUNTERS if getattr(step, name) > 0}


class ServeSegmentMetrics:
    """This replica's segment-connector totals as Prometheus counters (`baton_segment_<counter>`;
    Serve tags each with its deployment and replica, no other labels)."""

    def __init__(self) -> None:
        from ray.serve import metrics

        from kv_transfer.segment_stats import SegmentStats

        self._counters = {name: metrics.Counter(f"baton_segment_{name}", help_) for name, help_ in SEGMENT_COUNTERS.items()}
        self._published = SegmentStats()

    def publish(self, now: SegmentStats) -> None:
        for name, step in segment_increments(self._published, now).items():
            self._counters[name].inc(step)
        self._published = now


MEMORY_PULL_COUNTERS = {
    "pulled_segments": "memory segments this replica read from the memory store's arena over NIXL",
    "pulled_bytes": "bytes of memory KV read from the memory store's arena over NIXL",
    "pull_failures": "reads from the memory store's arena that failed or outlived their lease (encoded instead)",
}


class ServeMemoryPullMetrics:
    """This replica's memory-segment pulls (memory_store/resolver.py) as Prometheus counters
    (`baton_memory_<counter>`), published as increments of the resolver's running totals."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self._counters = {name: metrics.Counter(f"baton_memory_{name}", help_) for name, help_ in MEMORY_PULL_COUNTERS.items()}
        self._published = dict.fromkeys(MEMORY_PULL_COUNTERS, 0)

    def publish(self, totals: dict[str, int]) -> None:
        for name in MEMORY_PULL_COUNTERS:
            step = totals[name] - self._published[name]
            if step > 0:  # a Ray counter refuses an increment of 0
                self._counters[name].inc(step)
                self._published[name] = totals[name]


# ---- real-time sessions (deployments/realtime_api.py) ---------------------------------------------

_TICK_BOUNDARIES_S = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]


class RealtimeMetrics(Protocol):
    def tick(self, seconds: float, late: bool) -> None: ...
    def sessions(self, live: int, cap: int) -> None: ...
    def refused(self) -> None: ...
    def cliff(self, action: str) -> None: ...
    def shed(self, sessions: int) -> None: ...


class ServeRealtimeMetrics:
    def __init__(self) -> None:
        from ray.serve import metrics

        self._tick = metrics.Histogram(
            "baton_realtime_tick_seconds",
            "per-tick latency at the ingress: from the client's send (input sent_at) when given, else from reading the frame, "
            "to the output frame", boundaries=_TICK_BOUNDARIES_S)
        self._late = metrics.Counter(
            "baton_realtime_server_late_ticks",
            "ticks the server saw exceed the deadline (a lower bound: without sent_at it misses queueing; it never sees lost frames)")
        self._live = metrics.Gauge("baton_realtime_live_sessions", "live real-time sessions at this ingress")
        self._cap = metrics.Gauge("baton_realtime_session_cap", "AIMD admission cap at this ingress")
        self._refused = metrics.Counter("baton_realtime_refused_sessions", "sessions refused by admission control")
        self._cliff = metrics.Counter(
            "baton_realtime_cliff_sessions", "sessions opened while their decoder's KV cliff was within realtime.cliff.horizon_s, "
            "by action (warn: admitted; refuse: refused)", tag_keys=("action",))
        self._shed = metrics.Counter(
            "baton_realtime_sessions_shed", "live sessions closed (1013, shed_overload) when the AIMD cap fell below them "
            "(realtime.admission.overload: shed)")

    def tick(self, seconds: float, late: bool) -> None:
        self._tick.observe(seconds)
        if late:
            self._late.inc()

    def sessions(self, live: int, cap: int) -> None:
        self._live.set(live)
        self._cap.set(cap)

    def refused(self) -> None:
        self._refused.inc()

    def cliff(self, action: str) -> None:
        self._cliff.inc(tags={"action": action})

    def shed(self, sessions: int) -> None:
        if sessions:
            self._shed.inc(sessions)
