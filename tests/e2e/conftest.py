"""End-to-end fixtures: a local Ray cluster + Serve + real vLLM engines on SmolLM2 (this CPU).

One application per test module (starting it costs 1-2 min), except in the folders pd_app/ and
colocated_app/: their modules test different things on one layout, and share one application,
started once per folder (`shared_app`, pytest's package scope). The pools use the same builder as
`serve run cluster_configs/local.yaml`, with the local YAML's args adjusted for 2 cores."""
from __future__ import annotations

import copy
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

# grpcio (the gRPC tests' client, in this process) installs fork handlers by default; Ray then
# forks its head processes (ray.init per module) from this process, and a fork while grpcio's
# threads are busy skips them ("Other threads are currently calling into gRPC, skipping fork()
# handlers"): run 5 of the 2026-12-01 fresh-clone series lost its raylet and its dashboard
# (SIGABRT) that way, and the next module's ray.init timed out. Every child here execs at once,
# so nothing needs grpcio's fork support; it is read when grpcio is first imported (after this).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def local_args() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "cluster_configs" / "local.yaml").read_text())
    return copy.deepcopy(doc["applications"][0]["args"])


def e2e_args(policy: str = "conversation", decode_replicas: int = 2, prefill_replicas: int = 1, ingress_replicas: int = 2) -> dict[str, Any]:
    """The local YAML's args, sized for tests: small KV pools, 0.5 CPU per engine, and a fresh
    durable state per app (conversation owners and memories in a new temporary folder: a rerun in
    the same checkout must not find an earlier run's session ids owned, or its facts)."""
    args = local_args()
    state = Path(tempfile.mkdtemp(prefix="baton-e2e-"))
    args["routing"] = {**args.get("routing", {}), "policy": policy, "ownership_db_path": str(state / "conversations.sqlite3")}
    args["memory"] = {**args.get("memory", {}), "db_path": str(state / "memories.sqlite3")}
    args["ingress"] = {**args["ingress"], "num_replicas": ingress_replicas}
    engine = {**args["decode"]["engine"], "max_model_len": 4096, "kv_cache_gib": 0.5}
    args["decode"] = {**args["decode"], "num_replicas": decode_replicas, "resources": {"num_cpus": 0.5, "custom": {"decode_slot": 1}}, "engine": engine}
    if prefill_replicas:
        args["prefill"] = {"num_replicas": prefill_replicas, "resources": {"num_cpus": 0.5, "custom": {"prefill_slot": 1}}, "engine": engine}
    else:
        args.pop("prefill", None)
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GRPC_SERVICER = "deployments.grpc_gen.baton_pb2_grpc.add_BatonServicer_to_server"


def start_app(args: dict[str, Any], grpc_port: int | None = None) -> str:
    """grpc_port: also start Serve's gRPC proxy there with Baton's servicer (as local.yaml's grpc_options)."""
    import ray
    from ray import serve

    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"model not provisioned at {MODEL_DIR}: run `make setup` (scripts/setup.sh)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # address="local": always a Ray of the test's own, never a cluster someone started on this
    # machine (`make demo`, a bench, `ray start`): attaching to one would fail on num_cpus, or
    # share its resources and state
    ray.init(address="local", num_cpus=2, resources={"prefill_slot": 2, "decode_slot": 4}, include_dashboard=False, log_to_driver=False)
    port = free_port()
    grpc = {"grpc_options": {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]}} if grpc_port else {}
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **grpc)
    return deploy(args, f"http://127.0.0.1:{port}")


def deploy(args: dict[str, Any], url: str) -> str:
    """(Re)deploy the application with these args and wait until /health says ok."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(args), name="baton", route_prefix="/")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=10).json().get("status") == "ok":
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("application did not become healthy")


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def remote_and_local_greedy(url: str, ids: list[int], request_id: str, headers: dict[str, str] | None = None,
                            max_tokens: int = 24) -> tuple[str, list[Any], int]:
    """`ids` decoded greedily twice: over HTTP (placed by the app: a remote first-turn prefill under
    a P/D policy) and straight to the decode pool's handle (prefilled on the decoder itself).
    Returns the HTTP text, the decoder's deltas, and the NIXL transfers the HTTP request settled."""
    from ray import serve

    from baton.bench.cluster import settled_transfers
    from baton.engine.types import GenerationRequest, SamplingSpec

    before = settled_transfers(url)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                   headers=headers or {}, timeout=300)
    assert r.status_code == 200, r.text
    transfers = settled_transfers(url) - before
    req = GenerationRequest(request_id=request_id, prompt_token_ids=tuple(ids),
                            sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    deltas = list(serve.get_deployment_handle("decode", "baton").options(stream=True).generate.remote(req))
    return r.json()["choices"][0]["text"], deltas, transfers


@dataclass(frozen=True)
class SharedApp:
    """The application a folder's modules share; each test uses its own session ids and users, and
    counts what it checks as a difference (before/after), so the order of its modules does not
    matter. Tests that disrupt it (kill a replica) carry `pytest.mark.disrupts_app` and run after the
    folder's other tests; one that leaves it changed (redeployed smaller) `disrupts_app(last=True)`."""

    url: str
    args: dict[str, Any]  # what was deployed


def run_shared_app(args: dict[str, Any]) -> Iterator[SharedApp]:
    """The body of a folder's package-scoped `shared_app` fixture."""
    url = start_app(args)
    try:
        yield SharedApp(url, args)
    finally:
        stop_app()


@contextmanager
def keyed_app(args: dict[str, Any], keys_env: str, keys: str, ownership_db: Path, grpc_port: int | None = None) -> Iterator[str]:
    """An app with API keys on (`keys` in the variable `keys_env`, set before `ray.init` so Ray's
    processes inherit it) and a fresh ownership store (earlier runs' session ids own nothing)."""
    args = {**args, "ingress": {**args["ingress"], "api_keys_env": keys_env},
            "routing": {**args.get("routing", {}), "ownership_db_path": str(ownership_db)}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(keys_env, keys)
        try:
            url = start_app(args, grpc_port)
        except BaseException:
            import ray

            if ray.is_initialized():
                stop_app()  # later modules start their own Ray
            raise
        try:
            yield url
        finally:
            stop_app()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e starts real engines: its module must say so (`pytestmark`
    with `pytest.mark.e2e`), so `-m "not e2e"` selects exactly the fast suite."""
    here = Path(__file__).resolve().parent
    unmarked = sorted({str(i.path.relative_to(here)) for i in items
                       if i.path.resolve().is_relative_to(here) and i.get_closest_marker("e2e") is None})
    if unmarked:
        raise pytest.UsageError(f"e2e modules without pytest.mark.e2e: {unmarked}")
    # in a folder that shares one application, the tests that disrupt it run after the others, and
    # those that leave it changed (`disrupts_app(last=True)`) after those (order kept otherwise)
    def rank(item: pytest.Item) -> int:
        mark = item.get_closest_marker("disrupts_app")
        return 0 if mark is None else 2 if mark.kwargs.get("last") else 1

    for folder in {i.path.resolve().parent for i in items if i.path.resolve().parent.parent == here}:
        slots = [n for n, i in enumerate(items) if i.path.resolve().parent == folder]
        for n, i in zip(slots, sorted((items[n] for n in slots), key=rank), strict=True):
            items[n] = i
