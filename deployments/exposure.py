"""Safe by default off loopback: an application whose HTTP port is reachable from other machines
serves only with API keys, unless its config says `ingress.allow_unauthenticated: true`.

`bind_refusal` is the decision, a pure function of the host Serve's HTTP proxies bind and the app
config; `serve_http_host` learns that host; `build_app` calls both and raises the refusal, so a
refused application never deploys.

How the builder learns the host. Serve calls `build_app(args)` where it builds the application:
for a config file (`serve run x.yaml`, `serve deploy x.yaml`) in the controller's build task, after
Serve was started with the file's `http_options`; for `serve.run(build_app(args))` in the driver,
after `serve.start(...)`. Wherever a Serve controller runs, it holds the HTTP options every proxy
binds with (a running Serve keeps them even when a later config asks for others; Serve's own
replicas read them the same way), so it is asked. Where none runs yet (Ray not connected: unit
tests, or `serve run module:build_app`, which builds before it connects), Serve will start with its
defaults, `HTTPOptions().host` (RAY_SERVE_DEFAULT_HTTP_HOST, else loopback; all interfaces under
RAY_SERVE_ENABLE_HA_PROXY). The one case this cannot see: an import-path `serve run` (or a
`serve.start(http_options=...)` issued after `build_app`) against a Serve already listening
elsewhere — deploy with a config file, as every shipped config does.
"""
from __future__ import annotations

import ipaddress
from typing import Any

import ray
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.config import HTTPOptions, gRPCOptions

from deployments.config import AppConfig, ConfigError

CONTROLLER_TIMEOUT_S = 30.0


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (also IPv4-mapped, bracketed or with a scope) and `localhost`. Any other
    name counts as reachable from elsewhere: names are not resolved, so an unknown one fails closed."""
    h = host.strip().strip("[]").lower()
    if h in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def bind_refusal(host: str | None, cfg: AppConfig, grpc_enabled: bool = False) -> ConfigError | None:
    """Why `cfg` may not be served on `host` (None: it may). `host` None: Serve starts no HTTP
    proxy, nothing listens. API keys (ingress.api_keys_env) make any host safe: the ingress then
    refuses to start unless the variable holds valid keys (deployments/api_keys.py).
    grpc_enabled: Serve runs its gRPC proxy, which Serve 2.60 binds on every interface ([::]:port,
    no host option), so it counts as off loopback whatever http_options.host says."""
    ingress = cfg.ingress
    if ingress.api_keys_env is not None or ingress.allow_unauthenticated:
        return None
    if grpc_enabled:
        return ConfigError(
            "refusing to start: Serve's gRPC proxy (grpc_options with grpc_servicer_functions) listens on all interfaces "
            "(Serve binds [::]:port; it has no host option), and ingress.api_keys_env is not set, so anyone who reaches the "
            "port could act as any user. Set ingress.api_keys_env, drop grpc_options, or set "
            "ingress.allow_unauthenticated: true to serve without keys on purpose.")
    if host is None or is_loopback(host):
        return None
    return ConfigError(
        f"refusing to start: Serve's HTTP proxies bind http_options.host={host!r}, which is not loopback, and "
        f"ingress.api_keys_env is not set, so anyone who reaches the port could act as any user. Set "
        f"ingress.api_keys_env to an environment variable holding API keys, bind http_options.host to 127.0.0.1, "
        f"or set ingress.allow_unauthenticated: true to serve without keys on purpose.")


def serve_grpc_enabled() -> bool:
    """Whether the running Serve controller runs gRPC proxies (a port and servicer functions);
    without one, Serve starts with gRPCOptions() (no servicers: no gRPC server). Fails closed."""
    controller = _controller()
    if controller is None:
        return False
    try:
        options: gRPCOptions = ray.get(controller.get_grpc_config.remote(), timeout=CONTROLLER_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - fail closed, with the reason
        raise ConfigError(f"cannot learn grpc_options from the Serve controller ({type(e).__name__}: {e})") from None
    return options.port > 0 and bool(options.grpc_servicer_functions)


def _controller() -> Any:
    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # no Serve on this cluster yet
        return None


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies bind (None: HTTP disabled); see the module docstring."""
    if ray.is_initialized():
        try:
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # no Serve on this cluster yet: it starts with the defaults below
            controller = None
        if controller is not None:
            try:
                options: HTTPOptions = ray.get(controller.get_http_config.remote(), timeout=CONTROLLER_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - fail closed, with the reason
                raise ConfigError(f"cannot learn http_options.host from the Serve controller ({type(e).__name__}: {e})") from None
            return options.host
    return HTTPOptions().host
