"""Closed-loop chat load for the control-plane bench (baton/bench/control.py).

`concurrency` clients share one httpx.AsyncClient (a connection each). Each client runs
multi-turn conversations back to back: a conversation has its own `x-session-id`, each turn
appends a short user message to the history (and the reply after it), so the first turn is a
new placement and the later ones are the directory's pinned look-ups. A conversation ends after
`turns_per_conversation` turns or at its first failure; the client then starts the next one
(after FAILURE_PAUSE_S when it failed, so a dead server is not hammered in a hot loop).

Timeline of a point: [warm-up | measured window]. Turns started in the warm-up are not reported
(only counted); every turn started in the window is kept, ok or failed, and awaited to its end
(bounded by request_timeout_s); no turn starts after the window. `elapsed_s` runs from the window's
start to the end of its last turn, so decisions/s = ok turns / elapsed_s never credits a turn
to a window it ran past. `on_window` (optional) is called with "start" at the window's start and
"end" once the last turn started in it has ended (after every client stopped): the span that
elapsed_s measures, for samplers of the server's CPU (control_cpu.py); `window_client_cpu_s` is
this process's CPU over that same span, the hook's own work left out.

A turn is ok when the response is 200 and its SSE stream ends with `[DONE]` with no error event;
anything else (another status, an error event, a cut stream, an exception, a timeout) is a
failed TurnSample with its reason, never dropped (control_stats.py turns it into +inf)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from baton.bench.control_stats import TurnSample
from deployments.hop_timing import parse_server_timing

SESSION_HEADER = "x-session-id"
FAILURE_PAUSE_S = 0.005  # a client's pause after a failed turn, before its next conversation


@dataclass(frozen=True)
class LoadSpec:
    """One point's load: how many clients, for how long, and what each turn asks."""

    model: str
    concurrency: int
    duration_s: float
    warmup_s: float = 3.0
    max_tokens: int = 2
    turns_per_conversation: int = 4
    request_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.duration_s <= 0 or self.warmup_s < 0 or self.max_tokens < 1 or self.turns_per_conversation < 1:
            raise ValueError(f"bad load spec: {self}")


@dataclass(frozen=True)
class PointLoad:
    """What the load generator saw at one point."""

    turns: list[TurnSample]  # the measured window's turns, ok and failed
    elapsed_s: float  # window start -> its last turn's end
    warmup_turns: int
    warmup_failures: int
    client_cpu_s: float  # this process's CPU time over the point, warm-up included (the client shares the server's cores)
    window_client_cpu_s: float  # this process's CPU time over the measured window only (on_window's span, its own work left out)


WindowEdge = Literal["start", "end"]


@dataclass(frozen=True)
class _Reply:
    ok: bool
    text: str
    ttft_s: float | None
    error: str | None


def _read_event(line: str, state: dict[str, Any]) -> None:
    """One SSE line into state: `done`, `error`, the reply text, the first content's time."""
    if not line.startswith("data: "):
        return
    data = line[6:].strip()
    if data == "[DONE]":
        state["done"] = True
        return
    try:
        event = json.loads(data)
    except ValueError:
        state["error"] = state["error"] or "bad_event"
        return
    if "error" in event:
        err = event["error"]
        reason = f"event:{err.get('code') or err.get('type') or 'error'}" if isinstance(err, dict) else "event:error"
        state["error"] = state["error"] or reason
        return
    for choice in event.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            state["text"].append(content)
            if state["first"] is None:
                state["first"] = time.monotonic()


async def _one_turn(http: httpx.AsyncClient, url: str, spec: LoadSpec, session_id: str,
                    messages: list[dict[str, str]]) -> tuple[_Reply, int | None, dict[str, float]]:
    body = {"model": spec.model, "messages": messages, "max_tokens": spec.max_tokens, "temperature": 0, "stream": True}
    sent = time.monotonic()
    state: dict[str, Any] = {"done": False, "error": None, "text": [], "first": None}
    async with http.stream("POST", url, json=body, headers={SESSION_HEADER: session_id}) as r:
        hops = parse_server_timing(r.headers.get("server-timing", ""))
        if r.status_code != 200:
            await r.aread()
            return _Reply(False, "", None, f"http_{r.status_code}"), r.status_code, hops
        async for line in r.aiter_lines():
            _read_event(line, state)
    ttft = None if state["first"] is None else state["first"] - sent
    error = state["error"] or (None if state["done"] else "no_done")
    return _Reply(error is None, "".join(state["text"]), ttft, error), r.status_code, hops


