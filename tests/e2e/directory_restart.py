"""The conversation directory dies and comes back, on real engines (Ray + Serve + vLLM + NIXL,
conversation policy, 1 prefill + 2 decode engines, a durable ownership file in tmp).

Two users (API keys bound to ana and bob, plus an operator key for /baton/stats) open a
conversation each; after a routing-stats period (every decoder has reported the conversations
it holds) the directory's replica actor is killed (Ray's own kill, as the reliability bench does:
baton/bench/reliability_recovery.py), and Serve starts a new one. While it is down a turn of a
conversation is refused with 503 + Retry-After (fail closed: nobody can check the owner) or waits
in Serve's handle queue until the new directory checks it; bob is never let in. Once it
is back, ownership came from the SQLite file (bob is still refused ana's conversation, 404) and
the pins from the decoders' reports: ana's next turn runs on her decoder with no new handoff.
DELETE /v1/conversations/{id} then ends it for its owner only.

It runs as the last test of tests/e2e/test_isolation.py, on that module's application (same
layout, these users' keys added to its own): one application start less in the suite, and the
kill comes after every other test of the app."""
from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from baton.bench.reliability_faults import kill_actor, named_actors

OPERATOR_KEY, ANA_KEY, BOB_KEY, CAROL_KEY = "rs-operator-key", "rs-ana-key", "rs-bob-key", "rs-carol-key"
KEYS = f"{OPERATOR_KEY},{ANA_KEY}=ana,{BOB_KEY}=bob,{CAROL_KEY}=carol"
DIRECTORY = "SERVE_REPLICA::baton#directory#"
HTTP_TIMEOUT_S = 180.0
REPORT_PERIOD_S = 1.0  # the pools' routing_stats_period_s (deployments/config.py default)


class Conv:
    """One user's conversation: its session id, its messages, and the decoder of each turn."""

    def __init__(self, url: str, key: str, name: str):
        self.url, self.key = url, key
        self.sid = f"restart-{name}-{uuid.uuid4().hex[:8]}"
        self.messages: list[dict[str, str]] = [{"role": "system", "content": f"You help {name} plan a trip."}]
        self.decoders: list[str] = []

    def send(self, text: str, key: str | None = None) -> httpx.Response:
        """One turn as `key` (default: the owner's); the messages grow only on a 200 by the owner."""
        body = {"messages": [*self.messages, {"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S,
                       headers={"authorization": f"Bearer {key or self.key}", "x-session-id": self.sid})
        if r.status_code == 200 and key in (None, self.key):
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
            self.decoders.append(r.headers["x-baton-replica"])
        return r


def stats(url: str) -> httpx.Response:
    return httpx.get(f"{url}/baton/stats", headers={"authorization": f"Bearer {OPERATOR_KEY}"}, timeout=30)


def recovered(url: str, adopted: int, timeout_s: float = 180.0) -> dict[str, Any]:
    """The new directory's snapshot once it answers, sees both decoders (and the prefill engine)
    live and has adopted at least `adopted` pins from the decoders' reports."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        r = stats(url)
        if r.status_code == 200:
            snap = last = r.json()
            live = [rep["pool"] for rep in snap["replicas"].values() if rep["live"]]
            if live.count("decode") == 2 and live.count("prefill") == 1 and snap["totals"].get("pins_adopted", 0) >= adopted:
                return snap
        else:
            last = (r.status_code, r.text[:200])
        time.sleep(1)
    raise AssertionError(f"the directory did not come back with its pins within {timeout_s:.0f}s: {last}")


def check_restart(url: str) -> None:
    """The scenario above, on an app whose keys include KEYS, with 2 decode and 1 prefill engines."""
    ana, bob, carol = Conv(url, ANA_KEY, "ana"), Conv(url, BOB_KEY, "bob"), Conv(url, CAROL_KEY, "carol")
    for conv in (ana, bob, carol):
        for t in range(2):
            r = conv.send(f"Turn {t}: where should I go in spring?")
            assert r.status_code == 200, r.text
        assert conv.decoders[0] == conv.decoders[1]  # pinned
    r = ana.send("Hi", key=BOB_KEY)
    assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found", r.text  # before the restart too

    time.sleep(2.5 * REPORT_PERIOD_S)  # every decoder's report now lists the conversations it served
    old = named_actors(DIRECTORY)
    assert len(old) == 1, old
    kill_actor(old[0])  # no restart of this actor: Serve replaces the replica with a new one

    # until the new directory answers: a turn of a conversation is refused with 503 + Retry-After,
    # or waits in Serve's handle queue and is served once the new directory checked its owner
    # (both are what the issue allows); never served unchecked: bob never gets into carol's.
    # Probed until a replacement directory exists and has served carol twice (at most 30 s).
    outage: list[tuple[int, str | None]] = []
    served_by_new = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and served_by_new < 2:
        replaced = named_actors(DIRECTORY) not in ([], old)
        r = carol.send("Are you there?")
        outage.append((r.status_code, r.headers.get("retry-after")))
        if r.status_code != 200:
            assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.headers, r.text)
            assert r.json()["error"]["code"] == "engine_unavailable", r.text
        elif replaced:
            served_by_new += 1
        r = carol.send("Let me in.", key=BOB_KEY)
        assert r.status_code in (404, 503), (r.status_code, r.text)
    assert outage and all(code in (200, 503) for code, _ in outage), outage

    before = recovered(url, adopted=2)  # both decoders reported to the new directory: ana's and bob's pins are back
    new = named_actors(DIRECTORY)
    assert len(new) == 1 and new != old, (old, new)

    # ownership survived: bob is refused ana's conversation (404, as for one that does not exist)
    r = ana.send("What did ana plan?", key=BOB_KEY)
    assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found", r.text

    # the pins came back from the decoders: ana and bob return to their decoders, no second handoff
    for conv in (ana, bob):
        r = conv.send("And after that?")
        assert r.status_code == 200, r.text
        assert conv.decoders[-1] == conv.decoders[0], (conv.sid, conv.decoders)
    after = stats(url).json()
    assert after["handoffs_planned_total"] == before["handoffs_planned_total"], (before["totals"], after["totals"])
    # carol's conversation goes on too
    assert carol.send("Back again.").status_code == 200

    # the owner ends the conversation; nobody else can
    end = f"{url}/v1/conversations/{ana.sid}"
    r = httpx.delete(end, headers={"authorization": f"Bearer {BOB_KEY}"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found", r.text
    r = httpx.delete(end, headers={"authorization": f"Bearer {ANA_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    r = httpx.delete(end, headers={"authorization": f"Bearer {BOB_KEY}"}, timeout=30)
    assert r.status_code == 404, r.text
    r = httpx.delete(end, headers={"authorization": f"Bearer {ANA_KEY}"}, timeout=30)
    assert r.status_code == 404, r.text  # already ended
