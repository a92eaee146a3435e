"""`baton bench reliability [--quick]`: faults, overload, bad input, access and isolation,
against one running local cluster (Ray CLI + `serve run`, as a user starts it).

The cluster is cluster_configs/local.yaml (conversation policy, 1 prefill + 2 decode engines,
memories and real-time sessions) with: two ingress replicas, API keys bound to users (alice,
bob) and an operator key (for /baton/stats) in BATON_API_KEYS, small admission limits so
overload reaches them, a fresh memory DB and ownership file, smaller KV pools, a short real-time
idle timeout and a per-user session cap of 2. The cases (`case_plan`) run in an order that keeps
each one's preconditions: access and isolation on a fresh cluster, bad input, overload, the faults
(each waits until Serve has made the cluster whole again), the soak (full mode only), the marker
grep; then, once the shared cluster stopped, the cases that start clusters of their own (a
refused start on 0.0.0.0; fixed vs adaptive admission). Every case returns a CaseResult, and
passes only with 0 lost turns, 0 server errors and 0 leaks (reliability_verdict.settle); a
streamed answer succeeds only as reliability_verdict.judge_stream says.

Last line: RESULT lost_turns=<n> server_errors=<n> isolation_leaks=<n> cases=<n> passed=<n>
"""
from __future__ import annotations

import copy
import datetime as dt
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from baton.bench import reliability_access as access
from baton.bench import reliability_admission as admission
from baton.bench import reliability_faults as faults
from baton.bench import reliability_input as inputs
from baton.bench import reliability_load as load
from baton.bench import reliability_recovery as recovery
from baton.bench import reliability_ws as wsc
from baton.bench.cluster import LocalServeApp
from baton.bench.reliability_client import CaseResult, Client, Tally
from baton.bench.reliability_verdict import check_names, jsonable, result_line, settle, totals
from baton.paths import REPO_ROOT

ROOT = REPO_ROOT
KEYS = {"alice": "ka-" + "a" * 24, "bob": "kb-" + "b" * 24}
OPERATOR_KEY = "ko-" + "o" * 24  # bound to no user: /baton/stats
INGRESS_REPLICAS, MAX_INFLIGHT = 2, 4
# The shared cluster's chat admission: adaptive under the cap of 4, held to a TTFT of 5 s — about
# 3 x this machine's unloaded TTFT for the overload case's 700-word prompts (1.5-1.9 s, measured by
# the admission comparison's calibrations) — starting from 1: the first burst is admitted at the
# initial limit before any TTFT sample exists (started at the cap, the overload case's first 8
# requests took 24-51 s: measured once). The fixed bound alone is the admission comparison's
# baseline (reliability_admission.py): at 8 in flight two cores serve at under half their
# sequential throughput, so no latency bound in proportion to the admitted count can hold.
ADMISSION = {"mode": "adaptive", "ttft_target_s": 5.0, "initial_limit": 1, "min_limit": 1, "min_samples": 2,
             "control_period_s": 1.0, "window_s": 30.0}
HTTP_PORT, RAY_PORT, METRICS_PORT = 28400, 26420, 28480
EXPOSURE_HTTP_PORT = 28402  # the refused start's port (its own short cluster, after the main one stopped)
IDLE_TIMEOUT_S = 20.0  # realtime.idle_timeout_s here: long enough for held sessions to open, short enough to wait for
SESSIONS_PER_USER = 2  # realtime.max_sessions_per_user here: 2 x 2 ingress replicas + 1 sessions reach it
RESOURCES = {"prefill_slot": 1, "decode_slot": 2}
MIN_CASES = 36  # what --quick must run (the bar)
RAY_LOGS = Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs"


