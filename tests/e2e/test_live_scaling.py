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
* an edit of `args` (here: the decode pool put under Serve's autoscaler): Serve hashes an
  application's args into every deployment's version, so every replica is replaced (engines,
  directory, ingress). The conversation's next turn still succeeds, on a new replica with nothing
  cached.
* then, under the autoscaler (`decode.autoscaling`, 1 to 2 replicas): 8 clients opening 3-turn
  conversations scale it 1 -> 2, conversations opened after that are placed on the new replica,
  and once the load stops it scales back to 1; every turn is served (the conversations of the
  replica it removed are re-placed).

One test, one application: each phase starts from the state the one before left.
"""
from __future__ import annotations

import copy
import os
import random
import tempfile
import threading
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
        decode replica count it asks for (an autoscaled pool: its initial count)."""
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        app: dict[str, Any] = {"name": "baton", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": args}
        if overrides:
            app["deployments"] = overrides
        auto = args["decode"].get("autoscaling")
        want = next((o["num_replicas"] for o in overrides or () if o["name"] == "decode"),
                    auto["initial_replicas"] if auto else args["decode"]["num_replicas"])
        _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]), _blocking=False)
        self.wait_decode(want, DEPLOY_WAIT_S)
        if httpx.get(f"{self.url}/health", timeout=10).json().get("status") != "ok":
            raise AssertionError("the application runs but its /health is not ok")

    def wait_decode(self, replicas: int, within_s: float) -> None:
        """Until the application runs with exactly this many decode replicas, all running."""
        from ray import serve

        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            st = serve.status().applications.get("baton")
            if st is not None and st.status == "RUNNING" and st.deployments["decode"].replica_states == {"RUNNING": replicas}:
                return
            time.sleep(0.5)
        raise AssertionError(f"the application did not run {replicas} decode replicas within {within_s:.0f} s: {serve.status()}")


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


def test_scale_through_overrides_keeps_engines_args_edits_replace_them_and_autoscaling_loses_no_turn(cluster: Cluster) -> None:
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

    # an edit of args (here: the decode pool autoscaled, 1 to 2 replicas): Serve replaces every replica,
    # nothing is lost but the KV
    edited = _autoscaled(args)
    cluster.deploy(edited)
    before = a.prompt_tokens
    status, cached = a.turn()
    assert status == 200, "a turn was lost across a redeploy of the whole application"
    assert a.replica not in replicas, "an edit of the application's args kept an old engine replica (Serve's versioning changed?)"
    assert cached < before // 2, f"{cached} of {before} prompt tokens cached on an engine that should have started empty"
    _autoscaling_phase(cluster, a)


def _autoscaled(args: dict[str, Any]) -> dict[str, Any]:
    """The decode pool under Serve's autoscaler, 1 to 2 replicas, 2 ongoing requests per replica
    aimed for; its engines at an H200's step times x 20, so that turns take seconds."""
    engine = copy.deepcopy(args["decode"]["engine"])
    engine["simulated"]["time_scale"] = 20.0
    decode = {k: v for k, v in args["decode"].items() if k != "num_replicas"}
    decode.update(engine=engine, autoscaling={"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 2,
                                               "upscale_delay_s": 1, "downscale_delay_s": 5})
    return {**args, "decode": decode}


def _autoscaling_phase(cluster: Cluster, pinned: Conversation) -> None:
    """8 clients open 3-turn conversations until the pool has grown to 2 and a conversation opened
    after that was placed on the new replica; then it must shrink back to 1 with every turn served."""
    before = pinned.replica
    statuses: list[tuple[str, int]] = []
    opened: list[tuple[float, Conversation]] = []  # (when its first turn was sent, the conversation)
    stop = threading.Event()

    def client(k: int) -> None:
        n = 0
        while not stop.is_set():
            c = Conversation(cluster.url, f"auto-{k}-{n}")
            opened.append((time.monotonic(), c))
            for _ in range(3):
                status, _ = c.turn()
                statuses.append((c.sid, status))
                if status != 200:
                    break
            n += 1

    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(8)]
    for t in clients:
        t.start()
    try:
        cluster.wait_decode(2, 120)  # 8 clients over a target of 2 ongoing requests per replica
        grown = time.monotonic()
        deadline = grown + 120
        while not any(at > grown and c.replica not in (None, before) for at, c in opened):
            assert time.monotonic() < deadline, "no conversation opened after the scale-up was placed on the new replica"
            time.sleep(1)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=120)
    cluster.wait_decode(1, 180)  # idle: back to min_replicas
    last = [c for _, c in opened[-8:]] + [pinned]
    statuses += [(c.sid, c.turn()[0]) for c in last]  # whichever replica Serve removed, every conversation goes on
    failed = [(sid, status) for sid, status in statuses if status != 200]
    assert not failed, f"{len(failed)} of {len(statuses)} turns failed: {failed[:5]}"
