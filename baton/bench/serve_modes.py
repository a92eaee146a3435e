"""The Ray Serve modes the benches run Baton under, as the environment a local cluster is started
with (`ray start` and `serve run`, baton/bench/cluster.LocalServeApp's env): Serve's defaults (no
extra environment), direct ingress, and the throughput-optimized mode with direct ingress.

direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1, experimental in Ray 2.60): the ingress replica
serves HTTP itself on a port of its own (the proxy's + 1 here; the proxy keeps its port), so a
request skips the proxy's hop to the replica, the replica's call back to the proxy for the body,
and the stream's way back through the proxy.

throughput-optimized (RAY_SERVE_THROUGHPUT_OPTIMIZED=1, Ray 2.60): handle calls between
deployments and from the proxy go over gRPC instead of Ray actor calls, user code and the handle's
router run on the replica's own event loop, access logs are buffered, and direct ingress is on.
A replica that dies under a gRPC handle call surfaces as ActorUnavailableError, a RayActorError,
so deployments/backend.translate_error treats it as before (ReplicaLost)."""
from __future__ import annotations

THROUGHPUT_OPTIMIZED_ENV: dict[str, str] = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def direct_ingress_port(http_port: int) -> int:
    """The ingress replica's own HTTP port under direct ingress (one ingress replica)."""
    return http_port + 1


def direct_ingress_env(http_port: int) -> dict[str, str]:
    """Ray Serve's direct ingress, the ingress replica on http_port + 1 (the proxy keeps http_port),
    drained in 1 s instead of Ray's 30 s floor (a bench, not a rolling update)."""
    port = direct_ingress_port(http_port)
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 20), "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def throughput_optimized_env(http_port: int) -> dict[str, str]:
    """The throughput-optimized mode with direct ingress on http_port + 1."""
    return {**THROUGHPUT_OPTIMIZED_ENV, **direct_ingress_env(http_port)}
