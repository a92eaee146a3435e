"""Chat admission under overload: the fixed in-flight bound against adaptive admission
(router/chat_admission.py), the same offered load, in the same run. Part of `baton bench
reliability`; alone: `baton bench admission [--quick]`.

Two app starts of the reliability bench's cluster that differ only in `ingress.admission`:
first `fixed` (max_inflight_requests), then `adaptive` (a TTFT target under the same cap). Both
run ONE ingress replica holding the bench's whole admitted concurrency (2 replicas x 4 = a cap
of 8): a per-ingress adaptive limit cannot go below one request per ingress replica, and on this
2-core machine two first turns at once already take about 2.1-2.6 x the unloaded TTFT, so with
two ingress replicas the floor alone sits at the 3 x SLO (measured: passed once at p99 4.06 s vs
4.56 s, failed once at 6.5 s vs 5.36 s with both limits at 1 throughout). Each phase, on its
fresh cluster:
  1. calibrate: one warm-up request (discarded), then CALIBRATION_PROBES sequential streaming
     requests on the idle cluster; unloaded TTFT = their median (never one probe alone);
  2. load: 2 x the fixed bound's admitted concurrency in closed-loop streaming clients (16 for
     45 s in quick mode), never-cached 700-word prompts, max_tokens 16; a refused client waits
     Retry-After (at most 5 s), as OpenAI's clients do. No request is sent after duration_s; one
     still running GRACE_TARGETS x target_s later is cut (a miss).

The target is about time to first token (TTFT, first content chunk at the client):
target_s = SLO_FACTOR x the fixed phase's unloaded TTFT. The adaptive ingress is given
CONTROL_FRACTION x target_s: AIMD probes one step over its target once per cycle, so it aims
under the SLO it is judged by. Per phase:
  goodput    200s with TTFT <= target_s and a complete stream (judge_stream: content, one
             finish_reason, [DONE], no error event), per second of load (first
             request to last answer);
  admitted   every request not refused with 429: a 200 counts its TTFT; a 503, an in-stream
             error, a cut or a connection failure counts as +inf (failures are not dropped);
             p50 / p99 nearest rank;
  refused    429s; ratio = goodput_adaptive / goodput_fixed (inf when fixed met none).
Passes when the ratio is >= 2 with some goodput, the adaptive phase's admitted p99 <= target_s,
and no 5xx. The two calibrations are both reported: their ratio says whether the machine changed.
"""
from __future__ import annotations

import copy
import json
import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from baton.bench.cluster import RunningApp
from baton.bench.reliability_client import CaseResult, chat_body
from baton.bench.reliability_load import Limits, long_prompt
from baton.bench.reliability_verdict import StreamSeen, jsonable, judge_stream

CALIBRATION_PROBES = 5
SLO_FACTOR = 3.0
CONTROL_FRACTION = 0.8
GRACE_TARGETS = 2.0
PROMPT_WORDS, MAX_TOKENS = 700, 16
RESOURCES = {"prefill_slot": 1, "decode_slot": 2}  # the reliability bench's cluster

StartApp = Callable[[dict[str, Any], str], AbstractContextManager[RunningApp]]


@dataclass(frozen=True)
class Shot:
    """One streaming chat request as the client saw it. status None: no HTTP answer (connection
    failure, or cut at the deadline before the headers)."""

    status: int | None
    ttft_s: float | None  # first content chunk
    e2e_s: float
    error: str | None  # in-stream error type, "cut" (past the deadline), the exception's name, or judge_stream's first problem
    retry_after: str | None = None

    @property
    def refused(self) -> bool:
        return self.status == 429

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def latency(self) -> float:
        """What the request counts as among the admitted: its TTFT, +inf when it failed."""
        return (self.ttft_s if self.ttft_s is not None else self.e2e_s) if self.ok else math.inf


def shot(http: httpx.Client, url: str, key: str, deadline: float) -> Shot:
    """One streamed request; a 200 counts as ok only if its stream passes judge_stream (content,
    one finish_reason, [DONE], no error event); otherwise `error` says what was wrong."""
    body = {**chat_body(long_prompt(PROMPT_WORDS), MAX_TOKENS, ignore_eos=True), "stream": True}
    t0 = time.monotonic()
    ttft: float | None = None
    err: str | None = None
    seen = StreamSeen()
    timeout = httpx.Timeout(10.0, read=max(1.0, deadline - t0))
    try:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return Shot(r.status_code, None, time.monotonic() - t0, None, r.headers.get("retry-after"))
            for line in r.iter_lines():
                if time.monotonic() > deadline:
                    err = "cut"
                    break
                if seen.feed(line) is not None and ttft is None:
                    ttft = time.monotonic() - t0
    except httpx.TimeoutException:
        return Shot(None, ttft, time.monotonic() - t0, "cut")
    except httpx.HTTPError as e:
        return Shot(None, ttft, time.monotonic() - t0, type(e).__name__)
    if err is None and seen.errors:
        err = str(seen.errors[0].get("type") or "error")
    elif err is None:
        verdict = judge_stream(200, seen)
        err = None if verdict.ok else verdict.problems[0]
    return Shot(200, ttft, time.monotonic() - t0, err)


