"""The OpenAI API's logic, independent of Serve and HTTP: validate, render, generate, assemble.

`Backend` is where requests go (the engine pools in production, a fake engine in unit tests).
Everything a client can get wrong is caught here, before any engine work, as an APIError (4xx).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from baton.engine.types import (
    ConversationNotFound,
    EngineRequestError,
    EngineUnavailable,
    GenerationDelta,
    GenerationRequest,
    SamplingSpec,
    StageTimes,
)
from deployments.chat import PromptRenderer
from deployments.errors import APIError, bad_request, conversation_not_found, unavailable
from deployments.inflight import InflightLimit, Ticket, status_of
from deployments.metrics import IngressMetrics
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage,
)
from deployments.reply_stats import Accumulator, chain
from deployments.salt import PrefixCacheScope, tenant_salt
from deployments.tool_calls import ToolCalling, ToolPlan
from memory_store.layout import MemoryPrompt

logger = logging.getLogger("baton.api")


class Backend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]: ...


@dataclass(frozen=True)
class Reply:
    """A reply: a JSON body or an event stream (SSE text for HTTP, chunk objects for gRPC), and
    the replica that served it."""

    body: dict[str, Any] | None
    events: AsyncIterator[str] | None
    replica: str | None
    timing: StageTimes | None = None  # its first token's way (deployments/hop_timing.py)


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for an engine."""

    endpoint: str
    request: GenerationRequest
    model: str
    stream: bool
    include_usage: bool  # stream_options: a usage chunk last; continuous_usage: usage so far on every output chunk too
    tools: ToolPlan | None = None  # the request's tool calling (deployments/tool_calls.py); None: none
    continuous_usage: bool = False


Chunk = dict[str, Any] | APIError  # an OpenAI chunk object, or the error that ends a stream


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def sse_events(chunks: AsyncIterator[Chunk]) -> AsyncIterator[str]:
    """The HTTP encoding of a chunk stream: SSE events, an error as its OpenAI body, then [DONE].
    Closing this closes `chunks` (which aborts the engine request)."""
    try:
        async for c in chunks:
            yield sse(c.body() if isinstance(c, APIError) else c)
        yield sse("[DONE]")
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


