"""The conversation directory split in two shards (routing.directory_shards: 2, this folder's app),
on real engines: each conversation is routed by the shard its session id hashes to
(router/directory_shards.py, the same hash the test computes), its later turns stay on its
decoder, another user is refused on any shard, and its owner ends it on its shard."""
from __future__ import annotations

import uuid

import httpx
import pytest

from router.directory_shards import shard_of
from tests.e2e.colocated_app.conftest import DIRECTORY_SHARDS
from tests.e2e.conftest import SharedApp

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CONVERSATIONS = 8


@pytest.fixture
def url(shared_app: SharedApp) -> str:
    return shared_app.url


def chat(url: str, sid: str, user: str, text: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0, "user": user}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": sid}, timeout=120)


def stats(url: str) -> dict:
    r = httpx.get(f"{url}/baton/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_shard_routes_its_own_conversations_and_pins_hold(url: str) -> None:
    before = stats(url)
    assert before["directory_shards"] == DIRECTORY_SHARDS
    tag = uuid.uuid4().hex[:8]
    sids: list[str] = []
    for i in range(1_000):  # an equal number on each shard: random ids put all 8 on one shard in 1 run of 128
        sid = f"shard-{tag}-{i}"
        if sum(shard_of(s, DIRECTORY_SHARDS) == shard_of(sid, DIRECTORY_SHARDS) for s in sids) < CONVERSATIONS // DIRECTORY_SHARDS:
            sids.append(sid)
        if len(sids) == CONVERSATIONS:
            break
    expected = [sum(shard_of(s, DIRECTORY_SHARDS) == i for s in sids) for i in range(DIRECTORY_SHARDS)]
    assert len(sids) == CONVERSATIONS and all(expected), expected  # both shards get some
    first = {}
    for sid in sids:
        r = chat(url, sid, "ana", "Say hello.")
        assert r.status_code == 200, r.text
        first[sid] = r.headers["x-baton-replica"]
    for sid in sids:
        r = chat(url, sid, "ana", "Say hello again.")
        assert r.status_code == 200, r.text
        assert r.headers["x-baton-replica"] == first[sid], sid  # pinned, whichever shard placed it
    after = stats(url)
    opened = [a["conversations_total"] - b["conversations_total"] for a, b in zip(after["shards"], before["shards"], strict=True)]
    assert opened == expected, (opened, expected)  # each conversation was opened on the shard its id hashes to
    assert after["conversations_total"] - before["conversations_total"] == CONVERSATIONS
    # each engine replica reports to its home shard, which relays to the other (this folder's report_relay_period_s)
    assert after["totals"].get("reports_relayed_in", 0) > before["totals"].get("reports_relayed_in", 0)


def test_another_user_is_refused_and_the_owner_ends_it_on_its_shard(url: str) -> None:
    tag = uuid.uuid4().hex[:8]
    for shard in range(DIRECTORY_SHARDS):
        sid = next(s for s in (f"own-{tag}-{i}" for i in range(100)) if shard_of(s, DIRECTORY_SHARDS) == shard)
        assert chat(url, sid, "ana", "Hi.").status_code == 200
        r = chat(url, sid, "bob", "Hi.")
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found", r.text
        end = f"{url}/v1/conversations/{sid}"
        assert httpx.get(end, params={"user": "bob"}, timeout=30).status_code == 404
        r = httpx.delete(end, params={"user": "ana"}, timeout=30)
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert chat(url, sid, "bob", "Mine now.").status_code == 200  # an ended conversation's id is free again
