"""Ray + Serve + real vLLM engines (SmolLM2) on this CPU, spoken to over HTTP."""
from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[2]
# > 2 KV blocks (128 tokens each) so a later turn can hit the prefix cache
SYSTEM = "You are a travel assistant. Available tools: " + " ".join(
    f"tool_{i}(city: str, date: str) returns the weather, flights and hotels for a city on a date." for i in range(24)
)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_pools_run_the_configured_number_of_engines(baton_url: str) -> None:
    import ray
    from ray import serve

    app = serve.status().applications["baton"]
    running = {name: d.replica_states.get("RUNNING", 0) for name, d in app.deployments.items()}
    assert running["decode"] == 2 and running["prefill"] == 1, running
    alive: dict[str, int] = defaultdict(int)
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::baton#"):
            alive[a["name"].split("#")[1]] += 1
    assert alive["decode"] == 2 and alive["prefill"] == 1, dict(alive)


def test_openai_client_multi_turn_with_prefix_cache(baton_url: str) -> None:
    c = client(baton_url)
    assert [m.id for m in c.models.list().data] == [MODEL]
    headers = {"x-session-id": "e2e-conv-1"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_headers=headers)
    first = raw.parse()
    replica_1 = raw.headers["x-baton-replica"]
    assert first.choices[0].message.content.strip()
    assert first.usage.prompt_tokens > 256 and first.usage.completion_tokens > 0
    assert raw.headers["x-session-id"] == "e2e-conv-1"

    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And of Germany?"}]
    with c.chat.completions.with_streaming_response.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers,
    ) as resp:
        replica_2 = resp.headers["x-baton-replica"]
        chunks = list(resp.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    use = [ch.usage for ch in chunks if ch.usage]
    assert text.strip()
    assert len(use) == 1 and use[0].completion_tokens > 0
    assert use[0].prompt_tokens_details.cached_tokens >= 256, "turn 2 should reuse turn 1's KV (prefix cache)"
    assert replica_2 == replica_1, "a conversation stays on its decode replica"

    # later turns are planned from the ingress's pin cache (router/pin_cache.py) and the directory
    # still counts every one of them (the ingress flushes its turns before GET /v1/conversations).
    # There are two ingress replicas and /baton/stats shows the one that answers it: keep sending
    # turns, each after a pin-cache sync period, until that one has planned a turn from its cache.
    sent = 2
    for t in range(8):
        time.sleep(0.6)  # > routing.pin_cache_sync_s (0.5): every ingress has synced the pin
        messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": f"And of country {t}?"}]
        r = httpx.post(f"{baton_url}/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0},
                       headers=headers, timeout=120)
        assert r.status_code == 200 and r.headers["x-baton-replica"] == replica_1, r.text
        sent += 1
        cache = httpx.get(f"{baton_url}/baton/stats", timeout=30).json()["ingress"]["pin_cache"]
        if cache["hits"] >= 1:
            break
    assert cache["enabled"] and cache["hits"] >= 1, json.dumps(cache)
    info = httpx.get(f"{baton_url}/v1/conversations/e2e-conv-1", timeout=30).json()
    assert info["turns"] == sent and info["decoder"] == replica_1, (info, sent)
    # an ingress tokenizes only what a turn appended (deployments/token_prefix.py): of the two
    # ingress replicas one served two or more of the >= 3 turns; the stats come from either
    hits = 0
    for _ in range(30):
        hits = max(hits, httpx.get(f"{baton_url}/baton/stats", timeout=30).json()["ingress"]["prompt_prefix_tokens"]["hits"])
        if hits:
            break
    assert hits >= 1


def test_completions_greedy_is_deterministic(baton_url: str) -> None:
    c = client(baton_url)
    a = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    b = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in a.choices[0].text
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == 5


def test_sessions_are_sticky_and_spread_over_replicas(baton_url: str) -> None:
    async def conversation(http: httpx.AsyncClient, sid: str) -> list[str]:
        messages = [{"role": "system", "content": SYSTEM}]
        seen = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn} about city {sid}?"})
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
            r = await http.post("/v1/chat/completions", json=body, headers={"x-session-id": sid})
            assert r.status_code == 200, r.text
            seen.append(r.headers["x-baton-replica"])
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        return seen

    async def run() -> dict[str, list[str]]:
        async with httpx.AsyncClient(base_url=baton_url, timeout=300) as http:
            sids = [f"sticky-{i}" for i in range(6)]
            return dict(zip(sids, await asyncio.gather(*(conversation(http, s) for s in sids)), strict=True))

    placed = asyncio.run(run())
    for sid, replicas in placed.items():
        assert len(set(replicas)) == 1, f"{sid} moved between replicas: {replicas}"
    assert len({r[0] for r in placed.values()}) == 2, f"new conversations should use both decode replicas: {placed}"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (json.dumps({"model": "gpt-99", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model_not_found"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(), 400, "invalid_value"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400, "invalid_value"),
        (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode(), 400, "invalid_value"),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 5000}]}).encode(), 400, "context_length_exceeded"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}).encode(), 400, "context_length_exceeded"),
    ],
)
def test_bad_requests_get_openai_error_bodies(baton_url: str, body: bytes, status: int, code: str) -> None:
    r = httpx.post(f"{baton_url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    assert "Traceback" not in r.text


def test_replay_bfcl_trace_hits_prefix_cache_on_later_turns(baton_url: str, tmp_path: Path) -> None:
    from baton.paths import SAMPLE_TRACES
    from baton.traces.format import load_trace
    from baton.traces.replay import replay

    # two conversations of the sample trace, cut to 2 turns of 8 tokens without think time: the
    # later turns' prefix hits are what is checked, not the trace's length (the whole trace is
    # replayed by `make demo` and the benches)
    convs = [c.model_copy(update={"turns": [t.model_copy(update={"max_tokens": 8, "think_time_s": 0.0}) for t in c.turns[:2]]})
             for c in load_trace(SAMPLE_TRACES / "agentic_small.jsonl")[:2]]
    result = asyncio.run(replay(convs, baton_url, concurrency=2, progress=False))
    records = result.turns
    assert records and all(r.error is None for r in records), [r.error for r in records if r.error]
    later = [r for r in records if r.turn_index >= 1]
    assert later and all(r.cached_tokens > 0 for r in later)
    assert all(r.ttft_s is not None for r in records)


@pytest.mark.disrupts_app
def test_engine_failure_is_a_503_or_in_stream_error_then_recovers(baton_url: str) -> None:
    """Kill the decode replica serving a conversation mid-stream: the client gets a clear error
    (never a 500 or a stack trace) and the conversation's next turn is served elsewhere."""
    import ray

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a long story."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"x-session-id": "e2e-failure"}
    with httpx.stream("POST", f"{baton_url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        victim = r.headers["x-baton-replica"]
        lines = r.iter_lines()
        next(lines)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::baton#decode#{victim}", namespace="serve"), no_restart=True)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    errors = [json.loads(line[6:]) for line in rest[:-1] if '"error"' in line]
    # the ingress resumes the stream on the other decoder (tests/e2e/colocated_app/test_stream_resume.py checks
    # it); a stream it cannot resume ends with a clear service_unavailable event, never a 500
    assert not errors or errors[0]["error"]["type"] == "service_unavailable", rest[-3:]

    body = {**body, "stream": False, "max_tokens": 8, "ignore_eos": False}
    r = httpx.post(f"{baton_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code in (200, 503), r.text
    if r.status_code == 503:
        assert r.json()["error"]["type"] == "service_unavailable" and "Retry-After" in r.headers
        r = httpx.post(f"{baton_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-baton-replica"] != victim
    assert r.json()["usage"]["prompt_tokens"] > 256, "the new decoder got the whole context (system prompt and all)"
