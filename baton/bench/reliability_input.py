"""Bad-input and isolation cases of `baton bench reliability`.

Bad input: each malformed request must get its own clear 4xx with an OpenAI-style error body
(never a 5xx); schemathesis fuzzes every operation of the ingress's OpenAPI spec (with the
request bodies' schemas added, since the routes parse bodies themselves) and must see no 5xx.
Isolation: with API keys bound to users, bob reaches none of alice's memories or conversations
(an isolation leak is any 2xx for them or any of alice's text in bob's answers), requests
without a key get 401, and a marker sent in prompts appears in no Ray log and no metric.
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.bench.reliability_client import Answer, CaseResult, Client, Tally, chat_body
from baton.paths import REPO_ROOT

ROOT = REPO_ROOT


@dataclass(frozen=True)
class BadRequest:
    name: str
    method: str
    path: str
    status: int | tuple[int, ...]
    code: str | None = None
    json_body: Any = None
    content: bytes | None = None
    headers: dict[str, str] | None = None


def bad_requests(model: str) -> list[BadRequest]:
    user = [{"role": "user", "content": "hi"}]
    return [
        BadRequest("oversized prompt", "POST", "/v1/chat/completions", 400, "context_length_exceeded",
                   json_body={"messages": [{"role": "user", "content": "lorem ipsum " * 9000}], "max_tokens": 4}),
        BadRequest("prompt + max_tokens over context", "POST", "/v1/completions", 400, "context_length_exceeded",
                   json_body={"prompt": "hello", "max_tokens": 1_000_000}),
        BadRequest("invalid UTF-8 body", "POST", "/v1/chat/completions", 400, "invalid_json",
                   content=b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}]}'),
        BadRequest("non-JSON body", "POST", "/v1/chat/completions", 400, "invalid_json", content=b"this is not json {"),
        BadRequest("JSON but not an object", "POST", "/v1/completions", 400, "invalid_json", content=b"[1, 2, 3]"),
        # issue 11: a lone surrogate was a 500 (tokenizer) / 503 (memory store); the 10 MB body has its own case (big_body_refused)
        BadRequest("lone surrogate in chat", "POST", "/v1/chat/completions", 400, "invalid_json",
                   content=b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}'),
        BadRequest("lone surrogate in completion", "POST", "/v1/completions", 400, "invalid_json",
                   content=b'{"prompt": "a \\udfff b", "max_tokens": 4}'),
        BadRequest("lone surrogate in memories", "POST", "/v1/memories", 400, "invalid_json",
                   content=b'{"facts": ["\\ud800"]}'),
        BadRequest("lone surrogate in a JSON key", "POST", "/v1/chat/completions", 400, "invalid_json",
                   content=b'{"messages": [{"role": "user", "content": "hi", "\\udc00": 1}], "max_tokens": 4}'),
        BadRequest("unknown model", "POST", "/v1/chat/completions", 404, "model_not_found",
                   json_body={"model": "gpt-imaginary", "messages": user, "max_tokens": 4}),
        BadRequest("bad sampling value", "POST", "/v1/chat/completions", 400, "invalid_value",
                   json_body={"messages": user, "temperature": -3}),
        BadRequest("token id out of vocabulary", "POST", "/v1/completions", 400, None,
                   json_body={"prompt": [10 ** 9], "max_tokens": 4}),
        BadRequest("malformed session id", "POST", "/v1/chat/completions", 400, None,
                   json_body={"messages": user, "max_tokens": 4}, headers={"x-session-id": "has spaces <and> 'quotes' and is long" + "x" * 300}),
        BadRequest("malformed memory id", "GET", "/v1/memories/not-a-hex-id", 400, "invalid_memory_id"),
        BadRequest("unknown memory id", "GET", "/v1/memories/" + "0" * 32, 404, "memory_not_found"),
        BadRequest("delete unknown memory id", "DELETE", "/v1/memories/" + "f" * 32, 404, "memory_not_found"),
        BadRequest("recall unknown memory ids", "POST", "/v1/chat/completions", 404, "memory_not_found",
                   json_body={"messages": user, "max_tokens": 4, "memories": {"ids": ["0" * 32]}}),
        BadRequest("recall malformed memory ids", "POST", "/v1/chat/completions", (400, 404), None,
                   json_body={"messages": user, "max_tokens": 4, "memories": {"ids": ["../../etc/passwd"]}}),
        BadRequest("empty facts", "POST", "/v1/memories", 400, None, json_body={"facts": []}),
        # found by schemathesis: integers beyond 64 bits reach SQLite / vLLM and come back as 503
        BadRequest("list offset beyond 64 bits", "GET", "/v1/memories?offset=" + str(10 ** 22), 400, None),
        BadRequest("seed beyond 64 bits", "POST", "/v1/chat/completions", 400, None,
                   json_body={"messages": user, "max_tokens": 4, "seed": 10 ** 22}),
    ]


def big_body_refused(c: Client, key: str, max_body_bytes: int) -> CaseResult:
    """A 10 MB chat body → 413 `request_too_large` in < 1 s, refused from its Content-Length (and
    a chunked one, without Content-Length, read only up to the limit), while a small request sent
    at the same moment is answered as fast as alone (<= 2 x its unloaded median + 2 s)."""
    t0 = time.monotonic()
    small = chat_body([{"role": "user", "content": "Say hi."}], 4)
    alone = [c.request("POST", "/v1/chat/completions", key=key, json_body=small, what="small alone") for _ in range(3)]
    base_s = statistics.median(a.seconds for a in alone)
    big = b'{"messages": [{"role": "user", "content": "' + b"word " * 2_000_000 + b'"}]}'
    beside: dict[str, Answer] = {}
    c_small = Client(c.url, Tally())  # its own connection and tally (another thread)
    th = threading.Thread(target=lambda: beside.setdefault("a", c_small.request("POST", "/v1/chat/completions", key=key, json_body=small,
                                                                                 what="small beside 10 MB")))
    th.start()
    refused = c.request("POST", "/v1/chat/completions", key=key, content=big, what="10 MB body")
    chunked = c.request("POST", "/v1/chat/completions", key=key, content=iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]),
                        what="10 MB chunked body")
    th.join()
    c_small.close()
    side = beside.get("a")
    c.tally.classes.update(c_small.tally.classes)
    c.tally.server_error_samples += c_small.tally.server_error_samples
    side_ok = side is not None and side.ok and side.seconds <= 2 * base_s + 2.0
    want = all(a.status == 413 and a.error_code == "request_too_large" and a.openai_error() for a in (refused, chunked))
    ok = want and refused.seconds < 1.0 and chunked.seconds < 2.0 and all(a.ok for a in alone) and side_ok
    detail = (f"{len(big) / 1e6:.1f} MB body (limit {max_body_bytes}): {refused.status} {refused.error_code} in {refused.seconds:.2f}s; "
              f"chunked: {chunked.status} {chunked.error_code} in {chunked.seconds:.2f}s; a small request beside it "
              f"{side.status if side else None} in {side.seconds if side else float('nan'):.2f}s (alone: median {base_s:.2f}s)")
    return CaseResult("bad input: 10 MB body (413 in < 1 s, others unaffected)", "bad_input", ok, 0, c.tally.server_errors, 0, detail,
                      time.monotonic() - t0, dict(c.tally.classes))


def run_bad_request(c: Client, key: str, b: BadRequest) -> CaseResult:
    t0 = time.monotonic()
    a = c.request(b.method, b.path, key=key, json_body=b.json_body, content=b.content, headers=b.headers, what=b.name)
    want = b.status if isinstance(b.status, tuple) else (b.status,)
    ok = a.status in want and a.openai_error() and (b.code is None or a.error_code == b.code)
    traced = "Traceback" in a.text or 'File "' in a.text
    detail = f"{a.status} {a.error_code}: {(a.body or {}).get('error', {}).get('message', a.text)[:90] if isinstance(a.body, dict) else a.text[:90]}"
    # a request that should get a 4xx and gets any 5xx (503 included: "retry later" for a request that can never
    # succeed) is a server error
    fives = sum(1 for k in ("5xx", "503") for _ in range(c.tally.classes[k]))
    return CaseResult(f"bad input: {b.name}", "bad_input", ok and not traced, 0, fives, 0,
                      f"expect {b.status} {b.code or ''}; got {detail}", time.monotonic() - t0, dict(c.tally.classes))


# ---- schemathesis -------------------------------------------------------------------------------
def _augmented_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The app's OpenAPI spec with the JSON bodies its routes parse themselves (the routes take a
    raw Request, so FastAPI cannot list them). max_tokens is left out so generated generations stay
    short (the ingress default applies)."""
    from deployments.protocol import (
        AddMemoriesRequest,
        ChatCompletionRequest,
        CompletionRequest,
    )

    comps = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
                        ("/v1/memories", AddMemoriesRequest)):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            comps[name] = sub
        for f in ("max_tokens", "max_completion_tokens", "ignore_eos"):
            schema.get("properties", {}).pop(f, None)
        schema["additionalProperties"] = False
        op = spec["paths"].get(path, {}).get("post")
        if op is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return spec


