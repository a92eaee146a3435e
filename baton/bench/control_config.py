"""What the control-plane bench (baton/bench/control.py) runs: its sweep, the variants it compares
at each fleet size (the ingress pin cache off and on, and on under Ray Serve's throughput-optimized
mode) and the order it runs them in, and the Baton
config of one (size, variant), built from cluster_configs/local_simulated.yaml's application args."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from baton.bench.serve_modes import THROUGHPUT_OPTIMIZED_ENV, direct_ingress_env, direct_ingress_port
from baton.paths import REPO_ROOT

CONFIG = REPO_ROOT / "cluster_configs" / "local_simulated.yaml"
SLOT = "control_slot"  # the custom Ray resource one decode replica takes (the cluster has one per replica)
REPLICA_CPUS = 0.01  # Ray CPUs one replica reserves: 128 of them fit a 2-CPU head
# The simulated engine sleeps AIConfigurator's predicted step time × time_scale
# (baton/engine/simulated/engine.py). A 2-token reply to a short chat on Llama-3.1-8B / H200 is
# about 11 ms of predicted GPU time (a 64-token prefill step ~6 ms, a decode step ~5 ms); × 0.01
# it is ~0.1 ms, small next to the control plane's milliseconds, so the bench measures Baton,
# not the stand-in GPU.
TIME_SCALE = 0.01
MAX_TOKENS = 2


@dataclass(frozen=True)
class Sweep:
    replicas: tuple[int, ...]  # fleet sizes, smallest first (the first one measures per-replica memory)
    concurrencies: tuple[int, ...]  # closed-loop clients per point, ascending
    duration_s: float  # measured window per point
    warmup_s: float  # before each window, not reported


def sweep(quick: bool) -> Sweep:
    if quick:
        return Sweep(replicas=(8, 32), concurrencies=(8, 32), duration_s=20.0, warmup_s=3.0)
    return Sweep(replicas=(8, 32, 64, 128), concurrencies=(8, 32, 128), duration_s=45.0, warmup_s=5.0)


@dataclass(frozen=True)
class Variant:
    """One configuration compared at every fleet size: routing.pin_cache_sync_s (0: every turn
    asks the conversation directory; > 0: each ingress caches the pins it was given and syncs
    with the directory this often, router/pin_cache.py) and the Ray Serve mode the cluster runs
    under (serve_env: extra environment for `ray start` and `serve run`; direct_ingress: the load
    goes to the ingress replica's own port instead of the HTTP proxy's); directory_shards: the
    conversation directory's shards (routing.directory_shards, router/directory_shards.py);
    report_relay_period_s: with shards, how often a shard relays the reports it got to the others
    (routing.report_relay_period_s, router/report_relay.py; 0: every replica reports to every shard)."""

    name: str
    pin_cache_sync_s: float
    serve_env: tuple[tuple[str, str], ...] = ()
    direct_ingress: bool = False
    directory_shards: int = 1
    report_relay_period_s: float = 0.0

    def env(self, http_port: int) -> dict[str, str]:
        """The cluster's extra environment for this variant, the direct-ingress ports included."""
        return {**dict(self.serve_env), **(direct_ingress_env(http_port) if self.direct_ingress else {})}

    def load_port(self, http_port: int) -> int:
        """Where the load generator sends its requests: the proxy, or the ingress replica's port."""
        return direct_ingress_port(http_port) if self.direct_ingress else http_port


NO_PIN_CACHE = Variant("no_pin_cache", 0.0)
PIN_CACHE = Variant("pin_cache", 0.5)  # the config's default (routing.pin_cache_sync_s)
# Ray Serve's throughput-optimized mode, direct ingress included (baton/bench/serve_modes.py)
THROUGHPUT_OPTIMIZED = Variant("throughput_optimized", 0.5, tuple(THROUGHPUT_OPTIMIZED_ENV.items()), direct_ingress=True)
VARIANTS = (NO_PIN_CACHE, PIN_CACHE, THROUGHPUT_OPTIMIZED)  # what a run without --variants compares
# on request (--variants): the throughput-optimized mode with the directory in two shards, each
# owning half the conversations, both hearing every report (router/directory_shards.py): sent by
# each replica to both (the config's default), or relayed by each replica's home shard
SHARDED_DIRECTORY = Variant("sharded_directory", 0.5, tuple(THROUGHPUT_OPTIMIZED_ENV.items()), direct_ingress=True, directory_shards=2)
SHARDED_RELAY = Variant("sharded_relay", 0.5, tuple(THROUGHPUT_OPTIMIZED_ENV.items()), direct_ingress=True, directory_shards=2,
                        report_relay_period_s=0.5)
