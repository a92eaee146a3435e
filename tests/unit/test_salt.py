"""Prefix-cache isolation by tenant (deployments/salt.py, issue 11): the salt every request
carries, from the ingress (OpenAIFrontend over HTTP, API keys bound to users) to the prefill
pool and the decoder after a NIXL handoff (PoolBackend over fake Serve handles), a resumed
stream, and the memory encode captures on an engine replica (SegmentResolver over a fake
capturer). vLLM hits a request's prefix only under an equal salt, so equal salt = may share KV."""
from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import torch
from fakes import FakeBackend, FakeDirectory, FakePoolHandle, FakeResponseStream, FakeTokenizer, scripted_deltas
from fastapi.testclient import TestClient
from pydantic import ValidationError
from ray import exceptions as rx

from baton.engine.types import GenerationRequest, SamplingSpec
from deployments.chat import PromptRenderer
from deployments.config import IsolationConfig, load_app_config
from deployments.frontend import OpenAIFrontend
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from deployments.protocol import ChatCompletionRequest, CompletionRequest
from deployments.salt import COMBINED_PREFIX, TENANT_PREFIX, tenant_key, tenant_salt
from kv_transfer.injection import MemoryFact, MemoryInjection
from kv_transfer.segments import KVSegment
from memory_store.layout import RecalledFact, encode_salt, memory_prompt
from memory_store.resolver import SegmentResolver
from router.policy import TurnPlan

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.backend import PoolBackend

COMPOSITION = "baton-mem-" + "c" * 32


# ---- the pure policy ---------------------------------------------------------------------------------


def test_tenant_scope_salts_differ_across_users_and_match_within_one() -> None:
    a, b = tenant_salt("tenant", "alice"), tenant_salt("tenant", "bob")
    assert a and b and a != b
    assert tenant_salt("tenant", "alice") == a  # every request of alice's: her turns hit each other's KV
    assert a.startswith(TENANT_PREFIX) and "alice" not in a  # a hash, never the raw user id


def test_anonymous_callers_share_one_tenant_that_no_user_can_name() -> None:
    anon = tenant_salt("tenant", None)
    assert anon == tenant_salt("tenant", "") and anon is not None
    assert anon not in {tenant_salt("tenant", u) for u in ("anonymous", "anonymous\x00", "None", "u\x00")}
    assert tenant_key(None) != tenant_key("anonymous")


def test_shared_scope_has_no_tenant_salt_only_a_composition_salt() -> None:
    assert tenant_salt("shared", "alice") is None and tenant_salt("shared", None) is None
    assert tenant_salt("shared", "alice", COMPOSITION) == COMPOSITION  # injected memories keep theirs
    # a prompt holding the user's memory facts is salted by user even when prompts are shared
    assert tenant_salt("shared", "alice", private=True) == tenant_salt("tenant", "alice")


def test_tenant_scope_binds_a_composition_salt_to_its_tenant() -> None:
    a, b = tenant_salt("tenant", "alice", COMPOSITION), tenant_salt("tenant", "bob", COMPOSITION)
    assert a and b and a != b and COMPOSITION not in {a, b}
    assert a.startswith(COMBINED_PREFIX) and a != tenant_salt("tenant", "alice")
    assert tenant_salt("tenant", "alice", COMPOSITION) == a
    assert tenant_salt("tenant", "alice", "baton-mem-" + "d" * 32) != a


def test_an_unknown_scope_is_refused() -> None:
    with pytest.raises(ValueError, match="scope"):
        tenant_salt("global", "alice")  # type: ignore[arg-type]


def test_the_config_defaults_to_tenant_and_accepts_shared_only() -> None:
    assert IsolationConfig().prefix_cache == "tenant"
    base = {"routing": {"policy": "colocated"}, "decode": {"engine": {"model": "m"}}}
    assert load_app_config(base).isolation.prefix_cache == "tenant"
    assert load_app_config({**base, "isolation": {"prefix_cache": "shared"}}).isolation.prefix_cache == "shared"
    for bad in ({"prefix_cache": "none"}, {"prefix_caching": "shared"}):
        with pytest.raises(ValidationError):
            IsolationConfig.model_validate(bad)


# ---- the ingress: every request carries its tenant's salt ------------------------------------------------


def frontend(backend: FakeBackend, scope: str = "tenant") -> OpenAIFrontend:
    return OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=backend, max_model_len=256,
                          default_max_tokens=4, metrics=RecordingMetrics(), prefix_cache=scope)  # type: ignore[arg-type]


@pytest.mark.parametrize("scope", ["tenant", "shared"])
def test_requests_carry_the_salt_of_their_scope(scope: str) -> None:
    f = frontend(FakeBackend(), scope)
    chat = {"messages": [{"role": "user", "content": "the same long prompt"}]}
    salts = {u: f.prepare_chat(ChatCompletionRequest(**chat, user=u), None).request.cache_salt for u in ("alice", "bob", None)}
    done = f.prepare_completion(CompletionRequest(prompt="the same long prompt", user="alice"), None).request.cache_salt
    if scope == "tenant":
        assert len(set(salts.values())) == 3 and salts["alice"] == done == tenant_salt("tenant", "alice")
    else:
        assert set(salts.values()) == {None} and done is None