def schemathesis_fuzz(c: Client, key: str, out_dir: Path, max_examples: int, max_time_s: int) -> CaseResult:
    t0 = time.monotonic()
    spec = c.request("GET", "/openapi.json", key=key, what="openapi")  # with keys on, the schema needs one too
    if spec.status != 200:
        return CaseResult("schemathesis: no 5xx", "bad_input", False, 0, c.tally.server_errors, 0, f"/openapi.json: {spec.status}", 0.0)
    path = out_dir / "openapi_augmented.json"
    path.write_text(json.dumps(_augmented_spec(spec.body), indent=1))
    ndjson = out_dir / "schemathesis.ndjson"
    cmd = [str(ROOT / ".venv" / "bin" / "st"), "run", str(path), "--url", c.url, "--checks", "not_a_server_error",
           "--max-examples", str(max_examples), "--max-time", str(max_time_s), "--header", f"Authorization: Bearer {key}",
           "--request-timeout", "120", "--seed", "7", "--no-shrink", "--generation-database", "none", "--workers", "1",
           # the path parameter of DELETE /v1/conversations/{id} is a strict pattern: the generator's own health
           # check gives up on it ("filter_too_much"), which is about the fuzzer, not a server answer
           "--suppress-health-check", "filter_too_much",
           "--report", "ndjson", "--report-ndjson-path", str(ndjson), "--no-color"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max_time_s + 240, check=False)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"timed out: {e}", -1
    (out_dir / "schemathesis.txt").write_text(out)
    statuses = [int(s) for s in re.findall(r'"status_code":\s*(\d{3})', ndjson.read_text())] if ndjson.exists() else []
    fives = sum(1 for s in statuses if s >= 500)
    summary = " | ".join(line.strip() for line in out.splitlines() if re.search(r"passed|failed|error|Server error|Test cases", line))[:400]
    ok = rc == 0 and fives == 0 and bool(statuses)
    detail = f"{len(statuses)} responses recorded, {fives} >= 500, exit {rc}; {summary}"
    return CaseResult("schemathesis: no 5xx", "bad_input", ok, 0, fives, 0, detail, time.monotonic() - t0,
                      {"2xx": sum(1 for s in statuses if s < 300), "4xx": sum(1 for s in statuses if 400 <= s < 500), "5xx": fives})


