"""`baton bench multinode [--quick]`: Baton on a real two-node Ray cluster on this machine, and a
node failure under live conversations.

Cluster (baton/bench/cluster.py + ray_nodes.py): a head (`ray start --head`: 1 CPU, prefill_slot 1,
decode_slot 1) and a worker node (`ray start --address=<head>`: its own raylet and object store,
1 CPU, decode_slot 1), then `serve run` of cluster_configs/local_multinode.yaml's args (real vLLM
engines on SmolLM2, conversation policy): the prefill engine and one decoder on the head, the
other decoder on the worker (one decode_slot per node), the ingress and the directory kept on the
head by `control_plane.custom` (Ray's `node:__internal_head__`), Serve's HTTP proxy on the head.
Where each replica runs is read from /baton/stats (each replica reports its Ray node id).

Each cycle (quick: 2, full: 4):
1. C conversations open (quick 4, full 6), one first turn each, placed by the directory's load
   score. Those placed on the worker's decoder were prefilled on the head and their KV moved
   across nodes over NIXL: the worker decoder's connector counts the transfers and bytes.
2. Every conversation runs streamed turns back to back (one client thread each, 24 tokens,
   ignore_eos, the history growing), and at `kill_at_s` the worker's raylet is SIGKILLed — a
   node failure: its workers lose their raylet and exit, the head's GCS marks the node dead after
   its health checks, Serve replaces the replica. A turn gets one retry of a retryable failure
   (the reliability bench's client rule); without a complete answer after it, it is lost.
   Recorded per turn: start, end, outcome, attempts, the decoder that answered.
3. The node's leftover processes are counted (none should outlive their raylet), the worker node
   is started again (`ray start --address`, a new node id) and the time until a decoder is live
   on it is the rejoin time; the next cycle runs on the healed cluster.

Figures per cycle (multinode_stats.py): conversations placed on the worker, cross-node handoffs
and bytes, turns, turns after the kill, lost turns, retried turns, p50 turn time before the kill
and the slowest turn after it, conversations that moved off the victim and the slowest one's
recovery (kill -> its first ok turn on the other decoder; +inf if none), streams the ingress
resumed, leftover processes, rejoin time. Writes multinode.json and multinode.png (every turn's
duration against its end time, the kill marked) and ends with `RESULT nodes=2 cycles=…
cross_node_handoffs=… lost_turns=… turns_after_kill=… moved_conversations=… resumed_streams=…
recovery_s_max=… max_turn_s_after_kill=… rejoin_s_max=… leftover_processes=…`.
"""
from __future__ import annotations

import copy
import json
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from baton.bench.cluster import LocalServeApp, settled
from baton.bench.multinode_stats import CycleStats, TurnRecord, cycle_stats, result_line
from baton.bench.ray_nodes import WorkerNode, kill_raylet, leftovers
from baton.bench.reliability_client import Client, Tally
from baton.bench.reliability_faults import Conversation
from baton.paths import REPO_ROOT

CONFIG = REPO_ROOT / "cluster_configs" / "local_multinode.yaml"
HEAD_RESOURCES = {"prefill_slot": 1, "decode_slot": 1}
WORKER = WorkerNode("worker1", num_cpus=1, resources={"decode_slot": 1})
HTTP_PORT, RAY_PORT = 28600, 26600
TURN_TOKENS = 24
MAX_TURNS = 48  # ~1.5 s a turn: longer than a cycle; ~50 tokens a turn keeps the history inside max_model_len


@dataclass(frozen=True)
class Plan:
    cycles: int
    conversations: int
    kill_at_s: float
    run_s: float


def plan(quick: bool) -> Plan:
    return Plan(cycles=2, conversations=4, kill_at_s=15.0, run_s=45.0) if quick else Plan(cycles=4, conversations=6, kill_at_s=20.0, run_s=60.0)


