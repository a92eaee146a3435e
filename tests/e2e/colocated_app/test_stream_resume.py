"""A stream survives its decoder, on real engines (Ray + Serve + vLLM, SmolLM2 on this CPU).

Two decoders, colocated policy, one ingress replica (so /baton/stats answers from the ingress that
served the stream). A greedy streaming chat is run once undisturbed; then the same request again,
and after its first few chunks the decode replica serving it is killed (Ray's own kill, as the
reliability bench does: baton/bench/reliability_faults.py). The ingress resumes the stream on the
other decoder, which prefills the prompt plus the tokens already sent (deployments/resume.py):
the client reads one stream, ending in [DONE] with no error event and the same text as the
undisturbed run.

Equality rests on greedy decoding picking the same argmax whether a token's KV was computed in a
decode step (undisturbed) or in the continuation's prefill: the engines run in float32 here, where
the two paths' rounding differences are too small to flip an argmax but at a near tie (in bfloat16
one is likelier; a flip would be numerics, not a resume bug)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from baton.bench.reliability_faults import kill_actor, replica_actor
from tests.e2e.conftest import SharedApp

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 200
KILL_AFTER_CHUNKS = 3
MESSAGES = [{"role": "system", "content": "You are a storyteller."},
            {"role": "user", "content": "Tell me a long story about a lighthouse keeper and a storm."}]


@pytest.fixture
def url(shared_app: SharedApp) -> str:
    return shared_app.url  # the folder's application (conftest.py)


@dataclass
class Streamed:
    """What a client read from one SSE stream."""

    replica: str
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: int = 0
    chunks_after_kill: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)


def stream_chat(url: str, session_id: str, on_chunk: Any = None) -> Streamed:
    """A greedy streaming chat read to its end; on_chunk(n, streamed) after each content chunk."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session_id}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        out = Streamed(replica=r.headers["x-baton-replica"])
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done += 1
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                out.errors.append(ev["error"])
                continue
            if ev.get("usage"):
                out.usage = ev["usage"]
            for choice in ev.get("choices", []):
                if choice.get("finish_reason"):
                    out.finish_reasons.append(choice["finish_reason"])
                content = (choice.get("delta") or {}).get("content")
                if content:
                    out.texts.append(content)
                    if on_chunk is not None:
                        on_chunk(len(out.texts), out)
    return out


def resumes(url: str) -> dict[str, int]:
    snap = httpx.get(f"{url}/baton/stats", timeout=10).json()
    return snap["ingress"]["stream_resumes"]


def test_requests_without_a_session_are_placed_at_the_ingress_and_counted_by_the_directory(url: str) -> None:
    """No prefill pool: once the ingress's pin cache has synced, a sessionless request is placed
    from its view of the decoders' loads (router/pin_cache.py), without a directory call."""
    hits = 0
    for i in range(8):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": f"Count to {i}:", "max_tokens": 2, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.headers["x-baton-replica"], r.text
        snap = httpx.get(f"{url}/baton/stats", timeout=30).json()
        hits = snap["ingress"]["pin_cache"]["sessionless_hits"]
        if hits >= 2:
            break
        time.sleep(0.3)
    assert hits >= 2, json.dumps(snap["ingress"]["pin_cache"])
    # the stats call flushed the ingress's placements: the directory counted them as turns
    assert snap["totals"].get("plan_sessionless_at_ingress", 0) >= 2, json.dumps(snap["totals"])


@pytest.mark.disrupts_app
def test_a_decoder_killed_mid_stream_leaves_the_greedy_stream_unchanged(url: str) -> None:
    reference = stream_chat(url, f"resume-ref-{uuid.uuid4().hex[:8]}")
    assert reference.done == 1 and not reference.errors and reference.finish_reasons == ["length"]
    assert reference.usage is not None and reference.usage["completion_tokens"] == MAX_TOKENS
    before = resumes(url)

    killed: list[str] = []

    def kill_at(n: int, s: Streamed) -> None:
        if killed:
            s.chunks_after_kill += 1
        elif n == KILL_AFTER_CHUNKS:
            kill_actor(replica_actor("decode", s.replica))  # no restart: Serve replaces it with a new replica
            killed.append(s.replica)

    session = f"resume-{uuid.uuid4().hex[:8]}"
    resumed = stream_chat(url, session, on_chunk=kill_at)
    assert killed == [resumed.replica], "the stream ended before the kill: nothing was tested"
    assert resumed.chunks_after_kill > 0, "no content arrived after the kill"
    assert not resumed.errors, resumed.errors
    assert resumed.done == 1 and resumed.finish_reasons == ["length"]
    if resumed.text != reference.text:
        at = next((i for i, (a, b) in enumerate(zip(resumed.text, reference.text, strict=False)) if a != b), min(len(resumed.text), len(reference.text)))
        pytest.fail(f"the resumed stream differs from the undisturbed one at character {at}: "
                    f"{resumed.text[max(0, at - 40):at + 40]!r} vs {reference.text[max(0, at - 40):at + 40]!r}")
    assert resumed.usage is not None and reference.usage is not None
    assert resumed.usage["completion_tokens"] == MAX_TOKENS
    assert resumed.usage["prompt_tokens"] == reference.usage["prompt_tokens"]  # the delivered tokens are completion, not prompt

    after = resumes(url)
    assert after.get("resumed", 0) == before.get("resumed", 0) + 1, (before, after)
    assert after.get("failed", 0) == before.get("failed", 0)

    # the conversation moved with its stream: its next turn runs on a live decoder, not the victim
    deadline = time.monotonic() + 120
    while True:
        r = httpx.post(f"{url}/v1/chat/completions", headers={"x-session-id": session}, timeout=120, json={
            "model": MODEL, "messages": MESSAGES + [{"role": "assistant", "content": resumed.text}, {"role": "user", "content": "Go on."}],
            "max_tokens": 8, "temperature": 0})
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert r.status_code == 200, r.text
    assert r.headers["x-baton-replica"] != killed[0]
