"""`baton bench reliability [--quick]`: faults, overload, bad input and isolation, against one
running local cluster (Ray CLI + `serve run`, as a user starts it).

The cluster is cluster_configs/local.yaml (conversation policy, 1 prefill + 2 decode engines,
memories and real-time sessions) with: two ingress replicas, API keys bound to users (alice,
bob) and an operator key (for /baton/stats) in BATON_API_KEYS, small admission limits so
overload reaches them, a fresh memory DB and smaller KV pools. Cases run in an order that keeps each one's preconditions (isolation and bad
input on a healthy cluster, then overload, then the faults, each waiting until Serve has made
the cluster whole again; the soak last, full mode only). Every case returns a CaseResult.

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from baton.bench import reliability_admission as admission
from baton.bench import reliability_faults as faults
from baton.bench import reliability_input as inputs
from baton.bench import reliability_load as load
from baton.bench.cluster import LocalServeApp
from baton.bench.reliability_client import CaseResult, Client, Tally
from baton.paths import REPO_ROOT

ROOT = REPO_ROOT
KEYS = {"alice": "ka-" + "a" * 24, "bob": "kb-" + "b" * 24}
OPERATOR_KEY = "ko-" + "o" * 24  # bound to no user: /baton/stats
INGRESS_REPLICAS, MAX_INFLIGHT = 2, 4
HTTP_PORT, RAY_PORT, METRICS_PORT = 28400, 26420, 28480
RAY_LOGS = Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs"


def bench_args(db_path: Path) -> dict[str, Any]:
    """local.yaml's application args, adjusted for this bench (see the module docstring)."""
    doc = yaml.safe_load((ROOT / "cluster_configs" / "local.yaml").read_text())
    args = copy.deepcopy(doc["applications"][0]["args"])
    args["ingress"] = {**args["ingress"], "num_replicas": INGRESS_REPLICAS, "api_keys_env": "BATON_API_KEYS",
                       "max_inflight_requests": MAX_INFLIGHT, "default_max_tokens": 16}
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
    """A case that raises is a failed case (the exception is its detail), not a crashed bench."""
    t0 = time.monotonic()
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - reported as the case's failure
        r = CaseResult(name, category, False, 0, 0, 0, f"raised {type(e).__name__}: {str(e)[:300]}", time.monotonic() - t0)
    print(f"[reliability] {'PASS' if r.passed else 'FAIL'} {r.name} ({r.seconds:.0f}s): {r.detail[:400]}", flush=True)
    return r


