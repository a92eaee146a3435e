"""A local Ray cluster running a Baton application through `serve run`, as a user starts it.

Used by benchmarks so they measure the real path (Ray CLI, Serve config file, HTTP proxy)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from baton.paths import REPO_ROOT

ROOT = REPO_ROOT


@dataclass(frozen=True)
class RunningApp:
    url: str
    start_seconds: float  # `serve run` launched -> /health ok
    log_path: Path


def replica_rss_bytes(deployment: str, app: str = "baton") -> list[int]:
    """RSS of each live replica process of a deployment (read from /proc, local node only)."""
    marker = f"ray::ServeReplica:{app}:{deployment}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(marker):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out.append(int(line.split()[1]) * 1024)
        except OSError:
            continue
    return out


class LocalServeApp:
    """Context manager: `ray start` a head with the given resources, `serve run` a config whose
    application args are `args`, wait for /health, and tear everything down on exit."""

    def __init__(self, args: dict[str, Any], *, resources: dict[str, float], num_cpus: int = 2, http_port: int = 28000, ray_port: int = 26390,
                 log_dir: Path | None = None, start_timeout_s: float = 600,
                 env: dict[str, str] | None = None, metrics_export_port: int | None = None):
        """env: extra variables for `ray start` and `serve run` (e.g. the API keys named by
        ingress.api_keys_env); metrics_export_port: Ray's Prometheus export port (None: Ray's default)."""
        self._args, self._resources, self._num_cpus = args, resources, num_cpus
        self._http_port, self._ray_port, self._timeout = http_port, ray_port, start_timeout_s
        # absolute: `serve run` runs in the checkout, not in the caller's working directory
        self._log_dir = (log_dir or Path(tempfile.mkdtemp(prefix="baton-serve-"))).resolve()
        self._serve: subprocess.Popen | None = None
        self._metrics_port = metrics_export_port
        self._env = {**os.environ, **(env or {}), "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": f"127.0.0.1:{ray_port}",
                     "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}

    def __enter__(self) -> RunningApp:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": self._http_port},
            "applications": [{"name": "baton", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": self._args}],
        }
        cfg_path = self._log_dir / "serve_config.yaml"
        cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
        subprocess.run(["ray", "stop", "--force"], env=self._env, capture_output=True, check=False)
        subprocess.run(
            ["ray", "start", "--head", f"--port={self._ray_port}", f"--num-cpus={self._num_cpus}", f"--resources={json.dumps(self._resources)}",
             "--include-dashboard=false", "--disable-usage-stats"]
            + ([f"--metrics-export-port={self._metrics_port}"] if self._metrics_port else []),
            env=self._env, capture_output=True, check=True,
        )
        log = (self._log_dir / "serve.log").open("w")
        t0 = time.monotonic()
        self._serve = subprocess.Popen(["serve", "run", str(cfg_path)], env=self._env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self._http_port}"
        while time.monotonic() - t0 < self._timeout:
            if self._serve.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"serve run exited early; see {self._log_dir / 'serve.log'}")
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
        subprocess.run(["ray", "stop", "--force"], env=self._env, capture_output=True, check=False)