class OpenAIFrontend:
    def __init__(
        self,
        *,
        model_id: str,
        renderer: PromptRenderer,
        backend: Backend,
        max_model_len: int,
        default_max_tokens: int,
        metrics: IngressMetrics,
        admission: InflightLimit | None = None,
        prefix_cache: PrefixCacheScope = "tenant",
        tools: ToolCalling | None = None,
    ):
        """admission: bounds the generation requests in flight (default: unbounded).
        prefix_cache: which requests may share prefix-cache KV (deployments/salt.py).
        tools: the model's tool-call parser (default: none, requests with tools are refused)."""
        self.model_id = model_id
        self._renderer = renderer
        self._backend = backend
        self._max_model_len = max_model_len
        self._default_max_tokens = default_max_tokens
        self._metrics = metrics
        self._admission = admission if admission is not None else InflightLimit()
        self._prefix_cache = prefix_cache
        self._tools = tools if tools is not None else ToolCalling()

    def record_rejected(self, endpoint: str, status: int) -> None:
        """Count a request refused before generation (bad input, unknown model, too long)."""
        self._metrics.request_done(endpoint, status)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "owned_by": "baton", "max_model_len": self._max_model_len}]}

    # ---- validation ------------------------------------------------------------------------
    def prepare_chat(self, body: ChatCompletionRequest, session_id: str | None, memory: MemoryPrompt | None = None) -> Prepared:
        """memory: the prompt with the user's recalled facts (deployments/memory_api.py), whose
        token ids replace the plain rendering; in KV mode it carries what the engine injects.
        The user's facts are in the prompt either way: it is salted by user in every scope."""
        self._check_common(body, with_memory=memory is not None)
        plan = self._tools.plan(body)  # tools are part of the prompt, as the model's template renders them
        renderer = self._renderer.with_tools(plan.template_tools if plan else None)
        key = f"{body.user or ''}\x00{session_id}" if session_id else None  # its turns tokenize what they append (token_prefix.py)
        ids = list(memory.token_ids) if memory is not None else renderer.chat_tokens(body.messages, key)
        p = self._prepared("chat", body, ids, body.requested_max_tokens(), session_id, plan)
        if memory is None:
            return p
        if memory.injection is None:
            salt = tenant_salt(self._prefix_cache, p.request.user, private=True)
            return replace(p, request=replace(p.request, cache_salt=salt))
        user = memory.injection.user
        salt = tenant_salt(self._prefix_cache, user, memory.cache_salt, private=True)
        req = replace(p.request, memory=memory.injection, cache_salt=salt, user=user)
        return replace(p, request=req)

    def prepare_completion(self, body: CompletionRequest, session_id: str | None) -> Prepared:
        self._check_common(body)
        if isinstance(body.prompt, str):
            ids = self._renderer.text_tokens(body.prompt)
        elif isinstance(body.prompt[0], str):
            ids = self._renderer.text_tokens(body.prompt[0])  # type: ignore[arg-type]
        else:
            ids = list(body.prompt)  # type: ignore[arg-type]
            self._renderer.check_token_ids(ids)
        if not ids:
            raise bad_request("prompt encodes to zero tokens", param="prompt")
        return self._prepared("completions", body, ids, body.requested_max_tokens(), session_id)

    def _check_common(self, body: ChatCompletionRequest | CompletionRequest, with_memory: bool = False) -> None:
        if body.model is not None and body.model != self.model_id:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_id!r}", param="model", code="model_not_found")
        if body.memories is not None and not with_memory:
            raise bad_request("memories are served on /v1/chat/completions of a deployment with a memory store (config `memory`)",
                              param="memories", code="memories_unavailable")

    def _prepared(self, endpoint: str, body: Any, ids: list[int], requested: int | None, session_id: str | None,
                  tools: ToolPlan | None = None) -> Prepared:
        n = len(ids)
        room = self._max_model_len - n
        if room < 1:
            raise bad_request(
                f"the prompt has {n} tokens; this model's context length is {self._max_model_len}",
                param="messages" if endpoint == "chat" else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else min(self._default_max_tokens, room)
        if max_tokens > room:
            raise bad_request(
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context length {self._max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        sampling = SamplingSpec(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, -1) else body.top_k,
            seed=body.seed,
            stop=body.stop_list(),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            ignore_eos=body.ignore_eos,
            constraint=tools.constraint if tools else None,
            skip_special_tokens=tools.skip_special_tokens if tools else True,
        )
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        req = GenerationRequest(request_id=f"{prefix}-{uuid.uuid4().hex}", prompt_token_ids=tuple(ids), sampling=sampling,
                                session_id=session_id, user=body.user, cache_salt=tenant_salt(self._prefix_cache, body.user))
        opts = body.stream_options
        return Prepared(endpoint=endpoint, request=req, model=self.model_id, stream=body.stream, tools=tools,
                        include_usage=bool(opts and opts.include_usage), continuous_usage=bool(opts and opts.continuous_usage_stats))

    # ---- generation ----------------------------------------------------------------------------
    def precheck(self, endpoint: str) -> None:
        """429 with Retry-After, before the body is even parsed, when no slot is free now (a
        refusal costs next to nothing); the request is admitted later, by _admit."""
        try:
            self._admission.precheck()
        except APIError as e:
            self._metrics.request_done(endpoint, e.status)
            raise

    def _admit(self, p: Prepared) -> Ticket:
        """A slot for this request, or 429 with Retry-After (deployments/inflight.py). The ticket
        is handed to whatever ends the request; nothing here counts requests."""
        try:
            return self._admission.acquire()
        except APIError as e:
            self._metrics.request_done(p.endpoint, e.status)
            raise

    async def complete(self, p: Prepared) -> Reply:
        """Non-streaming: the whole reply as one JSON body (raises APIError on failure)."""
        with self._admit(p) as ticket:
            return await self._complete(p, ticket)

    async def _complete(self, p: Prepared, ticket: Ticket | None = None) -> Reply:
        t0 = time.monotonic()
        acc = Accumulator(self._metrics, p.endpoint, t0, ticket)
        try:
            async for d in self._deltas(p):
                acc.add(d)
        except APIError as e:
            self._metrics.request_done(p.endpoint, e.status)
            raise
        except Exception:
            self._metrics.request_done(p.endpoint, 500)
            raise
        acc.finish()
        self._metrics.request_done(p.endpoint, 200)
        use = usage(acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens)
        text, rid = "".join(acc.texts), p.request.request_id
        parser = self._tools.reply(p.tools)
        if parser is not None:
            r = parser.complete(text, acc.finish_reason)
            body = chat_response(rid, p.model, r.content, r.finish_reason, use, [c.as_openai() for c in r.calls])
            return Reply(body=body, events=None, replica=acc.replica, timing=acc.timing)
        build = chat_response if p.endpoint == "chat" else completion_response
        return Reply(body=build(rid, p.model, text, acc.finish_reason, use), events=None, replica=acc.replica, timing=acc.timing)

    async def open_stream(self, p: Prepared) -> Reply:
        """Streaming over HTTP: `events` are SSE text (`data: {...}`, then `data: [DONE]`)."""
        return await self._open(p, sse_events)

    async def open_chunks(self, p: Prepared) -> Reply:
        """Streaming for other transports (gRPC): `events` are the OpenAI chunk objects, and a
        failure after the first token is one last item, the APIError (status and body)."""
        return await self._open(p, None)

    async def _open(self, p: Prepared, encode: Callable[[AsyncIterator[Chunk]], AsyncIterator[Any]] | None) -> Reply:
        """Waits for the engine's first output so that a failure before any token is a proper
        error (raised here); later failures arrive in the stream."""
        ticket = self._admit(p)
        try:
            reply = await self._open_stream(p, ticket)
        except BaseException as e:
            ticket.release(status_of(e))
            raise
        if reply.events is not None:
            if encode is not None:
                reply = replace(reply, events=encode(reply.events))
            weakref.finalize(reply.events, ticket.release)  # a stream the server never starts still gives its slot back
        return reply

    async def _open_stream(self, p: Prepared, ticket: Ticket) -> Reply:
        t0 = time.monotonic()
        acc = Accumulator(self._metrics, p.endpoint, t0, ticket)
        deltas = self._deltas(p)
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            first = None
        except APIError as e:
            self._metrics.request_done(p.endpoint, e.status)
            raise
        except Exception:
            self._metrics.request_done(p.endpoint, 500)
            raise
        replica, timing = (first.replica, first.timing) if first is not None else (None, None)
        return Reply(body=None, events=self._stream_chunks(p, acc, first, deltas, ticket), replica=replica, timing=timing)

    async def _stream_chunks(self, p: Prepared, acc: Accumulator, first: GenerationDelta | None, rest: AsyncIterator[GenerationDelta],
                             ticket: Ticket) -> AsyncIterator[Chunk]:
        rid, model = p.request.request_id, p.model
        status = 499  # client went away unless we get to the end
        try:
            if p.endpoint == "chat":
                yield chat_chunk(rid, model, {"role": "assistant", "content": ""})
            pending = [first] if first is not None else []
            parser = self._tools.reply(p.tools, p.request.prompt_token_ids)
            async for d in chain(pending, rest):
                acc.add(d)
                so_far = usage(acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens) if p.continuous_usage else None
                if parser is not None:  # tool calls: the parser decides what each delta sends
                    for delta, finish in parser.feed(d):
                        yield chat_chunk(rid, model, delta, finish, so_far)
                elif d.text or d.finished:
                    end = d.finish_reason if d.finished else None
                    yield (chat_chunk(rid, model, {"content": d.text} if d.text else {}, end, so_far) if p.endpoint == "chat"
                           else completion_chunk(rid, model, d.text, end, so_far))
            acc.finish()
            if p.include_usage:
                use = usage(acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens)
                yield chat_chunk(rid, model, {}, None, use) if p.endpoint == "chat" else completion_chunk(rid, model, "", None, use)
            status = 200
        except APIError as e:
            status = e.status
            yield e
        except Exception as e:  # a bug of ours mid-stream: end the stream cleanly, log the trace
            logger.exception("unexpected error while streaming %s", rid)
            status = 500
            yield APIError(500, f"internal error ({type(e).__name__})", type="server_error", code="internal_error")
        finally:
            ticket.release(status)
            await rest.aclose()  # type: ignore[attr-defined]  # aborts the engine request if unfinished
            self._metrics.request_done(p.endpoint, status)

    async def _deltas(self, p: Prepared) -> AsyncIterator[GenerationDelta]:
        gen = self._backend.generate(p.request)
        try:
            async for d in gen:
                yield d
        except EngineUnavailable as e:
            raise unavailable(str(e)) from None
        except EngineRequestError as e:
            raise bad_request(f"the engine rejected the request: {e}", code="engine_rejected") from None
        except ConversationNotFound:
            raise conversation_not_found() from None
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()
