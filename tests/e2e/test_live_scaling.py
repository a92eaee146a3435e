"""Scaling an engine pool on a live cluster through config (README "Scaling a live cluster"), with
the application deployed declaratively, as `serve deploy` and `serve run <config>` do it (the
Serve controller's deploy_apps). Simulated engines (engine.kind simulated: they start in seconds
and keep a prefix cache as vLLM's does), colocated policy, one ingress.

* decode 1 -> 2 through the Serve config's `deployments:` override, the application's `args`
  untouched: a lightweight update. The engine that holds a conversation is not restarted: its next
  turn is served by the same replica with its previous prompt cached, and new conversations are
  placed on the new replica as well.
* decode 2 -> 1 the same way: every conversation gets its next turn, those whose replica was
  removed re-placed on the other (0 failed turns).
* the replica count written into `args` instead: Serve hashes an application's args into every
  deployment's version, so every replica is replaced (engines, directory, ingress). The
  conversation's next turn still succeeds, on a new replica with nothing cached.
"""
from __future__ import annotations

import copy
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.conftest import MODEL_DIR, ROOT, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

DEPLOY_WAIT_S = 180.0
WORDS = ("atlas", "ledger", "harbour", "quartz", "meadow", "lantern", "copper", "violet", "summit", "orchard", "falcon", "cipher")


def _args() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "cluster_configs" / "local_simulated.yaml").read_text())
    args = copy.deepcopy(doc["applications"][0]["args"])
    state = Path(tempfile.mkdtemp(prefix="baton-e2e-scaling-"))
    args["routing"] = {"policy": "colocated", "ownership_db_path": str(state / "conversations.sqlite3")}
    args["prefill"] = {**args["prefill"], "num_replicas": 0}
    args["decode"] = {**args["decode"], "num_replicas": 1}
    return args


class Cluster:
    """An in-process Ray + Serve whose application is (re)deployed from a Serve config."""

    def __init__(self, url: str):
        self.url = url

    def deploy(self, args: dict[str, Any], overrides: list[dict[str, Any]] | None = None) -> None:
        """Apply a config (as `serve deploy` does) and wait until the application runs with the
        decode replica count it asks for."""
        from ray import serve
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        app: dict[str, Any] = {"name": "baton", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": args}
        if overrides:
            app["deployments"] = overrides
        want = next((o["num_replicas"] for o in overrides or () if o["name"] == "decode"), args["decode"]["num_replicas"])
        _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]), _blocking=False)
        deadline = time.monotonic() + DEPLOY_WAIT_S
        while time.monotonic() < deadline:
            st = serve.status().applications.get("baton")
            if st is not None and st.status == "RUNNING" and st.deployments["decode"].replica_states == {"RUNNING": want}:
                if httpx.get(f"{self.url}/health", timeout=10).json().get("status") == "ok":
                    return
            time.sleep(0.5)
        raise AssertionError(f"the application did not run {want} decode replicas within {DEPLOY_WAIT_S:.0f} s: {serve.status()}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"model not provisioned at {MODEL_DIR}: run `make setup` (scripts/setup.sh)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, resources={"decode_slot": 4}, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield Cluster(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


class Conversation:
    """A conversation of its own words (no prefix shared with another), one turn at a time."""

    def __init__(self, url: str, sid: str):
        self.url, self.sid = url, sid
        self.messages: list[dict[str, str]] = []
        self.rng = random.Random(sid)
        self.replica: str | None = None
        self.prompt_tokens = 0

    def turn(self) -> tuple[int, int]:
        """(status, cached prompt tokens); self.replica: the engine replica that served it."""
        text = " ".join(self.rng.choice(WORDS) + str(self.rng.randrange(1000)) for _ in range(60))
        self.messages.append({"role": "user", "content": f"{self.sid}: {text}"})
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=60, headers={"x-session-id": self.sid, "x-baton-user": "scaler"},
                       json={"model": "SmolLM2-135M-Instruct", "messages": self.messages, "max_tokens": 8})
        if r.status_code != 200:
            return r.status_code, 0
        body = r.json()
        self.messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        self.replica = r.headers["x-baton-replica"]
        self.prompt_tokens = body["usage"]["prompt_tokens"]
        return 200, (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_scale_through_overrides_keeps_engines_and_args_edit_replaces_them(cluster: Cluster) -> None:
    args = _args()
    cluster.deploy(args)
    a = Conversation(cluster.url, "scale-a")
    assert a.turn() == (200, 0)
    first = a.replica
    before = a.prompt_tokens
    status, cached = a.turn()
    assert status == 200 and a.replica == first and cached >= before - 16, (a.replica, cached, before)

    # up: 1 -> 2 decode replicas through the override; the engine holding `a` stays, with its KV
    cluster.deploy(args, [{"name": "decode", "num_replicas": 2}])
    before = a.prompt_tokens
    status, cached = a.turn()
    assert status == 200 and a.replica == first, "a lightweight scale-up restarted the engine a conversation is pinned to"
    assert cached >= before - 16, f"the pinned engine lost its KV over a scale-up: {cached} of {before} prompt tokens cached"
    others: list[Conversation] = []
    deadline = time.monotonic() + 60
    while not any(c.replica != first for c in others):  # the new replica takes new conversations once it has reported
        assert time.monotonic() < deadline, f"no new conversation was placed on the new decode replica: {[c.replica for c in others]}"
        c = Conversation(cluster.url, f"scale-n{len(others)}")
        assert c.turn()[0] == 200
        others.append(c)
        time.sleep(0.2)
    replicas = {first} | {c.replica for c in others}
    assert len(replicas) == 2

    # down: 2 -> 1 the same way; every conversation's next turn is served, whichever replica went
    cluster.deploy(args, [{"name": "decode", "num_replicas": 1}])
    outcomes = [(c.sid, c.turn()[0]) for c in [a, *others]]
    assert all(status == 200 for _, status in outcomes), outcomes
    survivors = {c.replica for c in [a, *others]}
    assert len(survivors) == 1 and survivors <= replicas, survivors

    # the replica count written into args: Serve replaces every replica, nothing is lost but the KV
    edited = copy.deepcopy(args)
    edited["decode"]["num_replicas"] = 2
    cluster.deploy(edited)
    before = a.prompt_tokens
    status, cached = a.turn()
    assert status == 200, "a turn was lost across a redeploy of the whole application"
    assert a.replica not in replicas, "an edit of the application's args kept an old engine replica (Serve's versioning changed?)"
    assert cached < before // 2, f"{cached} of {before} prompt tokens cached on an engine that should have started empty"
