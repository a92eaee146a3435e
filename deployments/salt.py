"""Prefix-cache salts: which requests may hit each other's KV (vLLM's per-request `cache_salt`).

vLLM hashes a request's `cache_salt` into its first block, so two requests share prefix-cache
blocks only when their salts are equal. `isolation.prefix_cache` (deployments/config.py) picks
the scope:

  tenant  (default) every request carries its tenant's salt. The tenant is the user an API key is
          bound to, else the request's `user` field (self-asserted when keys are off or unbound:
          bind keys to users for isolation a caller cannot opt out of). No request hits KV
          computed for another tenant, so `usage.prompt_tokens_details.cached_tokens` and TTFT
          say nothing about other tenants' prompts. Callers with no user (no bound key, no `user`
          field) are ONE tenant: they share the anonymous salt with each other.
  shared  no tenant salt: equal prefixes share KV across users (cross-user system-prompt reuse),
          which trades that isolation away: cached_tokens then tells whether anyone sent a prefix.

In both scopes:
  * a request with memories injected as KV carries its composition's salt
    (memory_store/layout.py: approximate KV is only hit by a request asking for exactly that
    composition, which names its user); under `tenant` it is combined with the tenant's salt;
  * a request whose prompt holds the user's memory facts (`private`: prompt-mode memories) is
    salted by its user even under `shared`: memory facts are never shared across users;
  * the salt travels with the request wherever it runs: the prefill engine, the decoder after a
    NIXL handoff, a resumed stream (deployments/backend.py, deployments/resume.py), so the
    conversation's later turns hit its own KV on its pinned decoder.
Memory encode captures are salted per user on the engine replica (memory_store/resolver.py) and
real-time sessions keep a salt per tick of their own (baton/engine/realtime/).

A salt is a hash: the raw user id never appears in one (salts may reach engine logs).
"""
from __future__ import annotations

import hashlib
from typing import Literal, get_args

PrefixCacheScope = Literal["tenant", "shared"]
SCOPES: tuple[str, ...] = get_args(PrefixCacheScope)
TENANT_PREFIX = "baton-t-"  # a tenant's salt
COMBINED_PREFIX = "baton-mem-"  # a memory composition's salt, bound to a tenant (same prefix as layout.composition_salt)


def tenant_key(user: str | None) -> str:
    """A stable, non-reversible name of a tenant; None and "" are the anonymous tenant."""
    who = b"u\x00" + user.encode() if user else b"anonymous\x00"
    return hashlib.sha256(b"baton-tenant\x00" + who).hexdigest()[:32]


def tenant_salt(scope: PrefixCacheScope, user: str | None, composition_salt: str | None = None, *,
                private: bool = False) -> str | None:
    """The cache salt of a request by `user` (None: anonymous) under `scope`.

    composition_salt: the salt of the memories injected as KV (None: none injected).
    private: the prompt holds the user's memory facts (salted by user under either scope).
    None means unsalted: the request shares prefix-cache entries with every unsalted request."""
    if scope not in SCOPES:
        raise ValueError(f"unknown prefix-cache scope {scope!r}; expected one of {SCOPES}")
    if scope == "shared":
        if composition_salt is not None:
            return composition_salt
        return TENANT_PREFIX + tenant_key(user) if private else None
    tenant = TENANT_PREFIX + tenant_key(user)
    if composition_salt is None:
        return tenant
    return COMBINED_PREFIX + hashlib.sha256(f"{tenant}\x00{composition_salt}".encode()).hexdigest()[:32]