def bench_args(db_path: Path) -> dict[str, Any]:
    """local.yaml's application args, adjusted for this bench (see the module docstring); the
    conversation ownership file goes next to the memory DB (fresh per run)."""
    doc = yaml.safe_load((ROOT / "cluster_configs" / "local.yaml").read_text())
    args = copy.deepcopy(doc["applications"][0]["args"])
    args["ingress"] = {**args["ingress"], "num_replicas": INGRESS_REPLICAS, "api_keys_env": "BATON_API_KEYS",
                       "max_inflight_requests": MAX_INFLIGHT, "default_max_tokens": 16, "admission": ADMISSION}
    args["routing"] = {**args["routing"], "ownership_db_path": str(db_path.with_name("conversations.sqlite3"))}
    args["realtime"] = {**args["realtime"], "idle_timeout_s": IDLE_TIMEOUT_S, "max_sessions_per_user": SESSIONS_PER_USER}
    for pool, ongoing in (("prefill", 2), ("decode", 3)):
        engine = {**args[pool]["engine"], "kv_cache_gib": 0.5, "max_num_seqs": 16}
        args[pool] = {**args[pool], "engine": engine, "max_ongoing_requests": ongoing, "max_queued_requests": 2}
    args["memory"] = {**args["memory"], "db_path": str(db_path)}
    return args


def _table(results: list[CaseResult]) -> str:
    rows = [f"{'case':46} {'category':9} {'ok':4} {'lost':>4} {'5xx':>4} {'leak':>4} {'s':>6}  detail"]
    for r in results:
        rows.append(f"{r.name[:46]:46} {r.category:9} {'PASS' if r.passed else 'FAIL':4} {r.lost_turns:4d} {r.server_errors:4d} "
                    f"{r.isolation_leaks:4d} {r.seconds:6.1f}  {r.detail}")
    return "\n".join(rows)


def ray_oom_kills(logs: Path = RAY_LOGS) -> int:
    """Workers Ray's memory monitor killed in this session (the machine may be shared: a case that
    fails while this is > 0 may have been disturbed from outside)."""
    import re

    try:
        text = (logs / "raylet.out").read_text(errors="replace")
    except OSError:
        return 0
    return sum(int(n) for n in re.findall(r"(\d+) Workers \(tasks / actors\) killed due to memory pressure", text))


def _guarded(name: str, category: str, fn: Callable[[], CaseResult]) -> CaseResult:
    """A case that raises is a failed case (the exception is its detail), not a crashed bench; a
    case passes only with 0 lost turns, 0 server errors and 0 leaks (reliability_verdict.settle)."""
    t0 = time.monotonic()
    try:
        r = settle(fn())
    except Exception as e:  # noqa: BLE001 - reported as the case's failure
        r = CaseResult(name, category, False, 0, 0, 0, f"raised {type(e).__name__}: {str(e)[:300]}", time.monotonic() - t0)
    print(f"[reliability] {'PASS' if r.passed else 'FAIL'} {r.name} ({r.seconds:.0f}s): {r.detail[:400]}", flush=True)
    return r


@dataclass(frozen=True)
class Case:
    name: str
    category: str  # faults | overload | bad_input | security | soak
    fn: Callable[[], CaseResult]
    after_cluster: bool = False  # runs once the shared cluster stopped (it starts clusters of its own)


@dataclass(frozen=True)
class Ctx:
    """What the cases reach: the shared cluster's addresses and keys, and where they write."""

    work: Path
    out_dir: Path
    args: dict[str, Any]
    env: dict[str, str]
    marker: str
    quick: bool
    soak_s: float
    url: str = f"http://127.0.0.1:{HTTP_PORT}"
    metrics_url: str = f"http://127.0.0.1:{METRICS_PORT}/metrics"

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/realtime"

    @property
    def cluster(self) -> faults.Cluster:
        return faults.Cluster(self.url, KEYS["alice"], decode=2, prefill=1, ingress=INGRESS_REPLICAS, operator_key=OPERATOR_KEY)

    def fresh(self) -> Client:
        return Client(self.url, Tally())


