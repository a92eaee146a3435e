"""Overload and soak cases of `baton bench reliability`.

Overload: closed-loop clients at twice the admitted concurrency (ingress replicas ×
ingress.max_inflight_requests), each sending long, never-cached prompts. Only 200 / 429 / 503
may come back, every 429/503 with Retry-After, the limits must actually be reached, the p99
latency of admitted requests stays under a bound derived from the unloaded latency — the median
of CALIBRATION_PROBES requests sent one at a time in the same run, just before the load (never
one probe alone: one probe is only as steady as the machine at that second) — and replica memory
(RSS) stays bounded with no replica lost.

Soak (full mode): agentic multi-turn conversations (baton/traces/samples/agentic_small.jsonl; one
worker streams its turns, judged by reliability_verdict.judge_stream), memory chats and real-time
WebSocket sessions together for a fixed time; every answer is classed and every turn retried once
on a retryable failure. It passes only if real-time sessions did run (every one of their ticks
answered) and every fact the memory worker added is listed by GET /v1/memories at the end.
"""
from __future__ import annotations

import json
import statistics
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
CALIBRATION_PROBES = 5


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


def calibrate(url: str, key: str, prompt_words: int, probes: int = CALIBRATION_PROBES) -> list[float]:
    """A warm-up request (discarded), then `probes` requests one at a time on the idle cluster:
    their latencies. Raises if any fails (an unloaded cluster must answer)."""
    c = Client(url, Tally())
    send = lambda what: c.request("POST", "/v1/chat/completions", key=key, json_body=chat_body(long_prompt(prompt_words), 16), what=what)
    send("warm-up")
    got = [send("alone") for _ in range(probes)]
    c.close()
    bad = [a.status for a in got if not a.ok]
    if bad:
        raise RuntimeError(f"calibration failed on an idle cluster: {bad}")
    return [a.seconds for a in got]


def overload(url: str, key: str, limits: Limits, duration_s: float, prompt_words: int = 700) -> CaseResult:
    t0 = time.monotonic()
    probes = calibrate(url, key, prompt_words)
    one_s = statistics.median(probes)
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
              f"admitted latency p50 {p50:.1f}s p99 {p99:.1f}s (bound {bound_s:.0f}s = 2 x {limits.admitted} x {one_s:.2f}s, the median of "
              f"{len(probes)} requests alone {[round(p, 2) for p in probes]}, + 5s); "
              f"peak RSS MiB {({d: round(v / (1 << 20)) for d, v in rss.peak.items()})} (+{({d: round(v) for d, v in grew.items()})}); "
              f"replicas lost {sorted(lost_replicas)}; refusals look like {samples}")
    res = CaseResult("overload at 2x admitted concurrency", "overload", ok, 0, server_errors, 0, detail, time.monotonic() - t0,
                     dict(classes))
    res.figures = {"requests": len(answers), "statuses": {str(k): v for k, v in statuses.items()}, "p50_s": p50, "p99_s": p99,
                   "bound_s": bound_s, "alone_s": one_s, "alone_probes_s": probes, "peak_rss_mib": {d: v / (1 << 20) for d, v in rss.peak.items()},
                   "base_rss_mib": {d: v / (1 << 20) for d, v in base.items()}, "refusal_samples": samples}
    return res


# ---- soak ------------------------------------------------------------------------------------------
def _agentic(c: Client, key: str, stop_at: float, lost: list[int], stream: bool = False) -> None:
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
            if stream:  # ignore_eos: every streamed turn has content to judge
                body = chat_body(messages, min(turn.max_tokens, 24), ignore_eos=True)
                send = lambda body=body, sid=sid: c.stream_chat(body, key=key, sid=sid, what=f"{sid} stream")
            else:
                body = chat_body(messages, min(turn.max_tokens, 24))
                send = lambda body=body, sid=sid: c.request("POST", "/v1/chat/completions", key=key, headers={"x-session-id": sid},
                                                            json_body=body, what=sid)
            out = with_one_retry(send)
            lost[0] += int(out.lost)
            messages.append({"role": "assistant", "content": reply_text(out.answer) or "ok"})


def _memory(c: Client, key: str, stop_at: float, lost: list[int], added: list[str]) -> None:
    """Add a fact (Idempotency-Key: a retried add adds it once), recall; `added` collects every
    fact the store acknowledged; an add refused even after its retry is a lost turn."""
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        fact = f"Soak fact {n} ({uuid.uuid4().hex[:6]}): my favourite number today is {n * 7}."
        idem = {"Idempotency-Key": f"soak-{uuid.uuid4().hex}"}
        add = with_one_retry(lambda fact=fact, idem=idem: c.request("POST", "/v1/memories", key=key, json_body={"facts": [fact]},
                                                                     headers=idem, what="soak add"))
        lost[0] += int(add.lost)
        if add.answer.ok:
            added.append(fact)
        out = with_one_retry(lambda: c.request("POST", "/v1/chat/completions", key=key, what="soak recall", json_body=chat_body(
            [{"role": "user", "content": "What is my favourite number today?"}], 12, memories={"k": 3})))
        lost[0] += int(out.lost)
        if n % 5 == 0:
            c.request("GET", "/v1/memories", key=key, what="soak list")