# ---- isolation -----------------------------------------------------------------------------------
def _leaks(answers: list[Answer], secrets: list[str]) -> int:
    return sum(1 for a in answers for s in secrets if s in a.text)


def memories_isolated(c: Client, alice: str, bob: str) -> CaseResult:
    t0 = time.monotonic()
    secret = f"alice-secret-{uuid.uuid4().hex[:10]}"
    facts = [f"My locker code is {secret}.", f"I hide the spare key under the {secret} plant."]
    add = c.request("POST", "/v1/memories", key=alice, json_body={"facts": facts}, what="alice adds")
    ids = [f["id"] for f in add.body["data"]] if add.status == 200 else []
    bob_answers: list[Answer] = []
    got: dict[str, int | None] = {}

    def bob_does(name: str, method: str, path: str, **kw: Any) -> None:
        a = c.request(method, path, key=bob, what=f"bob {name}", **kw)
        bob_answers.append(a)
        got[name] = a.status

    bob_does("list", "GET", "/v1/memories")
    bob_does("list as alice", "GET", "/v1/memories", params={"user": "alice"})
    for fid in ids[:1]:
        bob_does("get", "GET", f"/v1/memories/{fid}")
        bob_does("delete", "DELETE", f"/v1/memories/{fid}")
        bob_does("recall ids", "POST", "/v1/chat/completions", json_body=chat_body([{"role": "user", "content": "What is my locker code?"}],
                                                                                  memories={"ids": [fid]}))
    bob_does("recall k", "POST", "/v1/chat/completions", json_body=chat_body([{"role": "user", "content": "What is my locker code?"}],
                                                                             memories={"k": 5, "mode": "prompt"}))
    bob_does("delete all", "DELETE", "/v1/memories")
    still = c.request("GET", "/v1/memories", key=alice, params={"limit": 1000}, what="alice lists")
    alice_has = still.status == 200 and all(f in [x["text"] for x in still.body["data"]] for f in facts)
    expect = {"list": 200, "list as alice": 403, "get": 404, "delete": 404, "recall ids": 404, "recall k": 200, "delete all": 200}
    text_leaks = _leaks(bob_answers, [secret])
    access_leaks = sum(1 for k in ("get", "delete", "recall ids") if got.get(k) is not None and 200 <= got[k] < 300)  # type: ignore[operator]
    leaks = text_leaks + access_leaks + (0 if alice_has else 1)
    ok = add.status == 200 and leaks == 0 and all(got.get(k) == v for k, v in expect.items())
    detail = f"bob's answers {got} (expected {expect}); alice's text in bob's answers: {text_leaks}; alice's facts intact: {alice_has}"
    return CaseResult("isolation: bob vs alice's memories", "security", ok, 0, c.tally.server_errors, leaks, detail,
                      time.monotonic() - t0, dict(c.tally.classes))