def case_plan(ctx: Ctx) -> list[Case]:
    """Every case, in the order that keeps each one's preconditions: access and isolation on a
    healthy, fresh cluster, then bad input, overload, the faults (each waits until Serve made the
    cluster whole again), the soak (full mode), the marker grep last; then the cases that start
    clusters of their own."""
    alice, bob, op = KEYS["alice"], KEYS["bob"], OPERATOR_KEY
    fresh, cl, limits = ctx.fresh, ctx.cluster, load.Limits(INGRESS_REPLICAS, MAX_INFLIGHT)
    ingress = ctx.args["ingress"]
    max_frame = int(ctx.args.get("realtime", {}).get("max_frame_bytes", 64 * 1024))
    cases = [
        Case("auth: requests without a valid key get 401", "security", lambda: inputs.keys_required(fresh(), bob)),
        Case("auth: docs and schema need a key; scheme any case; empty key 401", "security", lambda: access.key_everywhere(fresh(), bob)),
        Case("roles: operator key reads stats, names any user", "security", lambda: access.operator_role(fresh(), op)),
        Case("roles: bound key refused stats and other users (403)", "security", lambda: access.bound_role(fresh(), bob, ctx.ws_url)),
        Case("isolation: bob vs alice's memories", "security", lambda: inputs.memories_isolated(fresh(), alice, bob)),
        Case("isolation: bob continues alice's conversation", "security", lambda: inputs.conversation_isolated(fresh(), alice, bob)),
        Case("isolation: no cached tokens across tenants", "security", lambda: access.cache_oracle(fresh(), alice, bob, op)),
        Case("exposure: build_app refuses 0.0.0.0 without keys", "security", lambda: access.build_refused(ctx.args)),
    ]
    cases += [Case(f"bad input: {b.name}", "bad_input", (lambda b=b: inputs.run_bad_request(fresh(), alice, b)))
              for b in inputs.bad_requests(ingress["served_model_name"])]
    cases += [
        Case("bad input: 10 MB body (413 in < 1 s, others unaffected)", "bad_input",
             lambda: inputs.big_body_refused(fresh(), alice, int(ingress.get("max_body_bytes", 4 << 20)))),
        Case("bad input: malformed WebSocket frames", "bad_input", lambda: wsc.malformed_ws_frames(ctx.ws_url, alice)),
        Case("bad input: idle WebSocket closed (4408)", "bad_input", lambda: wsc.idle_ws_closed(ctx.ws_url, alice, IDLE_TIMEOUT_S)),
        Case("bad input: per-user WebSocket session cap (1008)", "bad_input",
             lambda: wsc.session_cap_ws(ctx.ws_url, alice, SESSIONS_PER_USER, INGRESS_REPLICAS)),
        Case("bad input: flooding WebSocket (1009, bounded)", "bad_input", lambda: wsc.flooding_ws(ctx.ws_url, ctx.url, alice, max_frame)),
        # the operator key: every operation, /baton/stats included, may be reached (a user key gets only 403 there)
        Case("schemathesis: no 5xx", "bad_input", lambda: inputs.schemathesis_fuzz(fresh(), op, ctx.out_dir, 8 if ctx.quick else 40,
                                                                                   150 if ctx.quick else 600)),
        Case("overload at 2x admitted concurrency", "overload", lambda: load.overload(ctx.url, alice, limits, 45 if ctx.quick else 120)),
        Case("restart memory-store actor", "faults", lambda: faults.memory_store_restarted(fresh(), cl)),
        Case("kill decoder mid-stream: the stream resumes", "faults", lambda: recovery.stream_resumed(fresh(), cl, ctx.metrics_url)),
        Case("kill pinned decoder mid-stream", "faults", lambda: faults.pinned_decoder_killed(fresh(), cl)),
        Case("kill prefill during handoff", "faults", lambda: faults.prefill_killed_during_handoff(fresh(), cl)),
        Case("kill conversation directory during a replay", "faults", lambda: recovery.directory_killed_during_replay(ctx.url, cl, KEYS)),
        Case("kill ingress replica + Serve controller", "faults", lambda: faults.ingress_and_controller_killed(fresh(), cl)),
    ]
    if not ctx.quick:
        cases.append(Case("soak: agentic + memory + realtime", "soak", lambda: load.soak(ctx.url, KEYS, ctx.soak_s)))

    def marker() -> CaseResult:
        time.sleep(3)  # let log files flush
        return inputs.marker_absent(ctx.marker, [RAY_LOGS, ctx.work / "serve"], ctx.metrics_url, fresh())

    cases.append(Case("no prompt text in logs or metrics", "security", marker))
    cases.append(Case("exposure: serve run on 0.0.0.0 without keys is refused", "security", lambda: access.serve_run_refused(
        ctx.args, http_port=EXPOSURE_HTTP_PORT, ray_port=RAY_PORT, resources=RESOURCES, log_dir=ctx.work / "serve-exposure"), True))
    start = lambda a, mode: LocalServeApp(a, resources=admission.RESOURCES, http_port=HTTP_PORT, ray_port=RAY_PORT,
                                          log_dir=ctx.work / f"serve-{mode}", env=ctx.env, metrics_export_port=METRICS_PORT)
    cases.append(Case("overload: adaptive vs fixed admission, same load", "overload", lambda: admission.compare(
        start, ctx.args, alice, limits, 45 if ctx.quick else 120, ctx.metrics_url), True))
    check_names(c.name for c in cases)
    return cases


