"""ConServe on real engines: the first turn's KV moves once over NIXL (counted by the decode
replicas' connectors), later turns stay on that decoder, whatever ingress replica answers.

The per_turn_pd baseline (a handoff on every turn) is not redeployed here (a redeploy restarts
every engine, ~100 s of the suite): its plan is unit-tested (tests/unit/test_directory_state.py)
and `baton bench conserve` reports its handoffs per conversation, counted by the same connectors,
on every run."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from baton.bench.cluster import settled_transfers

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SYSTEM = "You are a travel assistant. Available tools: " + " ".join(
    f"tool_{i}(city: str, date: str) returns the weather, flights and hotels for a city on a date." for i in range(24)
)


@pytest.fixture
def url(baton_url: str) -> str:
    return baton_url  # the folder's application (conftest.py)


def converse(url: str, sid: str, turns: int = 3) -> list[tuple[str, str, str]]:
    """(decode replica, ingress replica, reply) per turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t} of {sid}: which city should I visit?"})
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0}, headers={"x-session-id": sid}, timeout=300)
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]["content"]
        out.append((r.headers["x-baton-replica"], r.headers["x-baton-ingress"], reply))
        messages.append({"role": "assistant", "content": reply})
    return out


def test_one_handoff_per_conversation_and_pinned_decoders(url: str) -> None:
    before = settled_transfers(url)
    sids = [f"pin-{i}" for i in range(6)]
    with ThreadPoolExecutor(len(sids)) as pool:
        results = dict(zip(sids, pool.map(lambda s: converse(url, s), sids), strict=True))
    after = settled_transfers(url)
    assert after - before == len(sids), "exactly one NIXL transfer per conversation (counted by the connectors)"
    for sid, turns in results.items():
        assert len({d for d, _, _ in turns}) == 1, f"{sid} moved between decoders: {turns}"
    ingresses = {i for turns in results.values() for _, i, _ in turns}
    assert len(ingresses) == 2, "both ingress replicas answered, and still every conversation kept one decoder"
    snap = httpx.get(f"{url}/baton/stats", timeout=10).json()
    assert snap["policy"] == "conversation" and snap["live_pins"] >= len(sids)


def test_greedy_output_is_the_same_with_remote_or_local_prefill(url: str) -> None:
    from deployments.chat import PromptRenderer
    from deployments.protocol import ChatMessage
    from tests.e2e.conftest import MODEL_DIR, remote_and_local_greedy

    ids = PromptRenderer.from_path(str(MODEL_DIR)).chat_tokens(
        [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content="Plan a two-day trip to Rome.")]
    )
    remote_text, deltas, transfers = remote_and_local_greedy(url, ids, "local-prefill-check")
    assert transfers == 1, "the HTTP request was prefilled remotely"
    assert remote_text == "".join(d.text for d in deltas)