class _Window:
    """The point's clock: warm-up end and window end, and the turns it keeps."""

    def __init__(self, spec: LoadSpec):
        self.t0 = time.monotonic() + spec.warmup_s
        self.t1 = self.t0 + spec.duration_s
        self.duration_s = spec.duration_s
        self.turns: list[TurnSample] = []
        self.last_end = self.t1
        self.warmup_turns = self.warmup_failures = 0

    def open(self) -> bool:
        return time.monotonic() < self.t1

    def elapsed_s(self) -> float:
        """Window start -> its last turn's end, never under the window (measured from t1: t1 - t0
        in floating point can fall a hair short of duration_s)."""
        return self.duration_s + max(0.0, self.last_end - self.t1)

    def record(self, started: float, ended: float, reply: _Reply, status: int | None, hops: dict[str, float]) -> None:
        if started < self.t0:
            self.warmup_turns += 1
            self.warmup_failures += not reply.ok
            return
        self.last_end = max(self.last_end, ended)
        self.turns.append(TurnSample(ok=reply.ok, started_s=started - self.t0, latency_s=ended - started, ttft_s=reply.ttft_s,
                                     hops=hops, status=status, error=reply.error))


async def _client(http: httpx.AsyncClient, url: str, spec: LoadSpec, window: _Window, tag: str, index: int) -> None:
    conversation = 0
    while window.open():
        session_id = f"{tag}-c{index}-k{conversation}"
        messages: list[dict[str, str]] = []
        for turn in range(spec.turns_per_conversation):
            if not window.open():
                return
            messages.append({"role": "user", "content": f"Turn {turn} of conversation {conversation}: reply briefly."})
            started = time.monotonic()
            status: int | None = None
            hops: dict[str, float] = {}
            try:
                reply, status, hops = await asyncio.wait_for(_one_turn(http, url, spec, session_id, messages), spec.request_timeout_s)
            except (TimeoutError, httpx.TimeoutException):
                reply = _Reply(False, "", None, "timeout")
            except Exception as e:  # noqa: BLE001 - a failed turn is counted, never dropped
                reply = _Reply(False, "", None, type(e).__name__)
            window.record(started, time.monotonic(), reply, status, hops)
            if not reply.ok:
                await asyncio.sleep(FAILURE_PAUSE_S)  # a refused connection must not spin the client
                break  # a failed turn ends its conversation; the next one starts afresh
            messages.append({"role": "assistant", "content": reply.text})
        conversation += 1


async def _window_start(window: _Window, on_window: Callable[[WindowEdge], None]) -> float:
    """Sleeps to the window's start, calls on_window("start"), returns this process's CPU clock after it."""
    await asyncio.sleep(max(0.0, window.t0 - time.monotonic()))
    on_window("start")
    return time.process_time()


async def run_point(base_url: str, spec: LoadSpec, *, tag: str = "ctl", transport: httpx.AsyncBaseTransport | None = None,
                    on_window: Callable[[WindowEdge], None] | None = None) -> PointLoad:
    """Run one point against `base_url` (…/v1/chat/completions is posted to). transport: for
    tests (httpx.MockTransport); session ids are `<tag>-c<client>-k<conversation>`; on_window:
    see the module docstring (it runs on the event loop: the clients wait while it works)."""
    hook = on_window or (lambda edge: None)
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    cpu0 = time.process_time()
    async with httpx.AsyncClient(limits=limits, timeout=spec.request_timeout_s, transport=transport) as http:
        window = _Window(spec)
        start = asyncio.create_task(_window_start(window, hook))
        await asyncio.gather(*(_client(http, url, spec, window, tag, i) for i in range(spec.concurrency)))
        window_cpu0 = await start  # the clients run past the window's start: it has fired
        window_cpu_s = time.process_time() - window_cpu0
        hook("end")
    return PointLoad(turns=window.turns, elapsed_s=window.elapsed_s(), warmup_turns=window.warmup_turns,
                     warmup_failures=window.warmup_failures, client_cpu_s=time.process_time() - cpu0,
                     window_client_cpu_s=window_cpu_s)


WARM_TIMEOUT_S = 240.0


async def warm_replicas(base_url: str, model: str, replicas: int, *, rounds: int = 2,
                        transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    """Before a size is measured: `rounds` waves of `replicas` concurrent one-turn conversations,
    each wave awaited, so every replica has run steps (a stand-in engine loads its timing data on its
    first steps, seconds of CPU that would otherwise fall into the first measured point). Returns
    how many turns ran and failed, how long it took, and how many distinct replicas served them
    (x-baton-replica); a turn still failing at WARM_TIMEOUT_S counts as failed, the sweep goes on."""
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    t0, used, failed = time.monotonic(), set(), 0
    limits = httpx.Limits(max_connections=replicas, max_keepalive_connections=replicas)
    async with httpx.AsyncClient(limits=limits, timeout=WARM_TIMEOUT_S, transport=transport) as http:
        async def one(i: int) -> None:
            nonlocal failed
            body = {"model": model, "messages": [{"role": "user", "content": f"warm-up {i}"}], "max_tokens": 1}
            try:
                r = await http.post(url, json=body, headers={SESSION_HEADER: f"warm-{i}-{uuid.uuid4().hex[:8]}"})
                if r.status_code == 200:
                    used.add(r.headers.get("x-baton-replica", ""))
                else:
                    failed += 1
            except httpx.HTTPError:
                failed += 1
        for w in range(rounds):
            await asyncio.gather(*(one(w * replicas + i) for i in range(replicas)))
    return {"conversations": rounds * replicas, "failed": failed, "seconds": time.monotonic() - t0, "replicas_used": len(used - {""})}