def nearest_rank(values: list[float], q: float) -> float:
    """+inf-safe percentile (linear interpolation would turn inf - inf into nan)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def calibrate(url: str, key: str, probes: int = CALIBRATION_PROBES, timeout_s: float = 120.0) -> list[Shot]:
    """A warm-up request, then `probes` sequential ones; raises if any probe fails."""
    with httpx.Client() as http:
        shot(http, url, key, time.monotonic() + timeout_s)
        got = [shot(http, url, key, time.monotonic() + timeout_s) for _ in range(probes)]
    bad = [s for s in got if not s.ok or s.ttft_s is None]
    if bad:
        raise RuntimeError(f"calibration failed on an idle cluster: {[(s.status, s.error) for s in bad]}")
    return got


def closed_loop(url: str, key: str, clients: int, duration_s: float, grace_s: float) -> tuple[list[Shot], float]:
    """`clients` closed-loop clients for duration_s; returns every answer and the load's seconds."""
    shots: list[Shot] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop_at = t0 + duration_s

    def worker() -> None:
        with httpx.Client() as http:
            while time.monotonic() < stop_at:
                s = shot(http, url, key, stop_at + grace_s)
                with lock:
                    shots.append(s)
                if not s.ok:  # a refused or failed client waits Retry-After (at most 5 s; 1 s without one)
                    try:
                        time.sleep(min(5.0, float(s.retry_after or 1.0)))
                    except ValueError:
                        time.sleep(1.0)
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return shots, time.monotonic() - t0


class LimitTrace:
    """Samples `baton_admission_limit` (each ingress replica's limit) from Ray's Prometheus
    export every 2 s while the load runs (best effort: figures, never a verdict)."""

    def __init__(self, metrics_url: str | None) -> None:
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._url, self._stop = metrics_url, threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        t0 = time.monotonic()
        while self._url and not self._stop.wait(2.0):
            try:
                text = httpx.get(self._url, timeout=5).text
                series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if "baton_admission_limit" in line and not line.startswith("#")}
            except (httpx.HTTPError, ValueError, IndexError):
                continue
            self.samples.append((round(time.monotonic() - t0, 1), series))

    def __enter__(self) -> LimitTrace:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def summary(self) -> dict[str, Any]:
        values = [v for _, s in self.samples for v in s.values()]
        return {"samples": len(self.samples), "min": min(values, default=None), "max": max(values, default=None),
                "last": self.samples[-1][1] if self.samples else {}}


@dataclass
class Phase:
    mode: str
    probe_ttfts_s: list[float]
    target_s: float
    load_s: float
    shots: list[Shot]
    limit_trace: dict[str, Any] = field(default_factory=dict)

    @property
    def unloaded_ttft_s(self) -> float:
        return statistics.median(self.probe_ttfts_s)

    def figures(self) -> dict[str, Any]:
        admitted = [s for s in self.shots if not s.refused]
        lat = [s.latency() for s in admitted]
        good = [s for s in admitted if s.ok and s.latency() <= self.target_s]
        ok_e2e = [s.e2e_s for s in admitted if s.ok]
        statuses = Counter(str(s.status) for s in self.shots)
        return {"mode": self.mode, "unloaded_ttft_s": self.unloaded_ttft_s, "probe_ttfts_s": self.probe_ttfts_s,
                "target_s": self.target_s, "load_s": self.load_s, "requests": len(self.shots), "statuses": dict(statuses),
                "refused": statuses.get("429", 0), "admitted": len(admitted), "ok": len(ok_e2e), "good": len(good),
                "failures": Counter(s.error or str(s.status) for s in admitted if not s.ok),
                "goodput_per_s": len(good) / self.load_s if self.load_s > 0 else 0.0,
                "admitted_ttft_p50_s": nearest_rank(lat, 0.5), "admitted_ttft_p99_s": nearest_rank(lat, 0.99),
                "ok_e2e_p50_s": nearest_rank(ok_e2e, 0.5), "ok_e2e_p99_s": nearest_rank(ok_e2e, 0.99),
                "server_errors": sum(1 for s in self.shots if s.status is not None and s.status >= 500 and s.status != 503),
                "limit_trace": self.limit_trace}


def adaptive_admission(target_s: float) -> dict[str, Any]:
    """`ingress.admission` of the adaptive phase: few samples per decision (this machine answers
    a handful of requests per second), starting from one request per ingress."""
    return {"mode": "adaptive", "ttft_target_s": round(CONTROL_FRACTION * target_s, 3), "initial_limit": 1, "min_limit": 1,
            "additive_step": 1, "multiplicative_factor": 0.5, "control_period_s": 1.0, "window_s": 60.0, "min_samples": 2}


