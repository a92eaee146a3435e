"""Recovery cases of `baton bench reliability`: a stream that outlives its decoder, and a
conversation directory killed in the middle of a replay.

Stream resume (deployments/resume.py): a long greedy stream (max_tokens 200, ignore_eos) loses its
decoder after KILL_AFTER_CHUNKS chunks; the ingress continues it on another decoder, so the client
reads ONE stream that passes judge_stream (200, content, one finish_reason "length", [DONE], no
error event) with all 200 completion tokens, chunks on both sides of the kill, and a resume
counted (`baton_stream_resumes{outcome="resumed"}` in Ray's metrics export, or an ingress's
`stream_resumes` in /baton/stats). Zero client-visible errors: no retry, no error event.

Directory restart (router/directory.py, router/ownership.py): conversations of two users replay
streamed turns; the directory's replica actor is killed mid-replay (Serve replaces it). While it
is down a turn of a conversation is refused with 503 + Retry-After (fail closed: the owner cannot
be checked); clients retry after Retry-After until the turn succeeds. Required: 0 lost turns (each
eventually a judged-ok stream), every 429/503 with Retry-After, the new directory rebuilt the pins
from the decoders' reports, so every later turn of every conversation ran on its original decoder
(x-baton-replica) and the new directory planned 0 handoffs (all its turns are returning ones), and
the other user is still refused (404) on each conversation.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx

from baton.bench.reliability_client import CaseResult, Client, Tally, chat_body, completion_tokens
from baton.bench.reliability_faults import KILL_AFTER_CHUNKS, Cluster, Conversation, KillAt, kill_actor, named_actors, wait_whole
from baton.bench.reliability_verdict import metric_sum

STORY = [{"role": "system", "content": "You are a storyteller."},
         {"role": "user", "content": "Tell me a long story about a lighthouse keeper and a storm."}]
RESUME_TOKENS = 200
DIRECTORY = "SERVE_REPLICA::baton#directory#"
REPLAY_TURNS_BEFORE, REPLAY_TURNS_DURING = 2, 4
TURN_DEADLINE_S = 240.0  # a turn retried after Retry-After for this long before it counts as lost


def _stats(c: Client, key: str) -> dict[str, Any] | None:
    a = c.request("GET", "/baton/stats", key=key, what="stats")
    return a.body if a.status == 200 and isinstance(a.body, dict) else None


def _metric_resumes(metrics_url: str | None) -> float | None:
    if not metrics_url:
        return None
    try:
        r = httpx.get(metrics_url, timeout=30)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    return metric_sum(r.text, "baton_stream_resumes", outcome="resumed")


def _stats_resumes(c: Client, key: str, samples: int = 8) -> list[int]:
    """`resumed` of the ingress replicas that answered `samples` /baton/stats requests (each
    ingress counts its own; the proxy spreads the requests over them)."""
    out = []
    for _ in range(samples):
        s = _stats(c, key)
        if s is not None:
            out.append(int(s.get("ingress", {}).get("stream_resumes", {}).get("resumed", 0)))
    return out


def resume_counted(c: Client, key: str, metrics_url: str | None, metric_before: float | None, stats_before: list[int],
                   timeout_s: float = 60.0) -> str | None:
    """How a new resume showed (None: it did not within timeout_s): Ray's metrics export (summed
    over ingress replicas; exported every few seconds) or an ingress's count above every count
    seen before (counters only grow)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        now = _metric_resumes(metrics_url)
        if now is not None and now > (metric_before or 0.0):
            return f"metrics {metric_before or 0:g} -> {now:g}"
        seen = _stats_resumes(c, key, 4)
        if seen and max(seen) > max(stats_before, default=0):
            return f"/baton/stats {max(stats_before, default=0)} -> {max(seen)}"
        time.sleep(3)
    return None


def stream_resumed(c: Client, cl: Cluster, metrics_url: str | None) -> CaseResult:
    t0 = time.monotonic()
    metric_before = _metric_resumes(metrics_url)
    stats_before = _stats_resumes(c, cl.operator_key)
    kill = KillAt(KILL_AFTER_CHUNKS)
    a = c.stream_chat(chat_body(STORY, RESUME_TOKENS, ignore_eos=True), key=cl.key, sid=f"rel-resume-{uuid.uuid4().hex[:8]}",
                      on_chunk=kill, what="stream whose decoder dies")
    counted = resume_counted(c, cl.operator_key, metrics_url, metric_before, stats_before) if kill.killed else None
    healed = wait_whole(c, cl, gone={kill.killed} if kill.killed else set())
    verdict = a.verdict
    finish = a.stream.finish_reasons if a.stream is not None else []
    ok = (kill.mid_turn and kill.chunks_after > 0 and a.ok and finish == ["length"] and completion_tokens(a) == RESUME_TOKENS
          and counted is not None)
    detail = (f"killed {kill.killed} after {kill.chunks_before} chunks, {kill.chunks_after} chunks after; the client's one stream: "
              f"{verdict}, finish {finish}, {completion_tokens(a)} of {RESUME_TOKENS} completion tokens, {a.seconds:.1f}s; resume counted: "
              f"{counted or 'no'}; answers {dict(c.tally.classes)}; pool whole again after {healed:.0f}s")
    return CaseResult("kill decoder mid-stream: the stream resumes", "faults", ok, int(not a.ok), c.tally.server_errors, 0, detail,
                      time.monotonic() - t0, dict(c.tally.classes), {"chunks_before": kill.chunks_before, "chunks_after": kill.chunks_after})


