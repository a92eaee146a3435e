"""Optional API keys on the ingress (deployments/openai_api.py)."""
from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.chat import PromptRenderer
from deployments.config import ConfigError, load_app_config
from deployments.frontend import OpenAIFrontend
from deployments.metrics import RecordingMetrics
from deployments.openai_api import api_keys_from_env, authenticate, authorized, build_openai_app
from tests.unit.fakes import FakeBackend, FakeTokenizer

CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}


def client(keys: dict[str, str | None]) -> tuple[TestClient, FakeBackend]:
    backend = FakeBackend()
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=backend, max_model_len=64, default_max_tokens=4,
                              metrics=RecordingMetrics())

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    async def stats() -> dict[str, Any]:
        return {"policy": "conversation"}

    return TestClient(build_openai_app(frontend, health, stats, api_keys=keys)), backend


def test_keys_come_from_the_named_variable() -> None:
    assert api_keys_from_env(None, {}) == {}
    assert api_keys_from_env("K", {"K": " a, b "}) == {"a": None, "b": None}
    assert api_keys_from_env("K", {"K": "a=alice, b = bob,c"}) == {"a": "alice", "b": "bob", "c": None}
    with pytest.raises(ValueError, match="'K'"):
        api_keys_from_env("K", {})
    with pytest.raises(ValueError, match="holds no keys"):
        api_keys_from_env("K", {"K": "  "})


def test_bearer_header_must_carry_a_configured_key() -> None:
    keys = {"secret-1": None, "secret-9": "alice"}
    assert authenticate("Bearer secret-9", keys) == (True, "alice")
    assert authenticate("Bearer secret-1", keys) == (True, None)
    assert authenticate("Bearer secret-2", keys) == (False, None)
    assert authorized("Bearer secret-1", keys)
    assert not authorized("Bearer secret-2", keys)
    assert not authorized("secret-1", keys)
    assert not authorized(None, keys)


def test_with_keys_the_api_needs_one_and_health_stays_open() -> None:
    c, backend = client({"k1": None, "k2": None})
    for path, method, body in (("/v1/chat/completions", "post", CHAT), ("/v1/models", "get", None), ("/baton/stats", "get", None)):
        r = c.request(method, path, json=body)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"
        assert c.request(method, path, json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert backend.requests == []  # refused before any engine work
    assert c.get("/health").status_code == 200
    r = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k2"})
    assert r.status_code == 200 and len(backend.requests) == 1


def test_without_keys_no_header_is_needed() -> None:
    c, _ = client({})
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_the_config_takes_a_variable_name_never_a_key() -> None:
    base = {"decode": {"engine": {"model": "m"}}, "routing": {"policy": "colocated"}}
    assert load_app_config({**base, "ingress": {"api_keys_env": "BATON_API_KEYS"}}).ingress.api_keys_env == "BATON_API_KEYS"
    with pytest.raises(ConfigError, match="ingress.api_keys_env"):
        load_app_config({**base, "ingress": {"api_keys_env": "sk-not a name"}})
    with pytest.raises(ConfigError, match="ingress.api_keys"):
        load_app_config({**base, "ingress": {"api_keys": ["sk-123"]}})
