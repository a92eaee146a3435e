"""Overload and soak cases of `baton bench reliability`.

Overload: closed-loop clients at twice the admitted concurrency (ingress replicas ×
ingress.max_inflight_requests), each sending long, never-cached prompts. Only 200 / 429 / 503
may come back, every 429/503 with Retry-After, the limits must actually be reached, the p99
latency of admitted requests stays under a bound derived from one request alone, and replica
memory (RSS) stays bounded with no replica lost.

Soak (full mode): agentic multi-turn conversations (baton/traces/samples/agentic_small.jsonl), memory
chats and real-time WebSocket sessions together for a fixed time; every answer is classed and
every turn retried once on a retryable failure.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from baton.bench.cluster import replica_rss_bytes
from baton.bench.reliability_client import (
    Answer,
    CaseResult,
    Client,
    Tally,
    chat_body,
    error_class,
    reply_text,
    with_one_retry,
)
from baton.bench.reliability_faults import named_actors
from baton.bench.stats import quantile
from baton.paths import REPO_ROOT, SAMPLE_TRACES

ROOT = REPO_ROOT


@dataclass(frozen=True)
class Limits:
    ingress_replicas: int
    max_inflight: int  # per ingress replica

    @property
    def admitted(self) -> int:
        return self.ingress_replicas * self.max_inflight


def long_prompt(words: int) -> list[dict[str, str]]:
    salt = uuid.uuid4().hex  # first tokens differ: nothing comes from the prefix cache
    body = " ".join(f"item{i % 89}" for i in range(words))
    return [{"role": "user", "content": f"[{salt}] Count the items in this list: {body}"}]


class _RSS:
    """Samples the engine and ingress replicas' RSS every second while the load runs."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> dict[str, int]:
        return {d: max(replica_rss_bytes(d), default=0) for d in ("decode", "prefill", "ingress")}

    def _loop(self) -> None:
        while not self._stop.is_set():
            for d, v in self.sample().items():
                self.peak[d] = max(self.peak.get(d, 0), v)
            self._stop.wait(1.0)

    def __enter__(self) -> _RSS:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def overload(url: str, key: str, limits: Limits, duration_s: float, prompt_words: int = 700) -> CaseResult:
    t0 = time.monotonic()
    probe = Client(url, Tally())
    alone = probe.request("POST", "/v1/chat/completions", key=key, json_body=chat_body(long_prompt(prompt_words), 16), what="alone")
    one_s = alone.seconds
    bound_s = 2.0 * limits.admitted * one_s + 5.0
    offered = 2 * limits.admitted
    replicas_before = set(named_actors("SERVE_REPLICA::baton#"))
    answers: list[Answer] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def worker() -> None:
        c = Client(url, Tally())
        while time.monotonic() < stop_at:
            a = c.request("POST", "/v1/chat/completions", key=key, json_body=chat_body(long_prompt(prompt_words), 16), what="overload")
            with lock:
                answers.append(a)
            if not a.ok:  # a refused client honours Retry-After (at most 5 s), as OpenAI's clients do
                try:
                    time.sleep(min(5.0, float(a.headers.get("retry-after", "1"))))
                except ValueError:
                    time.sleep(1.0)
        c.close()

    rss = _RSS()
    base = rss.sample()
    with rss:
        threads = [threading.Thread(target=worker) for _ in range(offered)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    classes = Counter(error_class(a.status) for a in answers)
    statuses = Counter(a.status for a in answers)
    unexpected = {s: n for s, n in statuses.items() if s not in (200, 429, 503)}
    no_retry_after = sum(1 for a in answers if a.status in (429, 503) and "retry-after" not in a.headers)
    refused = statuses.get(429, 0) + statuses.get(503, 0)
    samples = {str(s): next(({"headers": {k: v for k, v in a.headers.items() if k in ("retry-after", "content-type", "x-baton-ingress")},
                              "body": a.text[:200]} for a in answers if a.status == s), None) for s in statuses if s != 200}
    admitted = sorted(a.seconds for a in answers if a.status == 200)
    p50 = quantile(admitted, 0.5) if admitted else float("nan")
    p99 = quantile(admitted, 0.99) if admitted else float("nan")
    grew = {d: (rss.peak.get(d, 0) - base.get(d, 0)) / (1 << 20) for d in base}
    rss_ok = all(rss.peak.get(d, 0) <= base[d] * 1.5 + (512 << 20) for d in base)
    replicas_after = set(named_actors("SERVE_REPLICA::baton#"))
    lost_replicas = replicas_before - replicas_after
    server_errors = classes.get("5xx", 0)
    ok = (not unexpected and no_retry_after == 0 and refused > 0 and bool(admitted) and p99 <= bound_s and rss_ok and not lost_replicas)
    detail = (f"{offered} closed-loop clients (2 x {limits.admitted} admitted) for {duration_s:.0f}s, {prompt_words}-word prompts: "
              f"{len(answers)} requests {dict(sorted((str(k), v) for k, v in statuses.items()))}; Retry-After missing on {no_retry_after}; "
              f"admitted latency p50 {p50:.1f}s p99 {p99:.1f}s (bound {bound_s:.0f}s = 2 x {limits.admitted} x {one_s:.2f}s alone + 5s); "
              f"peak RSS MiB {({d: round(v / (1 << 20)) for d, v in rss.peak.items()})} (+{({d: round(v) for d, v in grew.items()})}); "
              f"replicas lost {sorted(lost_replicas)}; refusals look like {samples}")
    res = CaseResult("overload at 2x admitted concurrency", "overload", ok, 0, server_errors, 0, detail, time.monotonic() - t0,
                     dict(classes))
    res.figures = {"requests": len(answers), "statuses": {str(k): v for k, v in statuses.items()}, "p50_s": p50, "p99_s": p99,
                   "bound_s": bound_s, "alone_s": one_s, "peak_rss_mib": {d: v / (1 << 20) for d, v in rss.peak.items()},
                   "base_rss_mib": {d: v / (1 << 20) for d, v in base.items()}, "refusal_samples": samples}
    return res


# ---- soak ------------------------------------------------------------------------------------------
def _agentic(c: Client, key: str, stop_at: float, lost: list[int]) -> None:
    from baton.traces.format import load_trace

    convs = load_trace(SAMPLE_TRACES / "agentic_small.jsonl")
    i = 0
    while time.monotonic() < stop_at:
        conv = convs[i % len(convs)]
        i += 1
        sid = f"soak-{conv.conversation_id}-{uuid.uuid4().hex[:6]}"
        messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
        for turn in conv.turns:
            if time.monotonic() >= stop_at:
                return
            messages.append({"role": turn.role, "content": turn.content})
            body = chat_body(messages, min(turn.max_tokens, 24))
            out = with_one_retry(lambda body=body, sid=sid: c.request("POST", "/v1/chat/completions", key=key,
                                                                        headers={"x-session-id": sid}, json_body=body, what=sid))
            lost[0] += int(out.lost)
            messages.append({"role": "assistant", "content": reply_text(out.answer) or "ok"})


def _memory(c: Client, key: str, stop_at: float, lost: list[int]) -> None:
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        c.request("POST", "/v1/memories", key=key, json_body={"facts": [f"Soak fact {n}: my favourite number today is {n * 7}."]}, what="soak add")
        out = with_one_retry(lambda: c.request("POST", "/v1/chat/completions", key=key, what="soak recall", json_body=chat_body(
            [{"role": "user", "content": "What is my favourite number today?"}], 12, memories={"k": 3})))
        lost[0] += int(out.lost)
        if n % 5 == 0:
            c.request("GET", "/v1/memories", key=key, what="soak list")


def _realtime(ws_url: str, key: str, stop_at: float, tally: Tally, ws_counts: Counter) -> None:
    from websockets.sync.client import connect

    while time.monotonic() < stop_at:
        try:
            with connect(ws_url, open_timeout=30, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
                ws.send(json.dumps({"type": "session.start", "max_tokens": 6, "tick_ms": 2000}))
                started = json.loads(ws.recv(timeout=120))
                if started.get("type") != "session.started":
                    ws_counts[f"refused:{started.get('code')}"] += 1
                    time.sleep(2)
                    continue
                ws_counts["sessions"] += 1
                for seq in range(6):
                    ws.send(json.dumps({"type": "input", "seq": seq, "text": f"Line {seq}: the weather is changing."}))
                    out = json.loads(ws.recv(timeout=120))
                    ws_counts["ticks" if out.get("type") == "output" else f"tick_error:{out.get('code')}"] += 1
                    time.sleep(0.5)
                ws.send(json.dumps({"type": "session.end"}))
        except Exception as e:  # noqa: BLE001 - counted
            ws_counts[f"ws_error:{type(e).__name__}"] += 1
            time.sleep(2)


def soak(url: str, keys: dict[str, str], duration_s: float, agentic_workers: int = 3) -> CaseResult:
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    tallies = [Tally() for _ in range(agentic_workers + 1)]
    clients = [Client(url, t) for t in tallies]
    lost = [[0] for _ in clients]
    ws_tally, ws_counts = Tally(), Counter()
    ws_url = url.replace("http://", "ws://") + "/v1/realtime"
    threads = [threading.Thread(target=_agentic, args=(clients[i], keys["alice" if i % 2 else "bob"], stop_at, lost[i]))
               for i in range(agentic_workers)]
    threads.append(threading.Thread(target=_memory, args=(clients[-1], keys["alice"], stop_at, lost[-1])))
    threads.append(threading.Thread(target=_realtime, args=(ws_url, keys["bob"], stop_at, ws_tally, ws_counts)))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    classes: Counter = Counter()
    samples: list[str] = []
    for t in tallies:
        classes.update(t.classes)
        samples += t.server_error_samples
    lost_turns = sum(x[0] for x in lost)
    requests = sum(v for k, v in classes.items() if k != "stream_error")
    ws_bad = sum(v for k, v in ws_counts.items() if k.startswith(("ws_error", "tick_error")))
    ok = lost_turns == 0 and classes.get("5xx", 0) == 0 and ws_bad == 0
    detail = (f"{duration_s / 60:.0f} min: {requests} HTTP requests by class {dict(classes)}; realtime {dict(ws_counts)}; "
              f"lost turns {lost_turns}" + (f"; 5xx: {samples[:3]}" if samples else ""))
    res = CaseResult("soak: agentic + memory + realtime", "soak", ok, lost_turns, classes.get("5xx", 0), 0, detail,
                     time.monotonic() - t0, dict(classes))
    res.figures = {"requests": requests, "classes": dict(classes), "realtime": dict(ws_counts), "lost_turns": lost_turns}
    return res