def test_memory_requests_are_salted_by_their_user_in_both_scopes() -> None:
    renderer = PromptRenderer(FakeTokenizer())
    msgs = [{"role": "user", "content": "hi"}]
    facts = [RecalledFact("f1", "Alice plays the violin")]
    kv = memory_prompt(renderer, msgs, facts, user="alice", model="m", window=0, inject=True)
    text = memory_prompt(renderer, msgs, facts, user="alice", model="m", window=0, inject=False)
    body = ChatCompletionRequest(messages=msgs, memories={"k": 1}, user="alice")
    for scope in ("tenant", "shared"):
        f = frontend(FakeBackend(), scope)
        assert f.prepare_chat(body, None, text).request.cache_salt == tenant_salt("tenant", "alice")
        assert f.prepare_chat(body, None, kv).request.cache_salt == tenant_salt(scope, "alice", kv.cache_salt)  # type: ignore[arg-type]
    assert frontend(FakeBackend(), "shared").prepare_chat(body, None, kv).request.cache_salt == kv.cache_salt


def test_api_keys_bound_to_users_decide_the_tenant_whatever_the_body_claims() -> None:
    """Issue 11's oracle: B sends A's prompt; with B's key it runs under B's salt, so it cannot hit
    the KV of A's request (cached_tokens says nothing about A)."""
    backend = FakeBackend()

    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    client = TestClient(build_openai_app(frontend(backend), health, api_keys={"ka": "alice", "kb": "bob"}))
    body = {"messages": [{"role": "user", "content": "alice's private 1,436-token prompt"}], "max_tokens": 2}
    for key in ("ka", "kb"):
        r = client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    a, b = (req.cache_salt for req in backend.requests)
    assert a == tenant_salt("tenant", "alice") and b == tenant_salt("tenant", "bob") and a != b
    assert a == backend.requests[0].cache_salt and backend.requests[0].prompt_token_ids == backend.requests[1].prompt_token_ids



@pytest.mark.parametrize("mode", ["prompt", "kv"])
def test_a_memory_user_named_by_header_is_the_requests_tenant(tmp_path: Any, mode: str) -> None:
    from test_memory_api import ALICE_FACTS, make_api

    api = make_api(tmp_path, mode=mode)
    api.add("alice", ALICE_FACTS)
    r = api.chat({"k": 1}, user=None, content="violin", headers={"x-baton-user": "alice"})
    assert r.status_code == 200, r.text
    req = api.backend.last
    assert req.user == "alice" and req.cache_salt is not None
    if mode == "prompt":  # facts in the prompt: alice's salt, the same as her turns without memories
        assert req.cache_salt == tenant_salt("tenant", "alice")
    else:
        assert req.cache_salt.startswith(COMBINED_PREFIX) and req.cache_salt != tenant_salt("tenant", "alice")

# ---- the backend: the salt travels to the prefill pool, the decoder and a resumed stream ----------------------

KV = {"remote_block_ids": [1, 2], "remote_engine_id": "prefill-0", "do_remote_prefill": True}


def serve(backend: PoolBackend, req: GenerationRequest) -> int:
    async def run() -> int:
        return len([d async for d in backend.generate(req)])

    return asyncio.run(run())


def salted(user: str) -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt_token_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=4), session_id="s",
                             user=user, cache_salt=tenant_salt("tenant", user))


def test_the_salt_reaches_the_prefill_pool_and_the_decoder_after_a_nixl_handoff() -> None:
    decode = FakePoolHandle([FakeResponseStream(scripted_deltas(3, replica="d0"))])
    prefill = FakePoolHandle([FakeResponseStream(scripted_deltas(1, replica="p0", kv_transfer_params=KV))])
    serve(PoolBackend(decode, prefill, FakeDirectory([TurnPlan("d0", remote_prefill=True, reason="new")])), salted("alice"))
    (p,), (d,) = prefill.sent, decode.sent
    assert d.kv_transfer_params == KV  # the decoder loads the prefill's KV ...
    assert p.cache_salt == d.cache_salt == tenant_salt("tenant", "alice")  # ... and registers it under the same salt


def test_a_resumed_stream_keeps_the_salt() -> None:
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned"), TurnPlan("d1", remote_prefill=False, reason="repinned")])
    dies = FakeResponseStream(scripted_deltas(3, replica="d0"), error=rx.ActorDiedError(), error_after=1)
    decode = FakePoolHandle([dies, FakeResponseStream(scripted_deltas(3))])
    serve(PoolBackend(decode, None, directory), salted("bob"))
    assert [r.target_replica for r in decode.sent] == ["d0", "d1"]
    assert {r.cache_salt for r in decode.sent} == {tenant_salt("tenant", "bob")}


# ---- memory encode captures: salted per user on the engine replica --------------------------------------------


class RecordingCapturer:
    def __init__(self) -> None:
        self.salts: list[str | None] = []

    async def capture(self, request_id: str, prompt_token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
                      cache_salt: str | None = None) -> tuple[KVSegment, ...]:
        self.salts.append(cache_salt)
        (a, b), = ranges
        k = torch.zeros(1, b - a, 1, 2)
        return (KVSegment(tuple(prompt_token_ids[a:b]), k, k.clone()),)


def encode_for(user: str) -> list[str | None]:
    engine = RecordingCapturer()
    anchor, fact = (11, 12, 13), (21, 22)
    m = MemoryInjection(user=user, anchor_len=3, facts=(MemoryFact("f1", 3, fact),), window=0, model="m")
    asyncio.run(SegmentResolver(engine, None, 1 << 20).resolve(anchor + fact + (99,), m))
    return engine.salts


def test_memory_encode_captures_are_salted_per_user() -> None:
    alice, bob = encode_for("alice"), encode_for("bob")
    assert len(alice) == 2 and set(alice) == {encode_salt("alice")}  # the anchor and the fact
    assert set(bob) == {encode_salt("bob")} and encode_salt("alice") != encode_salt("bob")
    assert "alice" not in encode_salt("alice")
    assert encode_salt("alice") not in {tenant_salt("tenant", "alice"), tenant_salt("tenant", "bob")}