def selected(case: Case, only: set[str] | None) -> bool:
    """only: categories (faults, overload, bad_input, security, soak), or `admission` for the
    adaptive-vs-fixed comparison alone; None: every case of the plan."""
    return only is None or case.category in only or ("admission" in only and case.name.startswith("overload: adaptive"))


def run(quick: bool, out_dir: Path, *, soak_s: float = 600.0, only: set[str] | None = None) -> dict[str, Any]:
    """The plan (case_plan) against one shared cluster, then the cases that start their own."""
    import ray

    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="baton-reliability-"))
    env = {"BATON_API_KEYS": ",".join([OPERATOR_KEY] + [f"{k}={u}" for u, k in KEYS.items()])}
    ctx = Ctx(work, out_dir, bench_args(work / "memories.sqlite3"), env, f"ZQXMARK{uuid.uuid4().hex[:12]}", quick, soak_s)
    plan = [c for c in case_plan(ctx) if selected(c, only)]
    results: list[CaseResult] = []
    oom = 0
    print(f"[reliability] {len(plan)} cases; starting the cluster (quick={quick}): 1 prefill + 2 decode engines, {INGRESS_REPLICAS} ingress replicas")
    if any(not c.after_cluster for c in plan):
        with LocalServeApp(ctx.args, resources=RESOURCES, http_port=HTTP_PORT, ray_port=RAY_PORT,
                           log_dir=work / "serve", env=env, metrics_export_port=METRICS_PORT) as app:
            print(f"[reliability] healthy after {app.start_seconds:.0f}s at {app.url}", flush=True)
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(address=f"127.0.0.1:{RAY_PORT}", log_to_driver=False, logging_level="ERROR")
            faults.wait_whole(ctx.fresh(), ctx.cluster)
            inputs.send_marker(ctx.fresh(), KEYS["alice"], ctx.ws_url, ctx.marker)
            results += [_guarded(c.name, c.category, c.fn) for c in plan if not c.after_cluster]
            oom = ray_oom_kills()
            ray.shutdown()
    results += [_guarded(c.name, c.category, c.fn) for c in plan if c.after_cluster]
    shutil.rmtree(work, ignore_errors=True)

    t = totals(results)
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": quick,
              "minutes": (time.monotonic() - t_start) / 60, "config": ctx.args, "totals": asdict(t), "clean": t.clean,
              "ray_oom_kills": oom, "not_run": {"KV load failure falls back to recompute": faults.KV_LOAD_FAILURE_NOTE},
              "cases": [asdict(r) for r in results]}
    (out_dir / "reliability.json").write_text(json.dumps(jsonable(report), indent=2, default=str))
    print()
    print(_table(results))
    print(f"\n[reliability] not run here: KV load failure -> {faults.KV_LOAD_FAILURE_NOTE}")
    if oom:
        print(f"[reliability] WARNING: Ray's memory monitor killed {oom} workers during this run (node memory > 95%; "
              f"other processes on this machine count too): failures after that may be the machine's, not Baton's")
    if only is None and t.cases < MIN_CASES:
        print(f"[reliability] WARNING: {t.cases} cases ran, fewer than the {MIN_CASES} the bench promises")
    print(f"[reliability] {report['minutes']:.1f} min; wrote {out_dir / 'reliability.json'}")
    print(result_line(t))
    return report
