"""API keys and their roles (ingress.api_keys_env), as pure functions over the configured keys.

A key is either an operator key (bound to no user: it may name any user and read /baton/*) or a
user key (`key=user`: it acts only as that user). With keys on, every HTTP path but /health needs
a valid key — /docs, /redoc and /openapi.json included.
"""
from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import NamedTuple

from deployments.errors import APIError

OPEN_PATHS = frozenset({"/health"})  # the only paths served without a key when keys are on
OPERATOR_PREFIX = "/baton/"  # operator-only paths (routing state of every user's conversations)


def api_keys_from_env(name: str | None, environ: Mapping[str, str]) -> dict[str, str | None]:
    """The configured API keys, comma-separated in the named variable: `key` (an operator key) or
    `key=user` (the key acts as that user: its memories and conversations, nobody else's). Empty
    when auth is off. A named but missing or empty variable, an empty entry (`,key`), an empty key
    (`=ana`) or user (`key=`), a key with whitespace, or the same key twice is a configuration
    error, not an open server. Messages name entries by position, never by their text."""
    if name is None:
        return {}
    raw = environ.get(name, "")
    if not raw.strip():
        raise ValueError(f"ingress.api_keys_env names {name!r}, but that environment variable holds no keys")
    keys: dict[str, str | None] = {}
    for i, entry in enumerate(raw.split(","), start=1):
        key, eq, user = (part.strip() for part in entry.partition("="))
        where = f"{name} entry {i} of {len(raw.split(','))}"
        if not key:
            raise ValueError(f"{where} has an empty API key (entries are `key` or `key=user`, comma-separated, none empty)")
        if any(c.isspace() for c in key):
            raise ValueError(f"{where}: an API key cannot contain whitespace")
        if eq and not user:
            raise ValueError(f"{where} binds its key to an empty user (write `key` for an operator key, `key=user` for a user's)")
        if key in keys:
            raise ValueError(f"{where} repeats an earlier key")
        keys[key] = user or None
    return keys


class Caller(NamedTuple):
    """Who sent a request: whether its key is valid, and the user that key is bound to (None: an
    operator key, or no key)."""

    authorized: bool
    user: str | None

    @property
    def operator(self) -> bool:
        return self.authorized and self.user is None


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; the scheme in any case."""
    scheme, _, token = (header or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authenticate(header: str | None, keys: Mapping[str, str | None]) -> Caller:
    """Constant-time comparison of the bearer key against every configured key."""
    token = bearer_token(header)
    if token is None:
        return Caller(False, None)
    given = token.encode()
    match = [k for k in keys if hmac.compare_digest(given, k.encode())]
    return Caller(True, keys[match[0]]) if match else Caller(False, None)


def authorized(header: str | None, keys: Mapping[str, str | None]) -> bool:
    return authenticate(header, keys).authorized


def access_refusal(path: str, caller: Caller) -> APIError | None:
    """Why a request with keys on may not reach `path` (None: it may). /health is open; every
    other path needs a valid key; /baton/* needs an operator key."""
    if path in OPEN_PATHS:
        return None
    if not caller.authorized:
        return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
    if path.startswith(OPERATOR_PREFIX) and not caller.operator:
        return APIError(403, f"{path} needs an operator API key (one bound to no user); this key is bound to a user",
                        code="operator_key_required")
    return None
