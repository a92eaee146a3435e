"""The ingress's memory surface: /v1/memories and the `memories` option of chat requests.

`MemoryFrontend` talks to the memory-store actor (memory_store/deployment.py) through a handle
and renders recalled facts into the prompt (memory_store/layout.py). Errors of the store become
OpenAI-style errors: bad input 400, a fact that is not the caller's 404 (the same answer as for
an id that does not exist, so nothing leaks), the store unreachable 503.

Who the user is: the caller names it (`user` in the body, the x-baton-user header or `?user=`);
when API keys are bound to users (ingress.api_keys_env entries `key=user`) the key decides, and
naming another user anywhere is refused with 403. Operator keys (bound to no user) may name any.

What the client is told (memory_headers): a chat reply that asked for memories carries
`x-baton-memories` (the recalled fact ids, comma-separated, in prompt order; empty when none was
recalled), `x-baton-memory-mode` (`kv` when KV was injected, else `prompt`) and
`x-baton-memories-injected` (how many of the listed facts, from the first, came as KV; the rest were
computed: memory.recompute_tail_tokens, or prompt mode).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from deployments.chat import PromptRenderer
from deployments.errors import APIError, bad_request, unavailable
from deployments.protocol import AddMemoriesRequest, ChatCompletionRequest
from deployments.tool_schema import template_tools
from memory_store.config import MemoryConfig
from memory_store.errors import FactNotFound, IdempotencyKeyReused, InvalidInput
from memory_store.idempotency import validate_key
from memory_store.ingest import conversation_facts
from memory_store.layout import RESERVED_MARK, LineTokens, MemoryPrompt, RecalledFact, memory_prompt

logger = logging.getLogger("baton.api")

USER_HEADER = "x-baton-user"
IDEMPOTENCY_HEADER = "idempotency-key"
MEMORIES_HEADER = "x-baton-memories"  # the recalled fact ids, in prompt order
MEMORY_MODE_HEADER = "x-baton-memory-mode"  # kv | prompt
MEMORIES_INJECTED_HEADER = "x-baton-memories-injected"  # how many of the listed facts came as KV
STORE_TIMEOUT_S = 10.0


def resolve_user(bound: str | None, *claims: str | None, required: bool) -> str | None:
    """The request's user. A key bound to a user decides, and every claim (body `user`, the
    x-baton-user header, `?user=`) must name that user (403 otherwise); with an operator key or
    no keys, the first non-empty claim, in that order."""
    named = [c for c in claims if c]
    if bound is not None:
        if any(c != bound for c in named):
            raise APIError(403, "the API key belongs to another user", param="user", code="user_mismatch")
        return bound
    if required and not named:
        raise bad_request("memories need a user: send `user` in the body or the x-baton-user header", param="user", code="user_required")
    return named[0] if named else None


def memory_headers(memory: MemoryPrompt | None) -> dict[str, str]:
    """The HTTP reply headers that say which facts a request recalled and how they
    reached the engine; none for a request that asked for no memories."""
    if memory is None:
        return {}
    return {MEMORIES_HEADER: ",".join(memory.fact_ids), MEMORY_MODE_HEADER: memory.mode,
            MEMORIES_INJECTED_HEADER: str(memory.injected_facts)}


def store_error(e: BaseException) -> APIError:
    cause = getattr(e, "cause", None) or e  # RayTaskError carries the actor's exception as .cause
    if isinstance(cause, FactNotFound):
        return APIError(404, f"memory not found: {', '.join(cause.ids[:5])}", param="ids", code="memory_not_found")
    if isinstance(cause, IdempotencyKeyReused):
        return APIError(422, str(cause), param="Idempotency-Key", code="idempotency_key_reused")
    if isinstance(cause, InvalidInput):
        return bad_request(str(cause), code="invalid_memory")
    if isinstance(cause, APIError):
        return cause
    logger.warning("memory store call failed: %s", type(cause).__name__)
    return unavailable(f"memory store unavailable ({type(cause).__name__})")


class MemoryFrontend:
    def __init__(self, cfg: MemoryConfig, store: Any, renderer: PromptRenderer, model: str, encoder: Any | None = None):
        self._cfg = cfg
        self._store = store
        self._renderer = renderer
        self._lines = LineTokens(renderer)  # fact lines' token ids (with tools or not: the same tokenizer)
        self._model = model
        self._encoder = encoder  # the decode pool handle: precomputes KV of newly added facts
        self._background: set[asyncio.Task] = set()

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self._store, method).remote(*args), STORE_TIMEOUT_S)
        except TimeoutError:
            raise unavailable("memory store did not answer in time") from None
        except Exception as e:  # noqa: BLE001 - mapped to 400/404/503
            raise store_error(e) from None

    # ---- /v1/memories ------------------------------------------------------------------------
    async def add(self, user: str, body: AddMemoriesRequest, session_id: str | None,
                  idempotency_key: str | None = None) -> dict[str, Any]:
        """Add facts. With an Idempotency-Key (per user, remembered memory.idempotency_ttl_h), a
        retry of the same request answers the same facts and adds nothing; the key with another
        request is 422 idempotency_key_reused (memory_store/idempotency.py)."""
        if idempotency_key is not None:
            try:
                validate_key(idempotency_key)
            except InvalidInput as e:
                raise bad_request(str(e), param="Idempotency-Key", code="invalid_idempotency_key") from None
        if body.facts is not None:
            texts, source = body.facts, body.source or "api"
        else:
            texts = conversation_facts([m.model_dump() for m in body.messages or []])
            source = body.source or session_id or "api"
            if not texts:
                raise bad_request("the messages hold no user or assistant turns", param="messages")
        facts = await self._call("add", user, texts, source, idempotency_key)
        if facts and self._cfg.mode == "kv" and self._encoder is not None:
            self._precompute(user, facts)
        return {"object": "list", "data": [f.as_json() for f in facts]}

    async def list(self, user: str, limit: int, offset: int) -> dict[str, Any]:
        if not 1 <= limit <= 1000 or not 0 <= offset < 2**63:  # SQLite integers are 64-bit
            raise bad_request("limit must be in [1, 1000] and offset in [0, 2^63)", param="limit")
        facts = await self._call("list", user, limit, offset)
        return {"object": "list", "data": [f.as_json() for f in facts]}

    async def get(self, user: str, fact_id: str) -> dict[str, Any]:
        (fact,) = await self._call("get", user, [fact_id])
        return fact.as_json()

    async def delete(self, user: str, fact_id: str) -> dict[str, Any]:
        await self._call("delete", user, [fact_id])
        return {"id": fact_id, "object": "memory.deleted", "deleted": True}

    async def delete_all(self, user: str) -> dict[str, Any]:
        n = await self._call("delete_all", user)
        return {"object": "memory.deleted", "deleted": n}

    # ---- chat with memories ------------------------------------------------------------------
    async def chat_prompt(self, body: ChatCompletionRequest, user: str) -> MemoryPrompt:
        opt = body.memories
        assert opt is not None
        window = self._cfg.context_window if opt.window is None else opt.window
        mode = opt.mode or self._cfg.mode
        k = opt.k or self._cfg.default_k
        if k > self._cfg.max_k:
            raise bad_request(f"memories.k must be at most {self._cfg.max_k}", param="memories.k")
        query = next((m.text() for m in reversed(body.messages) if m.role == "user"), "")
        messages = self._renderer.template_messages(body.messages)
        if any(RESERVED_MARK in str(m.get("content") or "") for m in messages):  # before any store work
            raise bad_request("message content contains a reserved control sequence", param="messages")
        recall = await self._call("recall", user, query, k, window, tuple(opt.ids or ()))
        try:
            # templating and tokenizing a long conversation: off the event loop (deployments/offload.py)
            renderer = self._renderer.with_tools(template_tools(body.tools))  # tools are part of the rendered prompt
            return await asyncio.to_thread(memory_prompt, renderer, messages, recall.facts, user=user, model=self._model,
                                           window=window, inject=mode == "kv", deletions=recall.deletions,
                                           recompute_tail=self._cfg.recompute_tail_tokens, line_tokens=self._lines)
        except ValueError as e:  # the client's messages cannot be laid out with memories: 400, not 500
            raise bad_request(str(e), param="messages") from None

    def _precompute(self, user: str, facts: list[Any]) -> None:
        """Encode the new facts' KV on a decode replica in the background (InferScale's
        precomputation); a failure only means the first request that recalls them encodes them."""
        recalled = [RecalledFact(f.id, f.text) for f in facts]

        async def run() -> None:
            try:
                window, mark = self._cfg.context_window, ("", 0)
                if window:
                    recall = await self._call("recall", user, "", 1, window, tuple(f.id for f in facts))
                    recalled_ctx, mark = list(recall.facts), recall.deletions
                else:
                    recalled_ctx = recalled
                p = memory_prompt(self._renderer, [{"role": "user", "content": ""}], recalled_ctx,
                                  user=user, model=self._model, window=window, inject=True, deletions=mark,
                                  line_tokens=self._lines)
                if p.injection is not None:
                    await self._encoder.encode_memories.remote(p.token_ids, p.injection)
            except Exception as e:  # noqa: BLE001 - best effort
                logger.warning("precomputing memory KV failed: %s", type(e).__name__)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