# ---- directory restart during a replay -------------------------------------------------------------
def directory_killed_during_replay(url: str, cl: Cluster, keys: dict[str, str]) -> CaseResult:
    t0 = time.monotonic()
    users = [u for u in ("alice", "bob") if u in keys]
    convs = [Conversation(Client(url, Tally()), keys[u], f"dir-{u}-{i}") for u in users for i in range(2)]
    for conv in convs:  # each opens its conversation: the first turn pins it (one handoff), the second runs on the pin
        for t in range(REPLAY_TURNS_BEFORE):
            conv.turn(f"Turn {t}: let us plan a trip, step {t}.", stream=True, deadline_s=TURN_DEADLINE_S)
    origin = {conv.sid: conv.replicas[0] for conv in convs}
    time.sleep(2.5)  # more than a routing-stats period (1 s): every decoder's report lists these conversations
    old = set(named_actors(DIRECTORY))
    progress = [0] * len(convs)

    def replay(i: int, conv: Conversation) -> None:
        for t in range(REPLAY_TURNS_DURING):
            conv.turn(f"Turn {REPLAY_TURNS_BEFORE + t}: and then what?", stream=True, deadline_s=TURN_DEADLINE_S)
            progress[i] += 1
            time.sleep(0.3)

    threads = [threading.Thread(target=replay, args=(i, conv)) for i, conv in enumerate(convs)]
    for th in threads:
        th.start()
    wait_until = time.monotonic() + 120
    while min(progress) < 1 and time.monotonic() < wait_until:  # mid-replay: every conversation has had a turn since
        time.sleep(0.1)
    for name in old:
        kill_actor(name)
    t_kill = time.monotonic()
    for th in threads:
        th.join()
    ops = Client(url, Tally())
    healed = wait_whole(ops, cl)
    new = set(named_actors(DIRECTORY))
    for conv in convs:  # each returns once more, after recovery
        conv.turn("One more question after the pause.", stream=True, deadline_s=TURN_DEADLINE_S)
    snap = _stats(ops, cl.operator_key) or {}
    foreign: list[tuple[int | None, str | None]] = []
    leaks = 0
    for conv in convs:  # the other user on each conversation: 404, as for an unknown one
        other = next(k for u, k in keys.items() if u in users and k != conv.key)
        a = ops.request("POST", "/v1/chat/completions", key=other, json_body=chat_body(conv.messages[-2:-1]),
                        headers={"x-session-id": conv.sid}, what="other user on the conversation")
        foreign.append((a.status, a.error_code))
        leaks += int(a.status is not None and 200 <= a.status < 300)
    tallies = [conv.c.tally for conv in convs] + [ops.tally]
    classes: dict[str, int] = {}
    for t in tallies:
        for k, v in t.classes.items():
            classes[k] = classes.get(k, 0) + v
    server_errors = sum(t.server_errors for t in tallies)
    lost = sum(conv.lost for conv in convs)
    moved = sorted({conv.sid for conv in convs for r in conv.replicas[REPLAY_TURNS_BEFORE:] if r is not None and r != origin[conv.sid]})
    refused = sum(1 for conv in convs for o in conv.outcomes for s in o.statuses if s == 503)
    no_retry_after = sum(o.no_retry_after for conv in convs for o in conv.outcomes)
    spanned = sum(1 for conv in convs for at in conv.ended_at if at > t_kill)
    handoffs = snap.get("handoffs_planned_total")
    adopted = (snap.get("totals") or {}).get("pins_adopted", 0)
    replaced = bool(old) and bool(new) and not (old & new)
    ok = (replaced and lost == 0 and not moved and handoffs == 0 and int(snap.get("turns_total", 0)) >= len(convs) and spanned > 0
          and no_retry_after == 0 and all(f == (404, "conversation_not_found") for f in foreign) and leaks == 0)
    detail = (f"{len(convs)} conversations of {users}, {REPLAY_TURNS_BEFORE} turns each, then {REPLAY_TURNS_DURING} streamed turns each "
              f"with the directory killed after every conversation's first ({sorted(old)} -> {sorted(new)}); turns ending after the kill "
              f"{spanned}; 503s retried {refused} (without Retry-After {no_retry_after}); lost {lost}; conversations whose decoder changed "
              f"{len(moved)} {moved[:2]}; the new directory: {snap.get('turns_total')} turns, {handoffs} handoffs planned, {adopted} pins "
              f"adopted; other user on each conversation {foreign}; answers {classes}; whole again {healed:.0f}s after the replay")
    res = CaseResult("kill conversation directory during a replay", "faults", ok, lost, server_errors, leaks, detail, time.monotonic() - t0,
                     classes)
    res.figures = {"decoders": {conv.sid: conv.replicas for conv in convs}, "origin": origin, "retried_503": refused,
                   "new_directory": {k: snap.get(k) for k in ("turns_total", "handoffs_planned_total", "live_pins")}, "pins_adopted": adopted}
    for client in [conv.c for conv in convs] + [ops]:
        client.close()
    return res