ALL_VARIANTS = (*VARIANTS, SHARDED_DIRECTORY, SHARDED_RELAY)


def pick_variants(names: str | None) -> tuple[Variant, ...]:
    """The variants named (comma-separated, in ALL_VARIANTS' order); None: VARIANTS."""
    if names is None:
        return VARIANTS
    asked = {n.strip() for n in names.split(",") if n.strip()}
    unknown = asked - {v.name for v in ALL_VARIANTS}
    if unknown or not asked:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {', '.join(v.name for v in ALL_VARIANTS)}")
    return tuple(v for v in ALL_VARIANTS if v.name in asked)


def variant_order(size_index: int, variants: tuple[Variant, ...] = VARIANTS) -> tuple[Variant, ...]:
    """The order the variants run in at the size_index-th fleet size (0-based): as given at even
    indexes, reversed at odd ones (8: off, on, throughput-optimized; 32: the other way round; …),
    so no variant always runs first or last on a machine that warms up or fills up over the run."""
    if size_index < 0:
        raise ValueError("size_index >= 0")
    return variants if size_index % 2 == 0 else variants[::-1]


def app_args(replicas: int, state_dir: Path, *, max_concurrency: int, pin_cache_sync_s: float,
             time_scale: float = TIME_SCALE, directory_shards: int = 1, report_relay_period_s: float = 0.0) -> dict[str, Any]:
    """local_simulated.yaml's args with `replicas` decode replicas on the colocated policy and the
    ingress pin cache syncing every pin_cache_sync_s (0: off).

    colocated: whole requests on the decode pool, each conversation pinned to the replica the
    directory placed its first turn on; the prefill pool is off (0 replicas), so no turn waits
    on one prefill replica's queue and every turn is one directory decision. Each replica
    reserves REPLICA_CPUS and one SLOT; the ownership database lives in `state_dir` (fresh per
    run); the ingress's admission cap sits above the sweep's largest concurrency, so the closed
    loop is never refused by the bound itself (admission still runs and counts every request)."""
    if replicas < 1 or max_concurrency < 1:
        raise ValueError("replicas >= 1 and max_concurrency >= 1")
    doc = yaml.safe_load(CONFIG.read_text())
    args = copy.deepcopy(doc["applications"][0]["args"])
    args["ingress"] = {**args["ingress"], "default_max_tokens": MAX_TOKENS,
                       "max_inflight_requests": 2 * max_concurrency, "max_ongoing_requests": 4 * max_concurrency}
    args["routing"] = {**args["routing"], "policy": "colocated", "ownership_db_path": str(state_dir / "conversations.sqlite3"),
                       "pin_cache_sync_s": pin_cache_sync_s, "directory_shards": directory_shards,
                       "report_relay_period_s": report_relay_period_s}
    args["prefill"] = {**args["prefill"], "num_replicas": 0}
    decode = args["decode"]
    engine = {**decode["engine"], "simulated": {**decode["engine"]["simulated"], "time_scale": time_scale}}
    args["decode"] = {**decode, "num_replicas": replicas, "engine": engine,
                      "resources": {"num_cpus": REPLICA_CPUS, "custom": {SLOT: 1}}}
    return args


def served_model(args: dict[str, Any]) -> str:
    return str(args["ingress"]["served_model_name"])


def start_timeout_s(replicas: int) -> float:
    """How long `serve run` may take to bring `replicas` replicas up on this machine's 2 cores
    (each one a fresh Ray worker process that imports the stack)."""
    return 300.0 + 10.0 * replicas
