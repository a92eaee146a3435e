"""HTTP side of `baton bench reliability`: one answer type, the error classes every request is
tallied under, and a turn that is retried once on a retryable failure (503, 429, a dropped
connection, an in-stream `service_unavailable` event) — a turn without a 200 after that is lost.

Error classes: 2xx, 4xx (any 400-499 but 429), 429, 503, 5xx (any other status >= 500: a server
error), connection (no HTTP answer). `server_errors` of the bench: the 5xx class of every request
it sends (all should succeed or be refused with 4xx/429/503), plus, in the bad-input cases, a 503
for a request that should have been a 4xx (it tells the client to retry what can never succeed).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

TIMEOUT_S = 300.0


@dataclass
class Answer:
    """What the client saw for one request (status None: no HTTP answer at all)."""

    status: int | None
    body: Any
    text: str
    headers: dict[str, str]
    seconds: float
    stream_error: dict[str, Any] | None = None  # an in-stream error event after a 200

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.stream_error is None

    @property
    def retryable(self) -> bool:
        if self.status in (None, 429, 503):
            return True
        return self.stream_error is not None and self.stream_error.get("type") == "service_unavailable"

    @property
    def error_code(self) -> str | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err.get("code") if isinstance(err, dict) else None

    def openai_error(self) -> bool:
        """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) and isinstance(err["message"], str)


def error_class(status: int | None) -> str:
    if status is None:
        return "connection"
    if 200 <= status < 300:
        return "2xx"
    if status in (429, 503):
        return str(status)
    if 400 <= status < 500:
        return "4xx"
    return "5xx" if status >= 500 else "other"


@dataclass
class Tally:
    """Every answer of a case, by error class; 5xx answers are kept (status + body) for the report."""

    classes: Counter = field(default_factory=Counter)
    server_error_samples: list[str] = field(default_factory=list)

    def add(self, a: Answer, what: str) -> Answer:
        self.classes[error_class(a.status)] += 1
        if a.stream_error is not None:
            self.classes["stream_error"] += 1
            if a.stream_error.get("type") != "service_unavailable":
                self.classes["5xx"] += 1  # an in-stream internal error is a server error
                self.server_error_samples.append(f"{what}: in-stream {a.stream_error}"[:300])
        if error_class(a.status) == "5xx":
            self.server_error_samples.append(f"{what}: {a.status} {a.text[:200]}")
        return a

    @property
    def server_errors(self) -> int:
        return self.classes["5xx"]


class Client:
    """Requests to the ingress with an API key (or none), each tallied."""

    def __init__(self, url: str, tally: Tally, timeout_s: float = TIMEOUT_S):
        self.url = url
        self.tally = tally
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, key: str | None = None, json_body: Any = None, content: bytes | None = None,
                headers: dict[str, str] | None = None, params: dict[str, Any] | None = None, what: str = "") -> Answer:
        h = dict(headers or {})
        if key is not None:
            h["authorization"] = f"Bearer {key}"
        if content is not None:
            h.setdefault("content-type", "application/json")
        t0 = time.monotonic()
        try:
            r = self._http.request(method, f"{self.url}{path}", json=json_body, content=content, headers=h, params=params)
        except httpx.HTTPError as e:
            return self.tally.add(Answer(None, None, f"{type(e).__name__}: {e}", {}, time.monotonic() - t0), what or path)
        try:
            body = r.json()
        except ValueError:
            body = None
        return self.tally.add(Answer(r.status_code, body, r.text, dict(r.headers), time.monotonic() - t0), what or path)

    def stream_chat(self, body: dict[str, Any], *, key: str | None, sid: str | None, on_first_token: Any = None, what: str = "") -> Answer:
        """A streaming chat request, read to the end; on_first_token() is called once the first
        content chunk arrives (fault injection hooks in there)."""
        h = {"authorization": f"Bearer {key}"} if key else {}
        if sid:
            h["x-session-id"] = sid
        t0 = time.monotonic()
        texts: list[str] = []
        usage: dict[str, Any] | None = None
        err: dict[str, Any] | None = None
        try:
            with self._http.stream("POST", f"{self.url}/v1/chat/completions", json={**body, "stream": True,
                                   "stream_options": {"include_usage": True}}, headers=h) as r:
                headers = dict(r.headers)
                if r.status_code != 200:
                    raw = r.read().decode(errors="replace")
                    try:
                        parsed = json.loads(raw)
                    except ValueError:
                        parsed = None
                    return self.tally.add(Answer(r.status_code, parsed, raw, headers, time.monotonic() - t0), what)
                fired = False
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        err = ev["error"]
                        continue
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for c in ev.get("choices", []):
                        t = (c.get("delta") or {}).get("content")
                        if t:
                            texts.append(t)
                            if not fired and on_first_token is not None:
                                fired = True
                                on_first_token()
        except httpx.HTTPError as e:
            return self.tally.add(Answer(None, None, f"{type(e).__name__}: {e}", {}, time.monotonic() - t0), what)
        body_out = {"choices": [{"message": {"role": "assistant", "content": "".join(texts)}}], "usage": usage}
        return self.tally.add(Answer(200, body_out, "".join(texts), headers, time.monotonic() - t0, stream_error=err), what)


@dataclass
class TurnOutcome:
    answer: Answer
    attempts: int
    lost: bool


def with_one_retry(send: Any, pause_s: float = 1.0) -> TurnOutcome:
    """send() -> Answer; retried once (after Retry-After, at most 5 s) when the first answer is
    retryable. Lost: no 200 after that."""
    a = send()
    if a.ok or not a.retryable:
        return TurnOutcome(a, 1, not a.ok)
    try:
        wait = min(5.0, float(a.headers.get("retry-after", pause_s)))
    except ValueError:
        wait = pause_s
    time.sleep(wait)
    b = send()
    return TurnOutcome(b, 2, not b.ok)


def chat_body(messages: list[dict[str, str]], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def reply_text(a: Answer) -> str:
    try:
        return a.body["choices"][0]["message"]["content"] or ""
    except (TypeError, KeyError, IndexError):
        return ""


def prompt_tokens(a: Answer) -> int:
    try:
        return int(a.body["usage"]["prompt_tokens"])
    except (TypeError, KeyError, ValueError):
        return 0


@dataclass
class CaseResult:
    """One case of the bench: what it checked, whether it held, and its counts."""

    name: str
    category: str  # faults | overload | bad_input | security | soak
    passed: bool
    lost_turns: int
    server_errors: int
    isolation_leaks: int
    detail: str
    seconds: float
    answers: dict[str, int] = field(default_factory=dict)  # requests by error class
    figures: dict[str, Any] = field(default_factory=dict)  # measured numbers behind the verdict
