"""Access cases of `baton bench reliability`: API key roles (deployments/api_keys.py), the key on
every path, the prefix-cache oracle across tenants (deployments/salt.py) and the refusal to start
on a non-loopback host without keys (deployments/exposure.py).

Roles: an operator key (bound to no user) reads /baton/stats and may name any user; a key bound
to a user gets 403 `operator_key_required` on /baton/stats and 403 `user_mismatch` when it names
another user (body `user`, x-baton-user, ?user=, a WebSocket session.start `user`). Any 2xx where
a 403 is due is an isolation leak.

Cache oracle: alice sends one long, never-seen prompt twice (the second must show cached_tokens >
0: same-tenant reuse works, so the probe can see a hit), then bob sends it, and the operator key
(the anonymous tenant): both must show cached_tokens == 0 (a hit would tell them alice sent that
text: an isolation leak). Bob's second send must hit again (his own salt is stable).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from baton.bench.cluster import LocalServeApp, attempt_start
from baton.bench.reliability_client import Answer, CaseResult, Client, cached_tokens, chat_body, prompt_tokens
from baton.bench.reliability_ws import until_closed, ws_connect
from baton.paths import REPO_ROOT

HI = [{"role": "user", "content": "hi"}]


def _check(got: dict[str, tuple[int | None, str | None]], want: dict[str, tuple[int, str | None]]) -> list[str]:
    """Names whose (status, code) differs from what is due (a code of None: any)."""
    return [k for k, (s, c) in want.items() if got.get(k, (None, None))[0] != s or (c is not None and got[k][1] != c)]


def operator_role(c: Client, operator: str) -> CaseResult:
    t0 = time.monotonic()
    got: dict[str, tuple[int | None, str | None]] = {}

    def do(name: str, method: str, path: str, **kw: Any) -> Answer:
        a = c.request(method, path, key=operator, what=f"operator {name}", **kw)
        got[name] = (a.status, a.error_code)
        return a

    stats = do("stats", "GET", "/baton/stats")
    do("list alice's memories (?user=)", "GET", "/v1/memories", params={"user": "alice"})
    do("list bob's memories (x-baton-user)", "GET", "/v1/memories", headers={"x-baton-user": "bob"})
    do("chat as bob (body user)", "POST", "/v1/chat/completions", json_body={**chat_body(HI, 2), "user": "bob"})
    do("end an unknown conversation of alice", "DELETE", f"/v1/conversations/rel-none-{uuid.uuid4().hex[:8]}", params={"user": "alice"})
    want: dict[str, tuple[int, str | None]] = {"stats": (200, None), "list alice's memories (?user=)": (200, None),
                                               "list bob's memories (x-baton-user)": (200, None), "chat as bob (body user)": (200, None),
                                               "end an unknown conversation of alice": (404, "conversation_not_found")}
    bad = _check(got, want)
    ok = not bad and isinstance(stats.body, dict) and "replicas" in stats.body
    detail = f"{got}" + (f"; not as due: {bad}" if bad else "")
    return CaseResult("roles: operator key reads stats, names any user", "security", ok, 0, c.tally.server_errors, 0, detail,
                      time.monotonic() - t0, dict(c.tally.classes))


def bound_role(c: Client, bob: str, ws_url: str) -> CaseResult:
    t0 = time.monotonic()
    got: dict[str, tuple[int | None, str | None]] = {}

    def do(name: str, method: str, path: str, **kw: Any) -> None:
        a = c.request(method, path, key=bob, what=f"bob {name}", **kw)
        got[name] = (a.status, a.error_code)

    do("stats", "GET", "/baton/stats")
    do("list alice's memories (?user=)", "GET", "/v1/memories", params={"user": "alice"})
    do("list alice's memories (x-baton-user)", "GET", "/v1/memories", headers={"x-baton-user": "alice"})
    do("chat as alice (body user)", "POST", "/v1/chat/completions", json_body={**chat_body(HI, 2), "user": "alice"})
    do("end a conversation as alice", "DELETE", f"/v1/conversations/rel-none-{uuid.uuid4().hex[:8]}", params={"user": "alice"})
    do("list his own (?user=bob)", "GET", "/v1/memories", params={"user": "bob"})
    mismatch = (403, "user_mismatch")
    want: dict[str, tuple[int, str | None]] = {
        "stats": (403, "operator_key_required"), "list alice's memories (?user=)": mismatch,
        "list alice's memories (x-baton-user)": mismatch, "chat as alice (body user)": mismatch, "end a conversation as alice": mismatch,
        "list his own (?user=bob)": (200, None)}
    leaks = sum(1 for k, (s, _) in want.items() if s == 403 and (got[k][0] or 0) // 100 == 2)
    try:  # a real-time session naming another user
        with ws_connect(ws_url, bob) as ws:
            ws.send(json.dumps({"type": "session.start", "max_tokens": 1, "user": "alice"}))
            code, close = until_closed(ws, 30)
        ws_got: tuple[Any, Any] = (code, close)
    except Exception as e:  # noqa: BLE001 - reported
        ws_got = (type(e).__name__, None)
    bad = _check(got, want)
    ok = not bad and ws_got == ("user_mismatch", 1008) and leaks == 0
    detail = f"{got}; WebSocket session.start as alice -> {ws_got[0]}/{ws_got[1]}" + (f"; not as due: {bad}" if bad else "")
    return CaseResult("roles: bound key refused stats and other users (403)", "security", ok, 0, c.tally.server_errors, leaks, detail,
                      time.monotonic() - t0, dict(c.tally.classes))


def key_everywhere(c: Client, bob: str) -> CaseResult:
    """/docs, /redoc and /openapi.json need a key; the scheme is case-insensitive; an empty or
    altered key, or another scheme, is 401."""
    t0 = time.monotonic()
    got: dict[str, int | None] = {}
    for path in ("/openapi.json", "/docs", "/redoc"):
        got[f"{path} without key"] = c.request("GET", path, what=f"{path} no key").status
    spec = c.request("GET", "/openapi.json", key=bob, what="openapi with key")
    got["/openapi.json with key"] = spec.status
    got["/docs with key"] = c.request("GET", "/docs", key=bob, what="docs with key").status
    for label, header in (("bearer (lower case)", f"bearer {bob}"), ("BEARER (upper case)", f"BEARER {bob}"), ("empty key", "Bearer"),
                          ("empty header", ""), ("Basic scheme", f"Basic {bob}"), ("key + 1 char", f"Bearer {bob}x"), ("no scheme", bob)):
        got[label] = c.request("GET", "/v1/models", headers={"authorization": header}, what=f"models, {label}").status
    want = {"/openapi.json without key": 401, "/docs without key": 401, "/redoc without key": 401, "/openapi.json with key": 200,
            "/docs with key": 200, "bearer (lower case)": 200, "BEARER (upper case)": 200, "empty key": 401, "empty header": 401,
            "Basic scheme": 401, "key + 1 char": 401, "no scheme": 401}
    bad = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
    ok = not bad and isinstance(spec.body, dict) and "paths" in spec.body
    detail = f"{got}" + (f"; not as due: {bad}" if bad else "")
    return CaseResult("auth: docs and schema need a key; scheme any case; empty key 401", "security", ok, 0, c.tally.server_errors, 0,
                      detail, time.monotonic() - t0, dict(c.tally.classes))


def cache_oracle(c: Client, alice: str, bob: str, operator: str, words: int = 500) -> CaseResult:
    t0 = time.monotonic()
    doc = f"[{uuid.uuid4().hex}] Internal memo. " + " ".join(f"clause{i % 113} of the policy applies" for i in range(words // 5))
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": "Summarize the memo."}]
    seen: list[tuple[str, int | None, int, int]] = []  # (who, status, prompt tokens, cached tokens)

    def send(who: str, key: str) -> int:
        a = c.request("POST", "/v1/chat/completions", key=key, json_body=chat_body(messages, 1),
                      headers={"x-session-id": f"rel-oracle-{who.split()[0]}-{uuid.uuid4().hex[:8]}"}, what=f"oracle {who}")
        n = cached_tokens(a) if a.status == 200 else -1
        seen.append((who, a.status, prompt_tokens(a), n))
        return n

    send("alice 1", alice)
    alice2 = send("alice 2", alice)
    bob1 = send("bob 1", bob)
    anon = send("operator (anonymous tenant)", operator)
    bob2 = send("bob 2", bob)
    leaks = int(bob1 > 0) + int(anon > 0)
    ok = all(s == 200 for _, s, _, _ in seen) and alice2 > 0 and bob2 > 0 and bob1 == 0 and anon == 0
    detail = "; ".join(f"{who}: {s} cached {n} of {p}" for who, s, p, n in seen) + (
        " (same-tenant reuse not visible: the oracle sees nothing)" if alice2 <= 0 else "")
    return CaseResult("isolation: no cached tokens across tenants", "security", ok, 0, c.tally.server_errors, leaks, detail,
                      time.monotonic() - t0, dict(c.tally.classes))


# ---- refusal to start off loopback without keys --------------------------------------------------------
_BUILD_SCRIPT = """
import json, sys
from deployments import app as m
from deployments.config import ConfigError
for label, host, args in json.loads(sys.argv[1]):
    m.serve_http_host = lambda host=host: host  # the host Serve's proxies would bind (faked as tests/unit/test_exposure.py does)
    try:
        m.build_app(args)
        outcome = "built"
    except ConfigError as e:
        outcome = "refused " + str(e)
    except Exception as e:  # noqa: BLE001
        outcome = f"error {type(e).__name__}: {e}"
    print("OUTCOME " + json.dumps([label, outcome]), flush=True)
