"""baton/bench/serve_modes.py: the environment each Ray Serve mode starts a local cluster with,
checked against the Ray Serve the project installs (its constants read the same variables)."""
from __future__ import annotations

import importlib
import sys

import pytest

from baton.bench.serve_modes import THROUGHPUT_OPTIMIZED_ENV, direct_ingress_env, direct_ingress_port, throughput_optimized_env


def test_direct_ingress_puts_the_ingress_replica_on_the_next_port() -> None:
    env = direct_ingress_env(28000)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == str(direct_ingress_port(28000)) == "28001"
    assert int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) > direct_ingress_port(28000)


def test_the_throughput_optimized_mode_includes_direct_ingress() -> None:
    env = throughput_optimized_env(28000)
    assert env == {**THROUGHPUT_OPTIMIZED_ENV, **direct_ingress_env(28000)} and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


def test_the_installed_ray_serve_reads_these_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's constants module, re-imported under the mode's environment, turns on what the mode
    promises (gRPC handle calls, one event loop, direct ingress on the given port); a Ray upgrade
    that renames a variable fails here, not silently in a bench."""
    name = "ray.serve._private.constants"
    saved = importlib.import_module(name)  # Serve's packages imported under this process's own environment first
    try:
        for k, v in throughput_optimized_env(28000).items():
            monkeypatch.setenv(k, v)
        sys.modules.pop(name, None)
        c = importlib.import_module(name)
        assert c.RAY_SERVE_THROUGHPUT_OPTIMIZED and c.RAY_SERVE_USE_GRPC_BY_DEFAULT and c.RAY_SERVE_ENABLE_DIRECT_INGRESS
        assert not c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD and not c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
        assert c.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT == 28001
    finally:
        sys.modules[name] = saved  # every later import sees the constants as they were
