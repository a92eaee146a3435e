"""Key roles (deployments/api_keys.py): empty keys refuse to start, `Bearer` in any case, operator
keys (bound to no user) name any user and read /baton/*, user keys act only as their user, and
with keys on every path but /health — /docs and /openapi.json included — needs a key."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deployments.api_keys import Caller, access_refusal, api_keys_from_env, authenticate, bearer_token
from deployments.errors import APIError
from deployments.memory_api import resolve_user
from tests.unit.test_api_keys import CHAT, client

KEYS = {"opkey": None, "key1": "ana"}
OP, ANA = {"Authorization": "Bearer opkey"}, {"Authorization": "Bearer key1"}


@pytest.mark.parametrize("raw", [",key1", "key1,", "a,,b", "=ana", "key1,=ana", " = ana", "key1=", "a b", "a,a=ana", "a=x,a=y"])
def test_an_empty_or_ambiguous_key_refuses_to_start(raw: str) -> None:
    with pytest.raises(ValueError, match="BATON_API_KEYS entry"):
        api_keys_from_env("BATON_API_KEYS", {"BATON_API_KEYS": raw})


def test_a_refusal_names_the_entry_by_position_never_by_its_text() -> None:
    with pytest.raises(ValueError) as e:
        api_keys_from_env("K", {"K": "sk-secret-1=ana,sk-secret-2="})
    assert "entry 2 of 2" in str(e.value) and "sk-secret" not in str(e.value) and "ana" not in str(e.value)


def test_the_format_the_docs_show_parses_into_roles() -> None:
    keys = api_keys_from_env("BATON_API_KEYS", {"BATON_API_KEYS": "opkey,key1=ana"})
    assert keys == KEYS
    assert authenticate("Bearer opkey", keys).operator and not authenticate("Bearer key1", keys).operator
    assert not Caller(False, None).operator


def test_bearer_scheme_in_any_case() -> None:
    for header in ("Bearer k", "bearer k", "BEARER k", "BeArEr   k ", " Bearer k"):
        assert bearer_token(header) == "k", header
    for header in (None, "", "Bearer", "Bearer   ", "Basic k", "Bearerk", "k"):
        assert bearer_token(header) is None, header
    assert authenticate("bearer key1", KEYS) == (True, "ana")
    assert authenticate("bearer opkey2", KEYS) == (False, None)


def test_access_rules_as_a_pure_function() -> None:
    op, ana, nobody = Caller(True, None), Caller(True, "ana"), Caller(False, None)
    for path in ("/v1/models", "/docs", "/redoc", "/openapi.json", "/baton/stats", "/anything"):
        e = access_refusal(path, nobody)
        assert e is not None and (e.status, e.code) == (401, "invalid_api_key"), path
        assert access_refusal(path, op) is None
    assert access_refusal("/health", nobody) is None
    for path in ("/v1/models", "/docs", "/openapi.json"):
        assert access_refusal(path, ana) is None
    e = access_refusal("/baton/stats", ana)
    assert e is not None and (e.status, e.type, e.code) == (403, "permission_error", "operator_key_required")


def test_docs_and_openapi_need_a_key_when_keys_are_on() -> None:
    c, _ = client(KEYS)
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = c.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(path, headers=ANA).status_code == 200, path  # any valid key
        assert c.get(path, headers={"Authorization": "bearer opkey"}).status_code == 200
    assert c.get("/health").status_code == 200
    open_c, _ = client({})
    assert open_c.get("/openapi.json").status_code == 200 and open_c.get("/docs").status_code == 200


def test_stats_need_an_operator_key() -> None:
    c, _ = client(KEYS)
    r = c.get("/baton/stats", headers=ANA)
    e = r.json()["error"]
    assert r.status_code == 403 and (e["type"], e["code"]) == ("permission_error", "operator_key_required")
    assert "operator" in e["message"] and "policy" not in r.text
    assert c.get("/baton/stats", headers=OP).json() == {"policy": "conversation"}
    assert c.get("/baton/stats").status_code == 401


def test_stats_stay_operator_only_under_a_root_path() -> None:
    c = TestClient(client(KEYS)[0].app, root_path="/app")  # mounted under a prefix: url.path starts /app
    assert c.get("/app/baton/stats", headers=ANA).status_code == 403
    assert c.get("/app/health").status_code == 200


def test_a_user_key_acts_only_as_its_user_on_chat() -> None:
    c, backend = client(KEYS)
    for extra in ({"json": {**CHAT, "user": "bob"}}, {"json": CHAT, "headers": {"x-baton-user": "bob"}}):
        headers = {**ANA, **extra.pop("headers", {})}
        r = c.post("/v1/chat/completions", headers=headers, **extra)
        assert r.status_code == 403 and r.json()["error"]["code"] == "user_mismatch"
    assert backend.requests == []
    assert c.post("/v1/chat/completions", json=CHAT, headers={**ANA, "x-baton-user": "ana"}).status_code == 200
    assert backend.last.user == "ana"
    assert c.post("/v1/chat/completions", json={**CHAT, "user": "bob"}, headers=OP).status_code == 200  # operator: any user
    assert backend.last.user == "bob"


def test_resolve_user_checks_every_claim_against_a_bound_key() -> None:
    assert resolve_user("ana", "ana", None, "ana", required=True) == "ana"
    assert resolve_user("ana", None, "", None, required=True) == "ana"
    for claims in (("bob", None, None), ("ana", "bob", None), (None, None, "bob")):
        with pytest.raises(APIError) as e:
            resolve_user("ana", *claims, required=False)
        assert (e.value.status, e.value.code) == (403, "user_mismatch")
    # an operator key (or no keys): the first claim, body, then header, then query
    assert resolve_user(None, None, "bob", "carl", required=True) == "bob"
    assert resolve_user(None, "", None, "carl", required=True) == "carl"
    assert resolve_user(None, None, None, required=False) is None
