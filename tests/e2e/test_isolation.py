"""Tenant isolation through the running application (issue 11): Ray + Serve + vLLM + NIXL,
conversation policy, 1 prefill + 2 decode engines, API keys bound to two users (alice, bob) plus
an operator key, `isolation.prefix_cache: tenant` (the default).

* cross-tenant `cached_tokens` is 0 (the oracle: a hit would tell bob that alice sent the prompt),
  while the same tenant's resend still hits its own KV;
* a conversation's first turn, prefilled on the prefill engine and handed to its decoder over
  NIXL, lands there under the tenant's salt: the next turn on that decoder hits it;
* an application whose Serve HTTP host is 0.0.0.0 and that has no API keys refuses to start;
* last, on the same application: the conversation directory is killed and comes back with its
  owners and pins (tests/e2e/directory_restart.py).

The keys reach the ingress replicas through the environment: the fixture sets the variable
before `start_app` calls `ray.init`, whose raylet (and so every worker it starts) inherits the
driver's environment. If they did not arrive, the ingress would refuse to start (a named but
empty variable is a configuration error), so the fixture would fail at /health, not pass open.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.e2e import directory_restart
from tests.e2e.conftest import ROOT, e2e_args, keyed_app

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's CPU KV block size
HTTP_TIMEOUT_S = 180.0  # one short greedy request on a loaded 2-core machine
MAX_TOKENS = 4
KEYS_ENV = "BATON_E2E_ISOLATION_KEYS"  # a name of this module's own: an exported BATON_API_KEYS stays untouched
OPERATOR_KEY, ALICE_KEY, BOB_KEY = "iso-operator-key", "iso-alice-key", "iso-bob-key"
# plus the directory-restart scenario's users (its test is this module's last: tests/e2e/directory_restart.py)
KEYS = f"{OPERATOR_KEY},{ALICE_KEY}=alice,{BOB_KEY}=bob,{directory_restart.KEYS}"

# two distinct long system prompts (> 3 KV blocks each), one per scenario, so neither scenario's
# hits can come from the other's KV
ORACLE_SYSTEM = "You are a travel assistant. Available tools: " + " ".join(
    f"tool_{i}(city: str, date: str) returns the weather, flights and hotels for a city on a date." for i in range(24)
)
HANDOFF_SYSTEM = "You are a museum guide. Collections: " + " ".join(
    f"room_{i} holds paintings, sculptures and maps from century {i} with notes for visitors." for i in range(24)
)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = e2e_args("conversation", decode_replicas=2, prefill_replicas=1)
    assert args.get("isolation", {}).get("prefix_cache", "tenant") == "tenant"
    with keyed_app(args, KEYS_ENV, KEYS, tmp_path_factory.mktemp("iso") / "conversations.sqlite3") as u:
        yield u


def _headers(key: str | None, session: str | None = None) -> dict[str, str]:
    h = {"authorization": f"Bearer {key}"} if key else {}
    if session:
        h["x-session-id"] = session
    return h


def chat(url: str, key: str | None, messages: list[dict[str, str]], session: str | None = None, **extra: Any) -> httpx.Response:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=_headers(key, session), timeout=HTTP_TIMEOUT_S)


def ok_usage(r: httpx.Response) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a successful chat completion."""
    assert r.status_code == 200, r.text
    use = r.json()["usage"]
    return int(use["prompt_tokens"]), int((use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def full_blocks(prompt_tokens: int) -> int:
    """Tokens a prefix-cache hit on the whole prompt reports: vLLM always computes the last prompt
    token, so the hit is the whole blocks of the first prompt_tokens - 1 tokens."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def decode_transfers(url: str) -> dict[str, int]:
    """KV transfers each decode replica's connector counted, as last reported (operator key)."""
    r = httpx.get(f"{url}/baton/stats", headers=_headers(OPERATOR_KEY), timeout=30)
    assert r.status_code == 200, r.text
    return {rid: int(rep.get("kv_transfers_received", 0)) for rid, rep in r.json()["replicas"].items() if rep["pool"] == "decode"}


def settled_transfers(url: str, until: Callable[[dict[str, int]], bool] = lambda _: True, timeout_s: float = 45.0) -> dict[str, int]:
    """The decoders' transfer counts once `until` holds and two consecutive reports agree
    (replicas report every second); after timeout_s, the last reading."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, int] | None = None
    while True:
        now = decode_transfers(url)
        if (now == last and until(now)) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(1.5)


# ---- the start refusal: a subprocess, so it cannot disturb (or join) the module's cluster ------
# It builds the app exactly as `serve run module:build_app` does before Ray is connected: the host
# comes from serve_http_host(), which then reads Serve's default, HTTPOptions().host, set to
# 0.0.0.0 by RAY_SERVE_DEFAULT_HTTP_HOST. ray.init is disabled in the child: no Ray is started
# or joined, whatever RAY_ADDRESS the parent has.
_BUILD = """
import json, sys
import ray

def _no_ray(*a, **k):
    raise RuntimeError("the start-refusal check must not start or join a Ray cluster")

ray.init = _no_ray
from ray.serve import Application

from deployments.app import build_app
from deployments.exposure import serve_http_host

print("host=" + str(serve_http_host()), flush=True)
for args in json.loads(sys.argv[1]):
    app = build_app(args)
    print("built " + str(isinstance(app, Application)), flush=True)
"""


def _build_in_subprocess(*variants: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_SERVE_DEFAULT_HTTP_HOST"] = "0.0.0.0"
    env["RAY_ENABLE_AUTO_CONNECT"] = "0"
    env.pop(KEYS_ENV, None)
    return subprocess.run([sys.executable, "-c", _BUILD, json.dumps(list(variants))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def _ingress(**changes: Any) -> dict[str, Any]:
    args = e2e_args("conversation", decode_replicas=2, prefill_replicas=1)
    ingress = {k: v for k, v in args["ingress"].items() if k not in ("api_keys_env", "allow_unauthenticated")}
    args["ingress"] = {**ingress, **changes}
    return args


def _said(p: subprocess.CompletedProcess[str]) -> list[str]:
    """What the build script printed (libraries may print too)."""
    return [line for line in p.stdout.splitlines() if line.startswith(("host=", "built "))]


def test_a_start_on_all_interfaces_without_keys_is_refused() -> None:
    refused = _build_in_subprocess(_ingress())
    assert _said(refused) == ["host=0.0.0.0"], (refused.stdout[-2000:], refused.stderr[-2000:])  # refused before any build
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("deployments.config.ConfigError: ")]
    assert errors and "refusing to start" in errors[-1], refused.stderr[-2000:]
    for field in ("http_options.host='0.0.0.0'", "ingress.api_keys_env", "ingress.allow_unauthenticated"):
        assert field in errors[-1], field

    # keys (or the explicit opt-out) get past the check: the whole application is built (the
    # ingress checks the variable's keys when it starts, not here)
    allowed = _build_in_subprocess(_ingress(api_keys_env=KEYS_ENV), _ingress(allow_unauthenticated=True))
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert _said(allowed) == ["host=0.0.0.0", "built True", "built True"], allowed.stdout[-2000:]


# ---- the running application ------------------------------------------------------------------
def test_keys_are_on_and_a_user_key_speaks_only_for_its_user(url: str) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open
    r = chat(url, None, messages)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text  # the keys reached the ingress
    r = chat(url, "not-a-key", messages)
    assert r.status_code == 401, r.text
    # bob cannot borrow alice's tenant (and so her salt) by naming her
    r = chat(url, BOB_KEY, messages, user="alice")
    assert r.status_code == 403 and r.json()["error"]["code"] == "user_mismatch", r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                   headers={**_headers(BOB_KEY), "x-baton-user": "alice"}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 403, r.text
    r = httpx.get(f"{url}/baton/stats", headers=_headers(ALICE_KEY), timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "operator_key_required", r.text


def test_cross_tenant_cached_tokens_are_zero_while_the_same_tenant_reuses_its_kv(url: str) -> None:
    """Without a session id every request is a new turn: prefilled on the one prefill engine and
    handed to a decoder, whose usage reports the prefill engine's prefix-cache hits."""
    messages = [{"role": "system", "content": ORACLE_SYSTEM}, {"role": "user", "content": "Which city is best in May?"}]
    n, cached = ok_usage(chat(url, ALICE_KEY, messages))
    assert n > 3 * BLOCK, f"the prompt should span more than 3 KV blocks ({n} tokens)"
    assert cached == 0, "nobody sent this prefix before"
    hit = full_blocks(n)

    _, cached = ok_usage(chat(url, ALICE_KEY, messages))
    assert BLOCK <= hit <= cached < n, f"alice's resend should reuse her own KV ({cached} of {n} cached)"

    _, cached = ok_usage(chat(url, BOB_KEY, messages))
    assert cached == 0, f"bob hit KV computed for alice ({cached} tokens): cross-tenant prefix-cache leak"
    # an operator key naming no user is the anonymous tenant, not a wildcard
    _, cached = ok_usage(chat(url, OPERATOR_KEY, messages))
    assert cached == 0, f"the anonymous tenant hit alice's or bob's KV ({cached} tokens)"

    # alice's KV was still there while bob missed it (a miss by isolation, not by eviction), and
    # bob's own prompt now hits for bob
    _, cached = ok_usage(chat(url, ALICE_KEY, messages))
    assert cached >= hit, f"alice's KV should still be cached ({cached} of {n})"
    _, cached = ok_usage(chat(url, BOB_KEY, messages))
    assert cached >= hit, f"bob's resend should reuse his own KV ({cached} of {n})"


def test_a_conversation_hits_its_handed_off_kv_on_its_decoder_under_its_tenant_salt(url: str) -> None:
    before = settled_transfers(url)
    sid = "iso-alice-conversation"
    messages = [{"role": "system", "content": HANDOFF_SYSTEM}, {"role": "user", "content": "Which room should I see first?"}]
    first = chat(url, ALICE_KEY, messages, session=sid)
    n1, cached = ok_usage(first)
    decoder = first.headers["x-baton-replica"]
    assert first.headers["x-session-id"] == sid
    assert n1 > 3 * BLOCK and cached == 0, (n1, cached)

    # the first turn was prefilled on the prefill engine: its KV moved to this decoder over NIXL
    # (the decoder's connector counted one transfer), not recomputed there
    after_first = settled_transfers(url, until=lambda t: t.get(decoder, 0) > before.get(decoder, 0))
    assert after_first.get(decoder, 0) - before.get(decoder, 0) == 1, (before, after_first, decoder)
    assert sum(after_first.values()) - sum(before.values()) == 1, (before, after_first)

    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And which one after that?"}]
    second = chat(url, ALICE_KEY, messages, session=sid)
    n2, cached = ok_usage(second)
    assert second.headers["x-baton-replica"] == decoder, "a conversation stays on its decoder"
    # the second turn is prefilled on that decoder: its hits are the first turn's prompt blocks,
    # which only ever reached it over NIXL, so they arrived under alice's salt
    assert n2 > n1 and cached >= full_blocks(n1) >= 3 * BLOCK, (n1, n2, cached)
    assert settled_transfers(url) == after_first, "the second turn moved no KV"

    # bob cannot reach that decoder's copy through alice's conversation: not his, so not found
    r = chat(url, BOB_KEY, messages, session=sid)
    assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found", r.text

    # GET /v1/conversations/{id}: alice sees her conversation where it runs; bob sees nothing
    seen = httpx.get(f"{url}/v1/conversations/{sid}", headers={"authorization": f"Bearer {ALICE_KEY}"}, timeout=30)
    assert seen.status_code == 200, seen.text
    info = seen.json()
    assert info["decoder"] == decoder and info["turns"] == 2 and info["handoffs"] == 1 and info["context_tokens"] == n2, info
    hidden = httpx.get(f"{url}/v1/conversations/{sid}", headers={"authorization": f"Bearer {BOB_KEY}"}, timeout=30)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "conversation_not_found", hidden.text


def test_a_restarted_directory_keeps_owners_and_pins_and_never_serves_unchecked(url: str) -> None:
    """Last in this module, since it kills the conversation directory (tests/e2e/directory_restart.py)."""
    directory_restart.check_restart(url)
