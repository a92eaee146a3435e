"""baton/bench/control_load.py against an in-process fake (httpx.MockTransport) that answers
like Baton (SSE + Server-Timing): conversations grow turn by turn under their own session id,
every failure (status, error event, cut stream, exception) is counted, not dropped, and the
on_window hook brackets exactly the measured window."""
from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
import pytest

from baton.bench.control_load import LoadSpec, _read_event, run_point
from baton.bench.control_stats import summarize_point

TIMING = "parse;dur=1.00, route;dur=2.00, to_replica;dur=0.50, replica;dur=0.50, engine;dur=3.00, from_replica;dur=0.50, total;dur=7.50"


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


class FakeBaton:
    """Answers /v1/chat/completions; the third turn of every conversation gets a 500."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = defaultdict(list)  # session id -> message counts, in order

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sid = request.headers["x-session-id"]
        self.seen[sid].append(len(body["messages"]))
        assert body["stream"] is True and body["max_tokens"] == 2 and body["model"] == "m"
        await asyncio.sleep(0.002)
        if body["messages"][-1]["content"].startswith("Turn 2 "):
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, headers={"server-timing": TIMING, "content-type": "text/event-stream"},
                              content=sse(chunk(""), chunk(" x"), chunk(" x"), "[DONE]"))


def test_closed_loop_counts_turns_hops_and_failures() -> None:
    fake = FakeBaton()
    spec = LoadSpec(model="m", concurrency=4, duration_s=0.3, warmup_s=0.05, max_tokens=2, turns_per_conversation=4)
    load = asyncio.run(run_point("http://baton", spec, tag="t", transport=httpx.MockTransport(fake)))
    ok = [t for t in load.turns if t.ok]
    bad = [t for t in load.turns if not t.ok]
    assert ok and bad and load.warmup_turns > 0
    assert load.elapsed_s >= spec.duration_s and load.client_cpu_s > 0
    assert all(t.status == 500 and t.error == "http_500" for t in bad)
    assert all(0 <= t.started_s < spec.duration_s for t in load.turns)
    assert all(t.hops["route"] == pytest.approx(0.002) and t.ttft_s is not None and t.latency_s >= 0.002 for t in ok)
    # a conversation: turns 0, 1 ok, turn 2 fails and ends it; each turn carries the history
    # (user, assistant, user, ...), every conversation its own session id
    for sid, counts in fake.seen.items():
        assert sid.startswith("t-c") and counts == [1, 3, 5][:len(counts)]
    assert len(fake.seen) >= 2 * spec.concurrency
    assert abs(len(ok) - 2 * len(bad)) <= 2 * spec.concurrency  # 2 ok : 1 failed, up to the window's edges
    p = summarize_point(8, 4, load.turns, load.elapsed_s)
    assert p.failures == len(bad) and p.decisions_per_s == pytest.approx(len(ok) / load.elapsed_s)
    assert p.route_p99_s == float("inf")  # a third of the turns failed
    assert p.route_p50_s == pytest.approx(0.002) and p.ingress_overhead_p50_s == pytest.approx(0.004)


def test_on_window_fires_at_the_window_start_and_after_its_last_turn() -> None:
    import time

    calls: list[tuple[str, float]] = []
    burn = {"start": 0.0}

    def on_window(edge: str) -> None:
        calls.append((edge, time.monotonic()))
        if edge == "start":  # the hook's own CPU is not the client's
            t = time.process_time()
            while time.process_time() - t < 0.2:
                pass
            burn["start"] = time.process_time() - t

    fake = FakeBaton()
    spec = LoadSpec(model="m", concurrency=2, duration_s=0.3, warmup_s=0.2)
    t0 = time.monotonic()
    load = asyncio.run(run_point("http://baton", spec, transport=httpx.MockTransport(fake), on_window=on_window))
    t_end = time.monotonic()
    assert [e for e, _ in calls] == ["start", "end"]
    (_, started), (_, ended) = calls
    assert started - t0 == pytest.approx(spec.warmup_s, abs=0.1)  # not at the warm-up's start
    # "start" is stamped inside the hook, a moment after the window began (under load, up to a few ms): the window still spans duration_s
    assert ended - started >= spec.duration_s - 0.05 and ended <= t_end
    assert load.warmup_turns > 0  # turns ran before the hook's "start"
    assert 0 < load.window_client_cpu_s <= load.client_cpu_s - burn["start"] + 1e-3  # the window only, the hook left out


def test_an_exception_is_a_failed_turn() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    spec = LoadSpec(model="m", concurrency=2, duration_s=0.05, warmup_s=0.0)
    load = asyncio.run(run_point("http://baton/", spec, transport=httpx.MockTransport(refuse)))
    assert load.turns and all(not t.ok and t.error == "ConnectError" and t.status is None for t in load.turns)
    assert summarize_point(8, 2, load.turns, load.elapsed_s).decisions_per_s == 0.0


def test_error_event_and_cut_stream_fail_the_turn() -> None:
    def cut(request: httpx.Request) -> httpx.Response:
        first_conversation = "conversation 0:" in json.loads(request.content)["messages"][-1]["content"]
        events = (chunk(" x"), {"error": {"code": "engine_error"}}, "[DONE]") if first_conversation else (chunk(" x"),)
        return httpx.Response(200, headers={"server-timing": TIMING}, content=sse(*events))

    spec = LoadSpec(model="m", concurrency=1, duration_s=0.05, warmup_s=0.0)
    load = asyncio.run(run_point("http://baton", spec, transport=httpx.MockTransport(cut)))
    # every conversation fails at its first turn: the first one by an error event, the others cut before [DONE]
    assert load.turns[0].error == "event:engine_error" and len(load.turns) >= 2
    assert {t.error for t in load.turns[1:]} == {"no_done"} and not any(t.ok for t in load.turns)


def test_read_event() -> None:
    state: dict[str, object] = {"done": False, "error": None, "text": [], "first": None}
    for line in ("", ": comment", f"data: {json.dumps(chunk(''))}", f"data: {json.dumps(chunk(' x'))}", "data: [DONE]"):
        _read_event(line, state)
    assert state["done"] and state["text"] == [" x"] and state["first"] is not None and state["error"] is None
    _read_event("data: {not json", state)
    assert state["error"] == "bad_event"


@pytest.mark.parametrize("bad", [{"concurrency": 0}, {"duration_s": 0}, {"max_tokens": 0}, {"turns_per_conversation": 0}])
def test_bad_spec(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LoadSpec(model="m", **{"concurrency": 1, "duration_s": 1.0, **bad})  # type: ignore[arg-type]


def test_warm_up_sends_waves_of_first_turns_and_counts_replicas_and_failures() -> None:
    import asyncio
    import json as _json

    from baton.bench.control_load import warm_replicas

    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = _json.loads(request.content)
        seen.append(request.headers["x-session-id"])
        i = int(body["messages"][0]["content"].split()[-1])
        if i == 5:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"choices": []}, headers={"x-baton-replica": f"r{i % 3}"})

    out = asyncio.run(warm_replicas("http://x", "m", 4, transport=httpx.MockTransport(handler)))
    assert out["conversations"] == 8 and len(seen) == len(set(seen)) == 8  # a new conversation each
    assert out["failed"] == 1 and out["replicas_used"] == 3