def conversation_isolated(c: Client, alice: str, bob: str) -> CaseResult:
    t0 = time.monotonic()
    sid = f"rel-alice-{uuid.uuid4().hex[:8]}"
    secret = f"alice-conv-{uuid.uuid4().hex[:10]}"
    first = [{"role": "user", "content": f"Remember the passphrase {secret}."}]
    a = c.request("POST", "/v1/chat/completions", key=alice, json_body=chat_body(first), headers={"x-session-id": sid}, what="alice turn")
    b = c.request("POST", "/v1/chat/completions", key=bob, json_body=chat_body([{"role": "user", "content": "What was the passphrase?"}]),
                  headers={"x-session-id": sid}, what="bob continues alice")
    b2 = c.request("POST", "/v1/chat/completions", key=bob, json_body={**chat_body([{"role": "user", "content": "hi"}]), "session_id": sid},
                   what="bob continues alice (body session_id)")
    a2 = c.request("POST", "/v1/chat/completions", key=alice, json_body=chat_body(first + [{"role": "assistant", "content": "ok"},
                   {"role": "user", "content": "Thanks."}]), headers={"x-session-id": sid}, what="alice continues")
    leaks = sum(1 for x in (b, b2) if x.status is not None and 200 <= x.status < 300) + _leaks([b, b2], [secret])
    ok = a.status == 200 and a2.status == 200 and all(x.status == 404 and x.error_code == "conversation_not_found" and x.openai_error()
                                                      for x in (b, b2)) and leaks == 0
    detail = f"alice {a.status}/{a2.status}; bob via header {b.status} {b.error_code}, via body {b2.status} {b2.error_code}"
    return CaseResult("isolation: bob continues alice's conversation", "security", ok, 0, c.tally.server_errors, leaks, detail,
                      time.monotonic() - t0, dict(c.tally.classes))