def run(quick: bool, out_dir: Path, *, soak_s: float = 600.0, only: set[str] | None = None) -> dict[str, Any]:
    """only: run just these categories (faults, overload, bad_input, security, soak); None: all
    (the soak only when not quick). The overload category includes the fixed vs adaptive admission
    comparison (baton/bench/reliability_admission.py; also `admission` alone), which runs after the
    shared cluster stops, on two app starts of its own."""
    import ray

    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="baton-reliability-"))
    args = bench_args(work / "memories.sqlite3")
    env = {"BATON_API_KEYS": ",".join([OPERATOR_KEY] + [f"{k}={u}" for u, k in KEYS.items()])}
    marker = f"ZQXMARK{uuid.uuid4().hex[:12]}"
    alice, bob = KEYS["alice"], KEYS["bob"]
    results: list[CaseResult] = []
    fresh = lambda url: Client(url, Tally())
    print(f"[reliability] starting the cluster (quick={quick}): 1 prefill + 2 decode engines, {INGRESS_REPLICAS} ingress replicas")
    with LocalServeApp(args, resources={"prefill_slot": 1, "decode_slot": 2}, http_port=HTTP_PORT, ray_port=RAY_PORT,
                       log_dir=work / "serve", env=env, metrics_export_port=METRICS_PORT) as app:
        print(f"[reliability] healthy after {app.start_seconds:.0f}s at {app.url}", flush=True)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address=f"127.0.0.1:{RAY_PORT}", log_to_driver=False, logging_level="ERROR")
        url, ws_url = app.url, app.url.replace("http://", "ws://") + "/v1/realtime"
        cl = faults.Cluster(url, alice, decode=2, prefill=1, ingress=INGRESS_REPLICAS, operator_key=OPERATOR_KEY)
        faults.wait_whole(fresh(url), cl)
        inputs.send_marker(fresh(url), alice, ws_url, marker)

        cases: list[tuple[str, str, Callable[[], CaseResult]]] = [
            ("auth: requests without a valid key get 401", "security", lambda: inputs.keys_required(fresh(url), bob)),
            ("isolation: bob vs alice's memories", "security", lambda: inputs.memories_isolated(fresh(url), alice, bob)),
            ("isolation: bob continues alice's conversation", "security", lambda: inputs.conversation_isolated(fresh(url), alice, bob)),
        ]
        cases += [(f"bad input: {b.name}", "bad_input", (lambda b=b: inputs.run_bad_request(fresh(url), alice, b)))
                  for b in inputs.bad_requests(args["ingress"]["served_model_name"])]
        cases += [
            ("bad input: malformed WebSocket frames", "bad_input", lambda: inputs.malformed_ws_frames(ws_url, alice)),
            ("schemathesis: no 5xx", "bad_input", lambda: inputs.schemathesis_fuzz(fresh(url), alice, out_dir, 8 if quick else 40,
                                                                                   150 if quick else 600)),
            ("overload at 2x admitted concurrency", "overload", lambda: load.overload(url, alice, load.Limits(INGRESS_REPLICAS, MAX_INFLIGHT),
                                                                                      45 if quick else 120)),
            ("restart memory-store actor", "faults", lambda: faults.memory_store_restarted(fresh(url), cl)),
            ("kill pinned decoder mid-stream", "faults", lambda: faults.pinned_decoder_killed(fresh(url), cl)),
            ("kill prefill during handoff", "faults", lambda: faults.prefill_killed_during_handoff(fresh(url), cl)),
            ("kill ingress replica + Serve controller", "faults", lambda: faults.ingress_and_controller_killed(fresh(url), cl)),
        ]
        if not quick:
            cases.append(("soak: agentic + memory + realtime", "soak", lambda: load.soak(url, KEYS, soak_s)))
        for name, category, fn in cases:
            if only is None or category in only:
                results.append(_guarded(name, category, fn))
        time.sleep(3)  # let log files flush
        if only is None or "security" in only:
            results.append(_guarded("no prompt text in logs or metrics", "security", lambda: inputs.marker_absent(
                marker, [RAY_LOGS, work / "serve"], f"http://127.0.0.1:{METRICS_PORT}/metrics", fresh(url))))
        oom = ray_oom_kills()
        ray.shutdown()
    if only is None or only & {"overload", "admission"}:  # two more app starts: fixed, then adaptive admission
        start = lambda a, mode: LocalServeApp(a, resources=admission.RESOURCES, http_port=HTTP_PORT, ray_port=RAY_PORT,
                                              log_dir=work / f"serve-{mode}", env=env, metrics_export_port=METRICS_PORT)
        results.append(_guarded("overload: adaptive vs fixed admission, same load", "overload", lambda: admission.compare(
            start, args, alice, load.Limits(INGRESS_REPLICAS, MAX_INFLIGHT), 45 if quick else 120, f"http://127.0.0.1:{METRICS_PORT}/metrics")))
    shutil.rmtree(work, ignore_errors=True)

    totals = {"lost_turns": sum(r.lost_turns for r in results), "server_errors": sum(r.server_errors for r in results),
              "isolation_leaks": sum(r.isolation_leaks for r in results), "cases": len(results),
              "passed": sum(r.passed for r in results)}
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": quick,
              "minutes": (time.monotonic() - t_start) / 60, "config": args, "totals": totals, "ray_oom_kills": oom,
              "not_run": {"KV load failure falls back to recompute": faults.KV_LOAD_FAILURE_NOTE},
              "cases": [asdict(r) for r in results]}
    (out_dir / "reliability.json").write_text(json.dumps(report, indent=2, default=str))
    print()
    print(_table(results))
    print(f"\n[reliability] not run here: KV load failure -> {faults.KV_LOAD_FAILURE_NOTE}")
    if oom:
        print(f"[reliability] WARNING: Ray's memory monitor killed {oom} workers during this run (node memory > 95%; "
              f"other processes on this machine count too): failures after that may be the machine's, not Baton's")
    print(f"[reliability] {report['minutes']:.1f} min; wrote {out_dir / 'reliability.json'}")
    print(f"RESULT lost_turns={totals['lost_turns']} server_errors={totals['server_errors']} "
          f"isolation_leaks={totals['isolation_leaks']} cases={totals['cases']} passed={totals['passed']}")
    return report
