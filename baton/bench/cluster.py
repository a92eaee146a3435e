"""A local Ray cluster running a Baton application through `serve run`, as a user starts it.

Used by benchmarks so they measure the real path (Ray CLI, Serve config file, HTTP proxy)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from baton.bench.ray_nodes import WorkerNode, start_worker
from baton.bench.ray_session import stop_ray_session
from baton.paths import REPO_ROOT

ROOT = REPO_ROOT
T = TypeVar("T")


@dataclass(frozen=True)
class RunningApp:
    url: str
    start_seconds: float  # `serve run` launched -> /health ok
    log_path: Path


def replica_pids(deployment: str, app: str = "baton") -> list[int]:
    """Pids of the live replica processes of a deployment (local node only)."""
    marker = f"ray::ServeReplica:{app}:{deployment}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(marker):
                out.append(int(pid))
        except OSError:
            continue
    return out


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds consumed so far by these processes (their threads included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / tick


def replica_rss_bytes(deployment: str, app: str = "baton") -> list[int]:
    """RSS of each live replica process of a deployment (read from /proc, local node only)."""
    out = []
    for pid in replica_pids(deployment, app):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out.append(int(line.split()[1]) * 1024)
        except OSError:
            continue
    return out


def decode_transfers(url: str) -> int:
    """KV transfers the live decode replicas' connectors counted, as they last reported them (/baton/stats)."""
    snap = httpx.get(f"{url}/baton/stats", timeout=10).json()
    return sum(int(r.get("kv_transfers_received", 0)) for r in snap["replicas"].values() if r["pool"] == "decode" and r["live"])


def settled(read: Callable[[], T], tries: int = 20, pause_s: float = 1.5) -> T:
    """read() once two consecutive reads agree (replicas report every second), or the last read."""
    last: T | None = None
    for _ in range(tries):
        time.sleep(pause_s)
        now = read()
        if now == last:
            return now
        last = now
    assert last is not None
    return last


def settled_transfers(url: str) -> int:
    """decode_transfers once two consecutive reports agree (replicas report every second)."""
    return settled(lambda: decode_transfers(url))