"""
FIELDS = ("http_options.host", "ingress.api_keys_env", "ingress.allow_unauthenticated")


def without_keys(args: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(args)
    out["ingress"] = {k: v for k, v in out["ingress"].items() if k not in ("api_keys_env", "allow_unauthenticated")}
    return out


def build_outcomes(variants: list[tuple[str, str, dict[str, Any]]]) -> dict[str, str]:
    """build_app of each (label, Serve HTTP host, args), in one subprocess (no Ray joined): label ->
    "built", "refused <ConfigError>" or "error <...>"."""
    p = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, json.dumps(variants)], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=600, check=False)
    out = {label: outcome for label, outcome in (json.loads(ln[8:]) for ln in p.stdout.splitlines() if ln.startswith("OUTCOME "))}
    for label, _, _ in variants:
        out.setdefault(label, f"no outcome (exit {p.returncode}): {p.stderr[-300:]}")
    return out


def build_refused(args: dict[str, Any]) -> CaseResult:
    """build_app (in a subprocess, with Serve's HTTP host faked) refuses 0.0.0.0 without keys,
    naming the fields to set, and builds with keys, with the explicit opt-out, or on loopback."""
    t0 = time.monotonic()
    bare = without_keys(args)
    with_ingress = lambda **kw: {**bare, "ingress": {**bare["ingress"], **kw}}
    runs = build_outcomes([("0.0.0.0, no keys", "0.0.0.0", bare), ("0.0.0.0, keys", "0.0.0.0", with_ingress(api_keys_env="BATON_API_KEYS")),
                           ("0.0.0.0, allow_unauthenticated", "0.0.0.0", with_ingress(allow_unauthenticated=True)),
                           ("127.0.0.1, no keys", "127.0.0.1", bare)])
    refused = runs["0.0.0.0, no keys"]
    ok = (refused.startswith("refused") and "refusing to start" in refused and all(f in refused for f in FIELDS)
          and all(v == "built" for k, v in runs.items() if k != "0.0.0.0, no keys"))
    detail = "; ".join(f"{k}: {v[:160]}" for k, v in runs.items())
    return CaseResult("exposure: build_app refuses 0.0.0.0 without keys", "security", ok, 0, 0, 0, detail, time.monotonic() - t0)


def serve_run_refused(args: dict[str, Any], *, http_port: int, ray_port: int, resources: dict[str, float], log_dir: Path) -> CaseResult:
    """A real `ray start` + `serve run` of the bench's config without keys, its proxies on 0.0.0.0:
    the application fails to deploy with the refusal, no replica of it exists, and Baton answers
    nothing on the port (Serve's own proxy may listen there, with no application behind it)."""
    t0 = time.monotonic()
    got = attempt_start(LocalServeApp(without_keys(args), resources=resources, http_port=http_port, ray_port=ray_port, log_dir=log_dir),
                        "0.0.0.0")
    baton_answers = {p: s for p, s in got.answers.items() if s == 200}
    ok = got.status == "DEPLOY_FAILED" and "refusing to start" in got.message and not got.replicas and not baton_answers
    at = max(0, got.message.find("refusing to start"))
    detail = (f"serve run with http_options.host 0.0.0.0 and no ingress.api_keys_env: application {got.status} in {got.seconds:.0f}s, "
              f"message {got.message[at:at + 240]!r}; its replicas {got.replicas}; on the port {got.answers}")
    return CaseResult("exposure: serve run on 0.0.0.0 without keys is refused", "security", ok, 0, 0, 0, detail, time.monotonic() - t0)
