"""HTTP side of `baton bench reliability`: one answer type, the error classes every request is
tallied under, and a turn that is retried once on a retryable failure (503, 429, a dropped
connection, an in-stream `service_unavailable` event) — a turn without a 200 after that is lost.

Error classes: 2xx, 4xx (any 400-499 but 429), 429, 503, 5xx (any other status >= 500: a server
error), connection (no HTTP answer). `server_errors` of the bench: the 5xx class of every request
it sends (all should succeed or be refused with 4xx/429/503), plus, in the bad-input cases, a 503
for a request that should have been a 4xx (it tells the client to retry what can never succeed).

A streamed answer is judged by one rule (reliability_verdict.judge_stream): 200, content, one
finish_reason, [DONE], no error event; a stream cut without [DONE] is retryable, like a dropped
connection (class `stream_cut`).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from baton.bench.reliability_verdict import CaseResult as CaseResult  # re-exported: the cases import it from here
from baton.bench.reliability_verdict import StreamSeen, StreamVerdict, judge_stream

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
    stream: StreamSeen | None = None  # set for a streamed answer: what the client read

    @property
    def verdict(self) -> StreamVerdict | None:
        """judge_stream's verdict for a streamed answer (None: not streamed)."""
        return judge_stream(self.status, self.stream) if self.stream is not None else None

    @property
    def ok(self) -> bool:
        if self.status != 200 or self.stream_error is not None:
            return False
        v = self.verdict
        return v is None or v.ok

    @property
    def retryable(self) -> bool:
        if self.status in (None, 429, 503):
            return True
        if self.stream_error is not None:
            return self.stream_error.get("type") == "service_unavailable"
        return self.status == 200 and self.stream is not None and self.stream.cut

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
        elif a.status == 200 and a.stream is not None and not a.ok:
            self.classes["stream_cut" if a.stream.cut else "stream_bad"] += 1
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

    def request(self, method: str, path: str, *, key: str | None = None, json_body: Any = None, content: Any = None,
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

    def stream_chat(self, body: dict[str, Any], *, key: str | None, sid: str | None, on_chunk: Callable[[int, dict[str, str]], None] | None = None,
                    what: str = "", headers: dict[str, str] | None = None) -> Answer:
        """A streaming chat request, read to the end. on_chunk(n, response headers) is called after
        the n-th content chunk (fault injection hooks in there). The answer's `stream` is what was
        read; its body mirrors a non-streamed one (choices[0].message.content, usage)."""
        h = dict(headers or {})
        if key:
            h["authorization"] = f"Bearer {key}"
        if sid:
            h["x-session-id"] = sid
        t0 = time.monotonic()
        seen = StreamSeen()
        resp_headers: dict[str, str] = {}
        try:
            with self._http.stream("POST", f"{self.url}/v1/chat/completions", json={**body, "stream": True,
                                   "stream_options": {"include_usage": True}}, headers=h) as r:
                resp_headers = dict(r.headers)
                if r.status_code != 200:
                    raw = r.read().decode(errors="replace")
                    try:
                        parsed = json.loads(raw)
                    except ValueError:
                        parsed = None
                    return self.tally.add(Answer(r.status_code, parsed, raw, resp_headers, time.monotonic() - t0), what)
                for line in r.iter_lines():
                    if seen.feed(line) is not None and on_chunk is not None:
                        on_chunk(len(seen.texts), resp_headers)
        except httpx.HTTPError as e:
            if not seen.texts:  # nothing arrived: a connection failure
                return self.tally.add(Answer(None, None, f"{type(e).__name__}: {e}", resp_headers, time.monotonic() - t0), what)
            # cut mid-stream: a 200 whose stream never finished (seen.cut)
        body_out = {"choices": [{"message": {"role": "assistant", "content": seen.text},
                                 "finish_reason": seen.finish_reasons[-1] if seen.finish_reasons else None}], "usage": seen.usage}
        return self.tally.add(Answer(200, body_out, seen.text, resp_headers, time.monotonic() - t0, stream_error=seen.error, stream=seen), what)


@dataclass
class TurnOutcome:
    answer: Answer
    attempts: int
    lost: bool
    statuses: list[int | None] = field(default_factory=list)  # every attempt's status, in order
    no_retry_after: int = 0  # 429/503 answers without a Retry-After header


def retry_wait_s(a: Answer, default_s: float = 1.0, cap_s: float = 5.0) -> float:
    """How long a client waits before retrying `a`: its Retry-After (at most cap_s), else default_s."""
    try:
        return max(0.0, min(cap_s, float(a.headers.get("retry-after", default_s))))
    except ValueError:
        return default_s


def retry_until(send: Callable[[], Answer], deadline_s: float, *, sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> TurnOutcome:
    """send() until it succeeds, retrying retryable answers after their Retry-After, for at most
    deadline_s; a non-retryable failure ends it at once. Lost: no success by then."""
    end = clock() + deadline_s
    statuses: list[int | None] = []
    missing = 0
    while True:
        a = send()
        statuses.append(a.status)
        missing += int(a.status in (429, 503) and "retry-after" not in a.headers)
        if a.ok or not a.retryable:
            break
        wait = retry_wait_s(a)
        if clock() + wait >= end:
            break
        sleep(wait)
    return TurnOutcome(a, len(statuses), not a.ok, statuses, missing)


def with_one_retry(send: Any, pause_s: float = 1.0) -> TurnOutcome:
    """send() -> Answer; retried once (after Retry-After, at most 5 s) when the first answer is
    retryable. Lost: no 200 after that."""
    a = send()
    if a.ok or not a.retryable:
        return TurnOutcome(a, 1, not a.ok, [a.status])
    time.sleep(retry_wait_s(a, pause_s))
    b = send()
    return TurnOutcome(b, 2, not b.ok, [a.status, b.status])


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


def cached_tokens(a: Answer) -> int:
    try:
        return int((a.body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (TypeError, KeyError, AttributeError, ValueError):
        return 0


def completion_tokens(a: Answer) -> int:
    try:
        return int(a.body["usage"]["completion_tokens"])
    except (TypeError, KeyError, ValueError):
        return 0