def listed_facts(c: Client, key: str, page: int = 1000) -> set[str] | None:
    """Every fact GET /v1/memories lists for the key's user, page by page (None: a page failed)."""
    out: set[str] = set()
    offset = 0
    while True:
        a = with_one_retry(lambda offset=offset: c.request("GET", "/v1/memories", key=key, params={"limit": page, "offset": offset},
                                                           what="soak final list")).answer
        if not a.ok:
            return None
        data = a.body["data"]
        out.update(f["text"] for f in data)
        if len(data) < page:
            return out
        offset += page


def _realtime(ws_url: str, key: str, stop_at: float, tally: Tally, ws_counts: Counter, ticks: int = 6) -> None:
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
                for seq in range(ticks):
                    ws.send(json.dumps({"type": "input", "seq": seq, "text": f"Line {seq}: the weather is changing."}))
                    out = json.loads(ws.recv(timeout=120))
                    good = out.get("type") == "output" and out.get("seq") == seq
                    ws_counts["ticks" if good else f"tick_error:{out.get('code') or out.get('type')}"] += 1
                    time.sleep(0.5)
                ws.send(json.dumps({"type": "session.end"}))
                ws_counts["sessions_ended"] += 1
        except Exception as e:  # noqa: BLE001 - counted
            ws_counts[f"ws_error:{type(e).__name__}"] += 1
            time.sleep(2)


def soak_verdict(lost_turns: int, server_errors: int, ws_counts: Counter, added: list[str], listed: set[str] | None,
                 ticks_per_session: int = 6) -> tuple[bool, list[str]]:
    """Pure: whether the soak held, and why not. Real-time sessions must have run and each ended
    with all its ticks answered; every acknowledged fact must be listed at the end."""
    why: list[str] = []
    if lost_turns:
        why.append(f"{lost_turns} lost turns")
    if server_errors:
        why.append(f"{server_errors} server errors")
    bad_ws = {k: v for k, v in ws_counts.items() if k.startswith(("ws_error", "tick_error"))}
    if bad_ws:
        why.append(f"real-time failures {bad_ws}")
    if ws_counts.get("sessions_ended", 0) < 1:
        why.append("no real-time session completed")
    elif ws_counts.get("ticks", 0) < ticks_per_session * ws_counts["sessions_ended"]:
        why.append(f"{ws_counts.get('ticks', 0)} ticks for {ws_counts['sessions_ended']} completed sessions of {ticks_per_session}")
    if not added:
        why.append("no fact added")
    if listed is None:
        why.append("the final list of facts failed")
    elif set(added) - listed:
        why.append(f"{len(set(added) - listed)} of {len(added)} added facts missing from GET /v1/memories")
    return not why, why


def soak(url: str, keys: dict[str, str], duration_s: float, agentic_workers: int = 3) -> CaseResult:
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    tallies = [Tally() for _ in range(agentic_workers + 1)]
    clients = [Client(url, t) for t in tallies]
    lost = [[0] for _ in clients]
    added: list[str] = []
    ws_tally, ws_counts = Tally(), Counter()
    ws_url = url.replace("http://", "ws://") + "/v1/realtime"
    threads = [threading.Thread(target=_agentic, args=(clients[i], keys["alice" if i % 2 else "bob"], stop_at, lost[i], i == 0))
               for i in range(agentic_workers)]
    threads.append(threading.Thread(target=_memory, args=(clients[-1], keys["alice"], stop_at, lost[-1], added)))
    threads.append(threading.Thread(target=_realtime, args=(ws_url, keys["bob"], stop_at, ws_tally, ws_counts)))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    listed = listed_facts(clients[-1], keys["alice"])
    classes: Counter = Counter()
    samples: list[str] = []
    for t in tallies:
        classes.update(t.classes)
        samples += t.server_error_samples
    lost_turns = sum(x[0] for x in lost)
    requests = sum(v for k, v in classes.items() if not k.startswith("stream_"))
    ok, why = soak_verdict(lost_turns, classes.get("5xx", 0), ws_counts, added, listed)
    detail = (f"{duration_s / 60:.0f} min: {requests} HTTP requests by class {dict(classes)}; realtime {dict(ws_counts)}; "
              f"lost turns {lost_turns}; facts added {len(added)}, listed at the end {len(set(added) & (listed or set()))}"
              + (f"; failed: {why}" if why else "") + (f"; 5xx: {samples[:3]}" if samples else ""))
    res = CaseResult("soak: agentic + memory + realtime", "soak", ok, lost_turns, classes.get("5xx", 0), 0, detail,
                     time.monotonic() - t0, dict(classes))
    res.figures = {"requests": requests, "classes": dict(classes), "realtime": dict(ws_counts), "lost_turns": lost_turns,
                   "facts_added": len(added), "facts_missing": len(set(added) - (listed or set()))}
    for cl in clients:
        cl.close()
    return res