def bench_args(state_dir: Path) -> dict[str, Any]:
    """local_multinode.yaml's args with this run's own ownership file."""
    args = copy.deepcopy(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
    args["routing"] = {**args["routing"], "ownership_db_path": str(state_dir / "conversations.sqlite3")}
    return args


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/baton/stats", timeout=10).json()


@dataclass(frozen=True)
class Layout:
    head_node: str
    worker_decoder: str
    worker_node: str
    head_decoder: str


def wait_layout(url: str, not_nodes: set[str], timeout_s: float = 300) -> tuple[Layout, float]:
    """Until a live decoder reports from a node that is neither the head nor one of `not_nodes`
    (a dead node's id), and one from the head; returns the layout and the seconds it took."""
    t0 = time.monotonic()
    last: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout_s:
        try:
            last = stats(url)["replicas"]
        except (httpx.HTTPError, ValueError, KeyError):
            time.sleep(1)
            continue
        live = {rid: r for rid, r in last.items() if r.get("live") and r.get("node_id")}
        heads = {r["node_id"] for r in live.values() if r["pool"] == "prefill"}
        if len(heads) == 1:
            head = next(iter(heads))
            decoders = {rid: r["node_id"] for rid, r in live.items() if r["pool"] == "decode"}
            on_head = [rid for rid, n in decoders.items() if n == head]
            elsewhere = [(rid, n) for rid, n in decoders.items() if n != head and n not in not_nodes]
            if on_head and elsewhere:
                return Layout(head, elsewhere[0][0], elsewhere[0][1], on_head[0]), time.monotonic() - t0
        time.sleep(1)
    raise RuntimeError(f"no decoder live on a worker node within {timeout_s:.0f} s; replicas: "
                       f"{ {rid: (r.get('pool'), r.get('node_id'), r.get('live')) for rid, r in last.items()} }")


def _transfers(url: str, replica: str) -> tuple[int, int]:
    r = stats(url)["replicas"].get(replica, {})
    return int(r.get("kv_transfers_received", 0)), int(r.get("kv_bytes_received", 0))


def _resumed(url: str) -> int:
    return int(stats(url)["ingress"].get("stream_resumes", {}).get("resumed", 0))


def _client_loop(conv: Conversation, t0: float, stop_at: float, out: list[TurnRecord], lock: threading.Lock) -> None:
    while time.monotonic() < stop_at and len(conv.outcomes) < MAX_TURNS:
        pinned = next((r for r in reversed(conv.replicas) if r is not None), None)
        start = time.monotonic() - t0
        a = conv.turn(f"Turn {len(conv.outcomes)}: tell me more about the weather there.", stream=True, max_tokens=TURN_TOKENS)
        o = conv.outcomes[-1]
        rec = TurnRecord(conv.sid, start, time.monotonic() - t0, a.ok, o.lost, o.attempts,
                         a.headers.get("x-baton-replica") if a.ok else None, pinned)
        with lock:
            out.append(rec)


def run_cycle(app: LocalServeApp, url: str, cycle: int, p: Plan, layout: Layout) -> tuple[CycleStats, list[TurnRecord], str]:
    client = Client(url, Tally(), timeout_s=180)
    try:
        before_n, before_b = settled(lambda: _transfers(url, layout.worker_decoder))
        convs = [Conversation(client, None, f"mn{cycle}-{i}") for i in range(p.conversations)]
        for c in convs:
            c.turn("Which city should I visit in May?", max_tokens=TURN_TOKENS)
        placed = [c.replicas[-1] for c in convs]
        on_worker = sum(r == layout.worker_decoder for r in placed)
        after_n, after_b = settled(lambda: _transfers(url, layout.worker_decoder))
        print(f"[multinode] cycle {cycle}: {on_worker} of {len(convs)} conversations on the worker's decoder "
              f"{layout.worker_decoder}; it received {after_n - before_n} KV transfers ({(after_b - before_b) / 1e6:.1f} MB) from the head")
        resumed0 = _resumed(url)
        records: list[TurnRecord] = []
        lock = threading.Lock()
        t0 = time.monotonic()
        threads = [threading.Thread(target=_client_loop, args=(c, t0, t0 + p.run_s, records, lock), daemon=True) for c in convs]
        for th in threads:
            th.start()
        time.sleep(max(0.0, t0 + p.kill_at_s - time.monotonic()))
        killed = kill_raylet(WORKER)
        killed_at = time.monotonic() - t0
        print(f"[multinode] cycle {cycle}: killed the worker's raylet (pid {killed.raylet_pid}, {len(killed.processes)} processes on the node) "
              f"at {killed_at:.1f} s")
        for th in threads:
            th.join(timeout=p.run_s + 400)
        time.sleep(5)
        left = leftovers(killed)
        resumed = _resumed(url) - resumed0
        t_join = time.monotonic()
        app.start_worker(WORKER)
        try:
            layout_after, _ = wait_layout(url, not_nodes={layout.worker_node})
            rejoin = time.monotonic() - t_join
        except RuntimeError as e:
            print(f"[multinode] cycle {cycle}: {e}")
            layout_after, rejoin = None, math.inf
        cs = cycle_stats(cycle, records, killed_at, layout.worker_decoder, conversations=len(convs), on_worker=on_worker,
                         cross_node_handoffs=after_n - before_n, cross_node_bytes=after_b - before_b, resumed_streams=resumed,
                         leftover_processes=len(left), rejoin_s=rejoin)
        print(f"[multinode] cycle {cycle}: {cs.turns} turns, {cs.turns_after_kill} after the kill, {cs.lost} lost, {cs.retried} retried; "
              f"{cs.moved} conversations moved off the victim, slowest recovery {cs.recovery_s:.1f} s; slowest turn after the kill "
              f"{cs.max_turn_s_after:.1f} s (p50 before {cs.p50_turn_s_before:.2f} s); {resumed} streams resumed; "
              f"{len(left)} leftover processes; rejoined in {rejoin:.1f} s")
        return cs, records, (layout_after.worker_decoder if layout_after else "")
    finally:
        client.close()


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    p = plan(quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[multinode] head (1 CPU, {HEAD_RESOURCES}) + worker node {WORKER.name} (1 CPU, {WORKER.resources}); {p.cycles} cycles of "
          f"{p.conversations} conversations, the worker's raylet killed at {p.kill_at_s:.0f} s of {p.run_s:.0f} s")
    cycles: list[CycleStats] = []
    turns: dict[int, list[dict[str, Any]]] = {}
    app = LocalServeApp(bench_args(out_dir), resources=HEAD_RESOURCES, num_cpus=1, http_port=HTTP_PORT, ray_port=RAY_PORT,
                        log_dir=out_dir / "serve", workers=(WORKER,))
    with app as running:
        layout, _ = wait_layout(running.url, not_nodes=set())
        print(f"[multinode] healthy in {running.start_seconds:.0f} s: head node {layout.head_node[:8]} (prefill, decoder "
              f"{layout.head_decoder}), worker node {layout.worker_node[:8]} (decoder {layout.worker_decoder})")
        for cycle in range(p.cycles):
            cs, records, _ = run_cycle(app, running.url, cycle, p, layout)
            cycles.append(cs)
            turns[cycle] = [asdict(r) for r in records]
            if math.isinf(cs.rejoin_s):
                break
            layout, _ = wait_layout(running.url, not_nodes=set())
    line = result_line(cycles)
    report = {"quick": quick, "plan": asdict(p), "head_resources": HEAD_RESOURCES, "worker": asdict(WORKER),
              "cycles": [asdict(c) for c in cycles], "turns": turns, "result": line}
    (out_dir / "multinode.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(cycles, turns, out_dir / "multinode.png")
    print(f"[multinode] wrote {out_dir / 'multinode.json'} and {out_dir / 'multinode.png'}")
    print(line)
    return report


def _plot(cycles: list[CycleStats], turns: dict[int, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(cycles)), figsize=(5 * max(1, len(cycles)), 3.5), squeeze=False)
    for ax, cs in zip(axes[0], cycles, strict=False):
        rows = turns.get(cs.cycle, [])
        for ok, colour, label in ((True, "tab:blue", "ok"), (False, "tab:red", "failed")):
            sel = [r for r in rows if r["ok"] == ok]
            ax.plot([r["ended"] for r in sel], [r["ended"] - r["started"] for r in sel], "o", color=colour, markersize=3, label=label)
        ax.axvline(cs.killed_at, color="black", linestyle="--", linewidth=1, label="worker raylet killed")
        ax.set_title(f"cycle {cs.cycle}: {cs.lost} lost, recovery {cs.recovery_s:.1f} s")
        ax.set_xlabel("turn end (s)")
        ax.set_ylabel("turn time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