def with_admission(args: dict[str, Any], admission: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """One ingress replica holding the whole admitted concurrency (see the module docstring)."""
    out = copy.deepcopy(args)
    out["ingress"] = {**out["ingress"], "admission": admission, "num_replicas": 1, "max_inflight_requests": limits.admitted}
    return out


def run_phase(start: StartApp, args: dict[str, Any], mode: str, key: str, limits: Limits, duration_s: float,
              target_s: float | None, metrics_url: str | None) -> Phase:
    """One app start: calibrate, then the load. target_s None: derived from this calibration."""
    with start(args, mode) as app:
        probes = [s.ttft_s for s in calibrate(app.url, key) if s.ttft_s is not None]
        target = target_s if target_s is not None else SLO_FACTOR * statistics.median(probes)
        print(f"[admission] {mode}: unloaded TTFT median {statistics.median(probes):.2f}s of {probes}; target {target:.2f}s", flush=True)
        with LimitTrace(metrics_url) as trace:
            shots, load_s = closed_loop(app.url, key, 2 * limits.admitted, duration_s, GRACE_TARGETS * target)
    return Phase(mode, probes, target, load_s, shots, trace.summary())


def compare(start: StartApp, args: dict[str, Any], key: str, limits: Limits, duration_s: float,
            metrics_url: str | None = None) -> CaseResult:
    t0 = time.monotonic()
    fixed = run_phase(start, with_admission(args, {"mode": "fixed"}, limits), "fixed", key, limits, duration_s, None, metrics_url)
    adaptive = run_phase(start, with_admission(args, adaptive_admission(fixed.target_s), limits), "adaptive", key, limits, duration_s,
                         fixed.target_s, metrics_url)
    f, a = fixed.figures(), adaptive.figures()
    g_f, g_a = f["goodput_per_s"], a["goodput_per_s"]
    ratio = g_a / g_f if g_f > 0 else (math.inf if g_a > 0 else math.nan)
    drift = adaptive.unloaded_ttft_s / fixed.unloaded_ttft_s
    errors = f["server_errors"] + a["server_errors"]
    ok = g_a > 0 and ratio >= 2.0 and a["admitted_ttft_p99_s"] <= fixed.target_s and errors == 0
    rows = "; ".join(
        f"{p['mode']}: goodput {p['goodput_per_s']:.3f}/s ({p['good']} of {p['admitted']} admitted met it in {p['load_s']:.0f}s), "
        f"admitted TTFT p50 {p['admitted_ttft_p50_s']:.1f}s p99 {p['admitted_ttft_p99_s']:.1f}s, e2e of 200s p50 "
        f"{p['ok_e2e_p50_s']:.1f}s p99 {p['ok_e2e_p99_s']:.1f}s, refused {p['refused']}, failures {dict(p['failures'])}, "
        f"limit {p['limit_trace'].get('min')}..{p['limit_trace'].get('max')}" for p in (f, a))
    detail = (f"{2 * limits.admitted} closed-loop streaming clients for {duration_s:.0f}s per mode; TTFT target {fixed.target_s:.2f}s = "
              f"{SLO_FACTOR:g} x unloaded median {fixed.unloaded_ttft_s:.2f}s ({CALIBRATION_PROBES} probes; adaptive phase's "
              f"calibration {adaptive.unloaded_ttft_s:.2f}s, x{drift:.2f}); {rows}; goodput ratio adaptive/fixed {ratio:.2f}")
    res = CaseResult("overload: adaptive vs fixed admission, same load", "overload", ok, 0, errors, 0, detail, time.monotonic() - t0)
    res.figures = {"fixed": f, "adaptive": a, "goodput_ratio": ratio, "calibration_drift": drift,
                   "adaptive_config": adaptive_admission(fixed.target_s),
                   "shots": {"fixed": [asdict(s) for s in fixed.shots], "adaptive": [asdict(s) for s in adaptive.shots]}}
    return res


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """`baton bench admission [--quick]`: this comparison alone, on the reliability bench's cluster."""
    import tempfile

    from baton.bench import reliability as rel
    from baton.bench.cluster import LocalServeApp

    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="baton-admission-"))
    env = {"BATON_API_KEYS": f"{rel.KEYS['alice']}=alice"}
    res = compare(lambda a, mode: LocalServeApp(a, resources=RESOURCES, http_port=rel.HTTP_PORT, ray_port=rel.RAY_PORT,
                                                log_dir=work / f"serve-{mode}", env=env, metrics_export_port=rel.METRICS_PORT),
                  rel.bench_args(work / "memories.sqlite3"), rel.KEYS["alice"], Limits(rel.INGRESS_REPLICAS, rel.MAX_INFLIGHT),
                  45 if quick else 120, f"http://127.0.0.1:{rel.METRICS_PORT}/metrics")
    report = {"quick": quick, "case": asdict(res)}
    (out_dir / "admission.json").write_text(json.dumps(jsonable(report), indent=2, default=str))
    print(f"[admission] {'PASS' if res.passed else 'FAIL'}: {res.detail}")
    ratio = res.figures.get("goodput_ratio", math.nan)
    a = res.figures.get("adaptive", {})
    print(f"RESULT goodput_ratio={ratio:.2f} adaptive_p99_ttft_s={a.get('admitted_ttft_p99_s', math.nan):.2f} "
          f"target_s={a.get('target_s', math.nan):.2f} passed={int(res.passed)}")
    return report
