"""Safe by default off loopback (deployments/exposure.py): a config served on a non-loopback host
without API keys refuses to start, unless it says ingress.allow_unauthenticated; the decision is a
pure function of Serve's HTTP host and the app config, and build_app applies it before any work."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.config import HTTPOptions

from deployments import app as app_module
from deployments import exposure
from deployments.config import ConfigError, load_app_config
from deployments.exposure import bind_refusal, is_loopback, serve_http_host

CLUSTER_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "cluster_configs").glob("*.yaml"))
BASE = {"decode": {"engine": {"model": "m"}}, "routing": {"policy": "colocated"}}


def cfg(**ingress: Any) -> Any:
    return load_app_config({**BASE, "ingress": ingress})


def test_loopback_hosts() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST", "::ffff:127.0.0.1", " 127.0.0.1 "):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "128.0.0.1", "::ffff:10.0.0.1", "", "myhost", "localhost.evil.com"):
        assert not is_loopback(host), host


def test_off_loopback_without_keys_is_refused_with_the_fields_to_set() -> None:
    e = bind_refusal("0.0.0.0", cfg())
    assert isinstance(e, ConfigError)
    for field in ("http_options.host", "'0.0.0.0'", "ingress.api_keys_env", "ingress.allow_unauthenticated"):
        assert field in str(e), field
    assert bind_refusal("10.0.0.5", cfg()) is not None


def test_keys_loopback_an_explicit_opt_out_or_no_http_allow_the_start() -> None:
    assert bind_refusal("0.0.0.0", cfg(api_keys_env="BATON_API_KEYS")) is None
    assert bind_refusal("0.0.0.0", cfg(allow_unauthenticated=True)) is None
    assert bind_refusal("127.0.0.1", cfg()) is None and bind_refusal("localhost", cfg()) is None
    assert bind_refusal(None, cfg()) is None  # Serve starts no HTTP proxy
    with pytest.raises(ConfigError, match="ingress.allow_unauthenticated"):
        cfg(allow_unauthenticated="sure")


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_starts_and_gpu_ones_use_keys(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    host = doc.get("http_options", {}).get("host", HTTPOptions().host)
    for app in doc["applications"]:
        c = load_app_config(app["args"])
        grpc_on = bool(doc.get("grpc_options", {}).get("grpc_servicer_functions"))
        assert bind_refusal(host, c, grpc_on) is None
        if path.name.startswith("gpu_"):
            assert c.ingress.api_keys_env is not None and not c.ingress.allow_unauthenticated
            # the same config without keys on its 0.0.0.0 is the refused start
            no_keys = {**app["args"], "ingress": {k: v for k, v in app["args"]["ingress"].items() if k != "api_keys_env"}}
            assert bind_refusal(host, load_app_config(no_keys)) is not None


def test_build_app_refuses_before_any_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(app_module, "serve_http_host", lambda: "0.0.0.0")
    args = {**BASE, "model_cache": str(tmp_path / "nothing-here")}
    with pytest.raises(ConfigError, match="refusing to start"):
        app_module.build_app(args)
    # with keys it passes the check and goes on (to the missing model, here)
    with pytest.raises(ConfigError, match="decode.engine.model"):
        app_module.build_app({**args, "ingress": {"api_keys_env": "BATON_API_KEYS"}})


class _Remote:
    def __init__(self, value: Any):
        self.value = value

    def remote(self) -> Any:
        return self.value


def test_the_host_comes_from_the_running_serve_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str]] = []

    class Controller:
        get_http_config = _Remote("ref")

    def get_actor(name: str, namespace: str) -> Controller:
        asked.append((name, namespace))
        return Controller()

    monkeypatch.setattr(exposure.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(exposure.ray, "get_actor", get_actor)
    monkeypatch.setattr(exposure.ray, "get", lambda ref, timeout: HTTPOptions(host="0.0.0.0") if ref == "ref" else None)
    assert serve_http_host() == "0.0.0.0"
    assert asked == [(exposure.SERVE_CONTROLLER_NAME, exposure.SERVE_NAMESPACE)]

    def no_answer(ref: Any, timeout: float) -> Any:
        raise TimeoutError("slow")

    monkeypatch.setattr(exposure.ray, "get", no_answer)
    with pytest.raises(ConfigError, match="cannot learn http_options.host"):
        serve_http_host()  # fails closed


def test_without_a_controller_serve_will_start_with_its_default_host(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve_http_host() == HTTPOptions().host  # Ray not connected (these tests)

    def no_actor(name: str, namespace: str) -> Any:
        raise ValueError("no such actor")

    monkeypatch.setattr(exposure.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(exposure.ray, "get_actor", no_actor)
    assert serve_http_host() == HTTPOptions().host


def test_a_grpc_proxy_counts_as_off_loopback() -> None:
    """Serve binds its gRPC proxy on [::]: with gRPC on, a loopback HTTP host is no excuse."""
    e = bind_refusal("127.0.0.1", cfg(), grpc_enabled=True)
    assert e is not None and "gRPC" in str(e) and "ingress.api_keys_env" in str(e)
    assert bind_refusal("127.0.0.1", cfg(api_keys_env="BATON_API_KEYS"), grpc_enabled=True) is None
    assert bind_refusal(None, cfg(allow_unauthenticated=True), grpc_enabled=True) is None
    assert exposure.serve_grpc_enabled() is False  # Ray not connected: Serve would start without gRPC