def keys_required(c: Client, bob: str) -> CaseResult:
    t0 = time.monotonic()
    got: dict[str, Any] = {}
    for name, method, path, kw in (("models", "GET", "/v1/models", {}),
                                   ("chat", "POST", "/v1/chat/completions", {"json_body": chat_body([{"role": "user", "content": "hi"}])}),
                                   ("completions", "POST", "/v1/completions", {"json_body": {"prompt": "hi", "max_tokens": 2}}),
                                   ("memories", "GET", "/v1/memories", {}), ("stats", "GET", "/baton/stats", {})):
        for label, key in (("no key", None), ("wrong key", "not-a-key")):
            a = c.request(method, path, key=key, what=f"{name} {label}", **kw)
            got[f"{name}/{label}"] = (a.status, a.error_code)
    health = c.request("GET", "/health", what="health without key").status
    good = c.request("GET", "/v1/models", key=bob, what="models with key").status
    ok = all(v == (401, "invalid_api_key") for v in got.values()) and health == 200 and good == 200
    bad = {k: v for k, v in got.items() if v != (401, "invalid_api_key")}
    detail = f"{len(got)} unauthenticated requests: {'all 401 invalid_api_key' if not bad else bad}; /health {health}; with key {good}"
    return CaseResult("auth: requests without a valid key get 401", "security", ok, 0, c.tally.server_errors, 0, detail,
                      time.monotonic() - t0, dict(c.tally.classes))


def send_marker(c: Client, key: str, ws_url: str, marker: str) -> None:
    """Put the marker in a chat prompt, a completion prompt, a memory fact and a real-time input."""
    c.request("POST", "/v1/chat/completions", key=key, json_body=chat_body([{"role": "user", "content": f"Repeat {marker} please."}]),
              headers={"x-session-id": f"rel-marker-{uuid.uuid4().hex[:6]}"}, what="marker chat")
    c.request("POST", "/v1/completions", key=key, json_body={"prompt": f"The code word is {marker}", "max_tokens": 4}, what="marker completion")
    c.request("POST", "/v1/memories", key=key, json_body={"facts": [f"My codename is {marker}."]}, what="marker fact")
    c.request("POST", "/v1/chat/completions", key=key, json_body={"messages": [{"role": "user", "content": marker * 3000}], "max_tokens": 4},
              what="marker oversized")  # rejected: error messages must not echo the prompt either
    try:
        from websockets.sync.client import connect

        with connect(ws_url, open_timeout=30, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            ws.send(json.dumps({"type": "session.start", "max_tokens": 4, "instructions": f"Secret {marker}"}))
            ws.recv(timeout=120)
            ws.send(json.dumps({"type": "input", "seq": 0, "text": f"Say {marker}"}))
            ws.recv(timeout=120)
            ws.send(json.dumps({"type": "session.end"}))
    except Exception:  # noqa: BLE001 - the marker case only needs the text to have been sent
        pass


def marker_absent(marker: str, log_dirs: list[Path], metrics_url: str | None, c: Client) -> CaseResult:
    t0 = time.monotonic()
    hits: list[str] = []
    files = 0
    for d in log_dirs:
        for p in d.rglob("*"):
            if not p.is_file():
                continue
            files += 1
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if marker.encode() in data:
                i = data.index(marker.encode())
                hits.append(f"{p}: ...{data[max(0, i - 120):i + 40].decode(errors='replace')}...")
    metrics_note = "metrics: not checked (no Ray metrics export port)"
    metric_hits = 0
    metrics_checked = False  # the metrics half looked at Baton's series
    if metrics_url:
        import httpx

        try:
            r = httpx.get(metrics_url, timeout=30)
            r.raise_for_status()
            text = r.text
            n_baton = len(re.findall(r"^ray_baton_|^baton_", text, flags=re.MULTILINE))
            metric_hits = text.count(marker)
            metrics_note = f"metrics: {len(text)} bytes, {n_baton} baton series lines, marker {metric_hits}x"
            metrics_checked = n_baton > 0
            if n_baton == 0:
                metrics_note += " (no baton series exported: that half looked at nothing)"
        except Exception as e:  # noqa: BLE001
            metrics_note = f"metrics: {metrics_url} unreachable ({type(e).__name__})"
    # a half that could not look is a failure, not a pass: unreachable metrics, or metrics without Baton's series
    ok = not hits and metric_hits == 0 and files > 0 and metrics_checked
    detail = f"{files} log files grepped, marker found in {len(hits)}: {hits[:2]}; {metrics_note}"
    return CaseResult("no prompt text in logs or metrics", "security", ok, 0, 0, len(hits) + metric_hits, detail, time.monotonic() - t0)


