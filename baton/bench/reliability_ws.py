"""WebSocket cases of `baton bench reliability` (/v1/realtime, deployments/realtime_api.py):
malformed frames, a silent client, a flooding client and one user's session cap.

What the server promises: a frame that is not JSON text (or holds a lone surrogate) → error frame
+ close 1007, a malformed one → 1008, one over realtime.max_frame_bytes → `frame_too_large` +
1009; a client silent for realtime.idle_timeout_s → `idle_timeout` + 4408; more than
realtime.max_sessions_per_user live sessions of one user at one ingress → `too_many_sessions` +
1008. A flood of valid frames is served in order, and the server stays healthy for others.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from baton.bench.cluster import replica_rss_bytes
from baton.bench.reliability_client import CaseResult, Client, Tally, chat_body

CLOSE_POLICY, CLOSE_BAD_DATA, CLOSE_TOO_BIG, CLOSE_IDLE = 1008, 1007, 1009, 4408
BURST_FRAMES, BURST_READ_S = 100, 5.0


@contextmanager
def ws_connect(ws_url: str, key: str | None) -> Iterator[Any]:
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {key}"} if key else None
    with connect(ws_url, open_timeout=30, close_timeout=5, additional_headers=headers) as ws:
        yield ws


def until_closed(ws: Any, timeout_s: float) -> tuple[str | None, int | str | None]:
    """Read until the server closes: (the last error frame's code, the close code); the close
    code is "timeout" when the server neither closed nor sent anything for timeout_s."""
    from websockets.exceptions import ConnectionClosed

    code: str | None = None
    try:
        while True:
            frame = json.loads(ws.recv(timeout=timeout_s))
            if isinstance(frame, dict) and frame.get("type") == "error":
                code = frame.get("code")
    except ConnectionClosed as e:
        return code, e.rcvd.code if e.rcvd else None
    except TimeoutError:
        return code, "timeout"


def _start(ws: Any, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    ws.send(json.dumps({"type": "session.start", "max_tokens": max_tokens, **extra}))
    return json.loads(ws.recv(timeout=120))


def malformed_ws_frames(ws_url: str, key: str) -> CaseResult:
    """Each malformed frame gets an error frame and a 1007/1008 close; no key is refused (1008)."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    t0 = time.monotonic()
    seen: list[str] = []
    ok = True
    for frame, want_code, want_close in (("not json", "invalid_frame", 1007), (json.dumps({"type": "input"}), "invalid_frame", 1008),
                                         (json.dumps({"type": "session.start", "max_tokens": 10_000}), "invalid_value", 1008),
                                         (b"\x00\xff binary", "invalid_frame", 1007), (json.dumps([1, 2]), "invalid_frame", 1008),
                                         ('{"type": "session.start", "instructions": "\\ud800"}', "invalid_frame", 1007)):
        got_code: Any = None
        got_close: Any = None
        try:
            with ws_connect(ws_url, key) as ws:
                ws.send(frame)
                got_code, got_close = until_closed(ws, 30)
        except Exception as e:  # noqa: BLE001 - reported
            got_code = f"{type(e).__name__}"
        seen.append(f"{frame[:20]!r}->{got_code}/{got_close}")
        ok &= got_code == want_code and got_close == want_close
    try:  # a binary frame in the middle of a started session
        with ws_connect(ws_url, key) as ws:
            started = _start(ws, 4)
            ws.send(b"\x00\x01")
            mid = json.loads(ws.recv(timeout=60))
            seen.append(f"mid-session binary->{mid.get('code')} (started: {started.get('type')})")
            ok &= started.get("type") == "session.started" and mid.get("code") == "invalid_frame"
    except Exception as e:  # noqa: BLE001
        seen.append(f"mid-session: {type(e).__name__}: {e}")
        ok = False
    close: Any = None
    try:  # no API key: refused with a policy close
        with ws_connect(ws_url, None) as ws:
            ws.send(json.dumps({"type": "session.start"}))
            ws.recv(timeout=30)
    except ConnectionClosed as e:
        close = e.rcvd.code if e.rcvd else None
    except InvalidStatus as e:  # the handshake itself refused (closed before accept: HTTP 403)
        close = f"HTTP {e.response.status_code}"
    except Exception as e:  # noqa: BLE001 - reported
        close = type(e).__name__
    seen.append(f"no key->{close}")
    ok &= close in (1008, "HTTP 401", "HTTP 403")
    return CaseResult("bad input: malformed WebSocket frames", "bad_input", ok, 0, 0, 0, "; ".join(seen), time.monotonic() - t0)


def idle_ws_closed(ws_url: str, key: str, idle_s: float) -> CaseResult:
    """Two silent clients, one before session.start and one in a started session: each gets
    `idle_timeout` and close 4408 after idle_s (not before, and not much later)."""
    t0 = time.monotonic()
    got: dict[str, tuple[Any, Any, float]] = {}

    def silent(name: str, start_first: bool) -> None:
        try:
            with ws_connect(ws_url, key) as ws:
                started = _start(ws) if start_first else {"type": "session.started"}
                t = time.monotonic()
                code, close = until_closed(ws, idle_s + 60)
                got[name] = (code if started.get("type") == "session.started" else f"not started: {started}", close, time.monotonic() - t)
        except Exception as e:  # noqa: BLE001 - reported
            got[name] = (f"{type(e).__name__}: {e}"[:120], None, 0.0)

    threads = [threading.Thread(target=silent, args=("before start", False)), threading.Thread(target=silent, args=("in session", True))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = len(got) == 2 and all(code == "idle_timeout" and close == CLOSE_IDLE and idle_s - 1.0 <= s <= idle_s + 15.0
                               for code, close, s in got.values())
    detail = f"idle timeout {idle_s:g}s: " + "; ".join(f"{k}: {c}/{cl} after {s:.1f}s" for k, (c, cl, s) in got.items())
    return CaseResult("bad input: idle WebSocket closed (4408)", "bad_input", ok, 0, 0, 0, detail, time.monotonic() - t0)


def _healthy(url: str, ws_url: str, key: str) -> tuple[bool, str]:
    """/health ok, a fresh session's first tick answered, a small chat answered: the server still serves."""
    c = Client(url, Tally())
    health = c.request("GET", "/health", what="health").status
    tick_s: float | None = None
    try:
        with ws_connect(ws_url, key) as ws:
            t = time.monotonic()
            started = _start(ws)
            ws.send(json.dumps({"type": "input", "seq": 0, "text": "Are you still there?"}))
            out = json.loads(ws.recv(timeout=120))
            if started.get("type") == "session.started" and out.get("type") == "output":
                tick_s = time.monotonic() - t
            ws.send(json.dumps({"type": "session.end"}))
    except Exception:  # noqa: BLE001 - counted as not healthy
        tick_s = None
    chat = c.request("POST", "/v1/chat/completions", key=key, json_body=chat_body([{"role": "user", "content": "Still up?"}], 4), what="chat")
    c.close()
    ok = health == 200 and tick_s is not None and tick_s <= 60.0 and chat.ok
    return ok, f"after: /health {health}, a fresh session's first tick {'-' if tick_s is None else f'{tick_s:.1f}s'}, chat {chat.status}"


def flooding_ws(ws_url: str, url: str, key: str, max_frame_bytes: int) -> CaseResult:
    """Frames over max_frame_bytes (first frame, mid-session text, mid-session binary) → error
    frame + 1009; a burst of BURST_FRAMES valid inputs is answered in order (none dropped or
    reordered) while it is read; afterwards the server serves others and the ingress's memory
    did not balloon."""
    t0 = time.monotonic()
    seen: list[str] = []
    ok = True
    big = json.dumps({"type": "input", "seq": 0, "text": "x" * (max_frame_bytes + 1024)})
    rss_before = max(replica_rss_bytes("ingress"), default=0)
    for label, in_session, frame in (("oversized first frame", False, big), ("oversized text mid-session", True, big),
                                     ("oversized binary mid-session", True, b"\x00" * (max_frame_bytes + 1024))):
        try:
            with ws_connect(ws_url, key) as ws:
                if in_session and _start(ws).get("type") != "session.started":
                    raise RuntimeError("session not started")
                ws.send(frame)
                code, close = until_closed(ws, 60)
        except Exception as e:  # noqa: BLE001 - reported
            code, close = f"{type(e).__name__}", None
        seen.append(f"{label}->{code}/{close}")
        ok &= code == "frame_too_large" and close == CLOSE_TOO_BIG
    seqs: list[int] = []
    errors: list[str] = []
    sent = [0]
    try:
        with ws_connect(ws_url, key) as ws:
            if _start(ws, 1).get("type") != "session.started":
                raise RuntimeError("session not started")

            def send_all() -> None:
                try:
                    for i in range(BURST_FRAMES):
                        ws.send(json.dumps({"type": "input", "seq": i, "text": f"burst {i}"}))
                        sent[0] += 1
                except Exception:  # noqa: BLE001 - the connection closed under it: counted by `sent`
                    pass

            sender = threading.Thread(target=send_all, daemon=True)
            sender.start()
            stop = time.monotonic() + BURST_READ_S
            while time.monotonic() < stop and len(seqs) + len(errors) < BURST_FRAMES:  # all answered: done (before any idle timeout)
                try:
                    frame = json.loads(ws.recv(timeout=max(0.1, stop - time.monotonic())))
                except TimeoutError:
                    break
                if frame.get("type") == "output":
                    seqs.append(int(frame.get("seq", -1)))
                else:
                    errors.append(str(frame.get("code")))
        sender.join(timeout=10)
    except Exception as e:  # noqa: BLE001 - reported
        errors.append(f"{type(e).__name__}: {e}"[:120])
    in_order = bool(seqs) and seqs == list(range(len(seqs)))
    seen.append(f"burst of {BURST_FRAMES} inputs: {sent[0]} sent, {len(seqs)} answered (read for at most {BURST_READ_S:g}s), in order {in_order}, "
                f"errors {errors[:3]}")
    ok &= in_order and not errors
    healthy, how = _healthy(url, ws_url, key)
    rss_after = max(replica_rss_bytes("ingress"), default=0)
    grew_mib = (rss_after - rss_before) / (1 << 20)
    seen.append(f"{how}; ingress RSS +{grew_mib:.0f} MiB")
    ok &= healthy and grew_mib < 256
    return CaseResult("bad input: flooding WebSocket (1009, bounded)", "bad_input", ok, 0, 0, 0, "; ".join(seen), time.monotonic() - t0,
                      figures={"answered": len(seqs), "sent": sent[0], "ingress_rss_growth_mib": grew_mib})


def session_cap_ws(ws_url: str, key: str, per_user: int, ingress_replicas: int) -> CaseResult:
    """One user opens per_user x ingress_replicas + 1 sessions at once (held open): at least one
    is refused with `too_many_sessions` + 1008 (pigeonhole: some ingress sees per_user + 1), none
    beyond per_user per ingress is admitted, and once they end the user may open one again."""
    t0 = time.monotonic()
    n = per_user * ingress_replicas + 1
    release = threading.Event()
    replies: list[tuple[str, Any, Any]] = []  # (first frame type or error code, close code, start seconds)
    lock = threading.Lock()

    def one() -> None:
        reply: tuple[str, Any, Any] | None = None
        try:
            with ws_connect(ws_url, key) as ws:
                t = time.monotonic()
                first = _start(ws, 1)
                took = time.monotonic() - t
                if first.get("type") == "session.started":
                    with lock:
                        replies.append(reply := ("started", None, took))
                    release.wait(120)
                    ws.send(json.dumps({"type": "session.end"}))
                    return
                _, close = until_closed(ws, 30)
                with lock:
                    replies.append(reply := (str(first.get("code")), close, took))
        except Exception as e:  # noqa: BLE001 - reported (once: a held session closed under us is not a second reply)
            if reply is None:
                with lock:
                    replies.append((f"{type(e).__name__}", None, 0.0))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 150
    while len(replies) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    release.set()
    for th in threads:
        th.join(timeout=60)
    admitted = sum(1 for r in replies if r[0] == "started")
    capped = sum(1 for r in replies if r[0] == "too_many_sessions" and r[1] == CLOSE_POLICY)
    other = [r[:2] for r in replies if r[0] not in ("started", "too_many_sessions")]
    time.sleep(1.0)  # the ended sessions give their slots back
    again: Any = None
    try:
        with ws_connect(ws_url, key) as ws:
            again = _start(ws, 1).get("type")
            ws.send(json.dumps({"type": "session.end"}))
    except Exception as e:  # noqa: BLE001 - reported
        again = type(e).__name__
    ok = len(replies) == n and capped >= 1 and admitted <= per_user * ingress_replicas and not other and again == "session.started"
    took = [r[2] for r in replies if r[0] == "started"]
    detail = (f"{n} sessions at once for one user (cap {per_user} per ingress x {ingress_replicas}): {admitted} admitted "
              f"(median start {statistics.median(took) if took else float('nan'):.1f}s), {capped} refused too_many_sessions/1008, "
              f"other {other}; after they ended: {again}")
    return CaseResult("bad input: per-user WebSocket session cap (1008)", "bad_input", ok, 0, 0, 0, detail, time.monotonic() - t0)