class LocalServeApp:
    """Context manager: `ray start` a head with the given resources, `serve run` a config whose
    application args are `args`, wait for /health, and tear everything down on exit."""

    def __init__(self, args: dict[str, Any], *, resources: dict[str, float], num_cpus: int = 2, http_port: int = 28000, ray_port: int = 26390,
                 log_dir: Path | None = None, start_timeout_s: float = 600,
                 env: dict[str, str] | None = None, metrics_export_port: int | None = None,
                 grpc_options: dict[str, Any] | None = None, workers: tuple[WorkerNode, ...] = ()):
        """env: extra variables for `ray start` and `serve run` (e.g. the API keys named by
        ingress.api_keys_env); metrics_export_port: Ray's Prometheus export port (None: Ray's default);
        grpc_options: the Serve config's `grpc_options` (None: no gRPC proxy); workers: worker nodes
        joined to the head before `serve run` (a multi-node cluster on this machine, ray_nodes.py)."""
        self._grpc = grpc_options
        self._workers = workers
        self._args, self._resources, self._num_cpus = args, resources, num_cpus
        self._http_port, self._ray_port, self._timeout = http_port, ray_port, start_timeout_s
        # absolute: `serve run` runs in the checkout, not in the caller's working directory
        self._log_dir = (log_dir or Path(tempfile.mkdtemp(prefix="baton-serve-"))).resolve()
        self._serve: subprocess.Popen | None = None
        self._ray_temp: str | None = None  # this head's --temp-dir (set by _launch)
        self._launched_at = 0.0  # when `serve run` was launched (monotonic)
        self._metrics_port = metrics_export_port
        self._env = {**os.environ, **(env or {}), "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": f"127.0.0.1:{ray_port}",
                     "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}

    @property
    def ray_port(self) -> int:
        return self._ray_port

    @property
    def http_port(self) -> int:
        return self._http_port

    @property
    def env(self) -> dict[str, str]:
        return dict(self._env)

    def start_worker(self, node: WorkerNode) -> None:
        """Join a worker node to this head (also a node that failed and comes back)."""
        assert self._ray_temp is not None, "the head is not started"
        start_worker(node, "ray", f"127.0.0.1:{self._ray_port}", self._ray_temp, self._env)

    def _launch(self, http_host: str) -> subprocess.Popen:
        """Write the Serve config (its HTTP proxies bind http_host), `ray start` a fresh head and
        `serve run` the config; returns the `serve run` process."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": http_host, "port": self._http_port},
            **({"grpc_options": self._grpc} if self._grpc else {}),
            "applications": [{"name": "baton", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": self._args}],
        }
        cfg_path = self._log_dir / "serve_config.yaml"
        cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
        # a temp dir of its own: this head's processes are told apart from any other Ray on the
        # machine (an e2e run, another bench), so stopping it never stops theirs (ray_session.py)
        self._ray_temp = tempfile.mkdtemp(prefix="bray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        started = subprocess.run(
            ["ray", "start", "--head", f"--port={self._ray_port}", f"--num-cpus={self._num_cpus}", f"--resources={json.dumps(self._resources)}",
             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self._ray_temp}"]
            + ([f"--metrics-export-port={self._metrics_port}"] if self._metrics_port else []),
            env=self._env, capture_output=True, text=True, check=False,
        )
        if started.returncode != 0:
            stop_ray_session(self._ray_temp)
            tail = (started.stderr or started.stdout or "").strip().splitlines()[-5:]
            raise RuntimeError(f"`ray start` on port {self._ray_port} failed (another Ray on that port?): " + " | ".join(tail))
        for node in self._workers:
            try:
                self.start_worker(node)
            except RuntimeError:
                stop_ray_session(self._ray_temp)
                raise
        log = (self._log_dir / "serve.log").open("w")
        self._launched_at = time.monotonic()
        self._serve = subprocess.Popen(["serve", "run", str(cfg_path)], env=self._env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self._serve

    def __enter__(self) -> RunningApp:
        """Start the app and wait until /health is ok. Fails before launching on a config the
        builder would refuse (its ConfigError), and as soon as Serve logs that the deploy failed,
        instead of waiting out the start timeout."""
        from deployments.config import load_app_config

        load_app_config(self._args)
        self._launch("127.0.0.1")
        assert self._serve is not None
        t0 = self._launched_at
        url = f"http://127.0.0.1:{self._http_port}"
        while time.monotonic() - t0 < self._timeout:
            if self._serve.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"serve run exited early; see {self._log_dir / 'serve.log'}")
            failed = deploy_failure(self._log_dir / "serve.log")
            if failed is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the application failed to deploy: {failed}; see {self._log_dir / 'serve.log'}")
            try:
                if httpx.get(f"{url}/health", timeout=10).json().get("status") == "ok":
                    return RunningApp(url=url, start_seconds=time.monotonic() - t0, log_path=self._log_dir / "serve.log")
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"application not healthy within {self._timeout:.0f}s; see {self._log_dir / 'serve.log'}")

    def __exit__(self, *exc: Any) -> None:
        if self._serve is not None and self._serve.poll() is None:
            self._serve.send_signal(signal.SIGINT)
            try:
                self._serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._serve.kill()
        if self._ray_temp is not None:
            stop_ray_session(self._ray_temp)


_DEPLOY_FAILED = "Deploying app 'baton' failed"


def deploy_failure(log_path: Path) -> str | None:
    """The first error line after Serve's "Deploying app 'baton' failed" in a `serve run` log
    (the builder's exception), or None while the log has no such line."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for i, line in enumerate(lines):
        if _DEPLOY_FAILED in line:
            after = [_plain(ln) for ln in lines[i + 1:]]
            last = max((j for j, ln in enumerate(after) if "Error" in ln), default=None)
            return line.strip() if last is None else " ".join(after[last:last + 2]).strip()
    return None


def _plain(line: str) -> str:
    """A log line without ANSI colours and the `(Actor pid=…)` prefix Ray puts on actor output."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    return re.sub(r"^\(\w+ pid=\d+\)\s*", "", line).strip()


# polls the application's status from a separate driver (the dashboard is off, so no `serve status`)
_STATUS_SCRIPT = """
import json, sys, time
import ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
end, last = time.monotonic() + float(sys.argv[2]), {}
while time.monotonic() < end:
    try:
        apps = serve.status().applications
    except Exception as e:  # noqa: BLE001 - Serve still starting
        apps, last = {}, {"error": type(e).__name__}
    if "baton" in apps:
        a = apps["baton"]
        last = {"status": str(getattr(a.status, "value", a.status)), "message": a.message or ""}
        if last["status"] in ("DEPLOY_FAILED", "RUNNING", "UNHEALTHY"):
            break
    time.sleep(2)
last["replicas"] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::baton#")]
print("STATUS " + json.dumps(last))
"""


@dataclass(frozen=True)
class StartAttempt:
    """A `serve run` of a config that should not start: what Serve said, and what answered."""

    status: str | None  # the application's status (DEPLOY_FAILED, RUNNING, ...; None: never reported)
    message: str  # Serve's message for it (the builder's error)
    replicas: list[str]  # the application's replica actors that exist
    answers: dict[str, int | str]  # path -> HTTP status on the port (or the connection error)
    seconds: float


def attempt_start(app: LocalServeApp, http_host: str, wait_s: float = 150.0) -> StartAttempt:
    """`ray start` + `serve run` of `app`'s config with Serve's HTTP proxies on http_host (instead
    of `with app:`, which expects a healthy start); wait until the application fails to deploy,
    runs, or wait_s passes; probe the port; tear everything down."""
    t0 = time.monotonic()
    try:
        app._launch(http_host)
        p = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", _STATUS_SCRIPT, f"127.0.0.1:{app.ray_port}", str(wait_s)],
                           env=app.env, cwd=ROOT, capture_output=True, text=True, timeout=wait_s + 120, check=False)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("STATUS ")), None)
        got = json.loads(line[7:]) if line else {"message": (p.stderr or p.stdout)[-500:]}
        answers: dict[str, int | str] = {}
        for path in ("/health", "/v1/models"):
            try:
                answers[path] = httpx.get(f"http://127.0.0.1:{app.http_port}{path}", timeout=10).status_code
            except httpx.HTTPError as e:
                answers[path] = type(e).__name__
        return StartAttempt(got.get("status"), str(got.get("message", "")), list(got.get("replicas", [])), answers, time.monotonic() - t0)
    finally:
        app.__exit__(None, None, None)
