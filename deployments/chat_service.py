"""One generation request, whatever its transport (HTTP in openai_api.py, gRPC in grpc_api.py).

Both transports call the same steps in the same order, so validation, admission, routing,
memories and tool calling exist once:

    precheck(endpoint)          429 before the body is read when no slot is free (InflightLimit)
    prepare(endpoint, read, c)  body in (the transport's read: size bound, JSON or proto), the API
                                key's user, the session id, input limits, memories, rendering
                                off the event loop -> Ready; every refusal is counted
    respond(ready) / stream(ready)
                                the frontend's complete / open_stream (SSE) / open_chunks (objects)

Ready.memory is the recalled facts of a chat that asked for memories: each transport tells the
client which ones (memory_api.memory_headers).

A transport only turns its request into a body and the Reply into its own wire format.
"""
from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from baton.engine.types import StageTimes
from deployments.errors import APIError, bad_request
from deployments.frontend import OpenAIFrontend, Prepared, Reply
from deployments.input_limits import InputLimits, check_input
from deployments.memory_api import MemoryFrontend, resolve_user
from deployments.offload import Offload
from deployments.protocol import SESSION_ID_MAX, ChatCompletionRequest
from memory_store.layout import MemoryPrompt

SESSION_RE = re.compile(rf"^[A-Za-z0-9._:@/+=-]{{1,{SESSION_ID_MAX}}}$")


@dataclass(frozen=True)
class CallContext:
    """What a request says about itself outside its body: the user its API key is bound to (None:
    an operator key or no keys), the x-baton-user header, the x-session-id header (HTTP headers or
    gRPC metadata alike)."""

    bound_user: str | None = None
    user_header: str | None = None
    session_header: str | None = None


@dataclass(frozen=True)
class Ready:
    """A prepared request and what its transport tells the client besides the reply: its session
    id and, for a chat that asked for memories, the recalled facts (memory_api.memory_headers)."""

    prepared: Prepared
    session_id: str | None
    timing: StageTimes = StageTimes()  # received and prepared (the reply's first delta adds the rest)
    memory: MemoryPrompt | None = None  # None: no memories asked for


def check_session_id(sid: str) -> str:
    if not SESSION_RE.match(sid):
        raise bad_request(f"session id must be 1-{SESSION_ID_MAX} characters of [A-Za-z0-9._:@/+=-]", param="session_id")
    return sid


def session_id(header: str | None, body_session: str | None) -> str | None:
    """The conversation id: the x-session-id header (or metadata), or the body's session_id; they
    must agree."""
    if header is not None and body_session is not None and header != body_session:
        raise bad_request("x-session-id header and body session_id differ", param="session_id")
    sid = header if header is not None else body_session
    return check_session_id(sid) if sid is not None else None


class ChatService:
    def __init__(self, frontend: OpenAIFrontend, memory: MemoryFrontend | None = None, limits: InputLimits | None = None):
        self.frontend = frontend
        self.memory = memory
        self.limits = limits or InputLimits()
        self._render = Offload(self.limits.render_threads)  # templating and tokenization run here, off the event loop

    def precheck(self, endpoint: str) -> None:
        self.frontend.precheck(endpoint)  # overloaded: 429 before the body is read

    async def prepare(self, endpoint: str, read: Callable[[], Awaitable[Any]], call: CallContext) -> Ready:
        """`read()` gives the validated body (ChatCompletionRequest for chat, CompletionRequest
        for completions) or raises its APIError (413, 400)."""
        received = time.time()
        try:
            body = await read()
            if call.bound_user is not None:  # an API key bound to a user speaks for that user only
                resolve_user(call.bound_user, body.user, call.user_header, required=False)
                body = body.model_copy(update={"user": call.bound_user})
            sid = session_id(call.session_header, body.session_id)
            check_input(body, self.limits, self.frontend.max_model_len)  # before any rendering
            if endpoint == "chat":
                ready = await self._prepare_chat(body, sid, call)
            else:
                ready = Ready(await self._render.run(self.frontend.prepare_completion, body, sid), sid)
        except APIError as e:
            self.frontend.record_rejected(endpoint, e.status)
            raise
        return replace(ready, timing=StageTimes(received=received, prepared=time.time()))

    async def _prepare_chat(self, body: ChatCompletionRequest, sid: str | None, call: CallContext) -> Ready:
        if body.memories is None or self.memory is None:
            return Ready(await self._render.run(self.frontend.prepare_chat, body, sid), sid)
        user = resolve_user(call.bound_user, body.user, call.user_header, required=True)
        assert user is not None
        # the memories' user is the request's (and its tenant's, deployments/salt.py) in both modes
        recalled = await self.memory.chat_prompt(body, user)
        prepared = await self._render.run(self.frontend.prepare_chat, body.model_copy(update={"user": user}), sid, recalled)
        return Ready(prepared, sid, memory=recalled)

    async def respond(self, ready: Ready) -> Reply:
        """HTTP: a JSON body, or SSE events for a streaming request."""
        p = ready.prepared
        return _timed(await (self.frontend.open_stream(p) if p.stream else self.frontend.complete(p)), ready)

    async def respond_chunks(self, ready: Ready) -> Reply:
        """Other transports: a JSON body, or chunk objects (a failure mid-stream: a last APIError)."""
        p = ready.prepared
        return _timed(await (self.frontend.open_chunks(p) if p.stream else self.frontend.complete(p)), ready)


def _timed(reply: Reply, ready: Ready) -> Reply:
    """The reply's stage times with the ingress's own (received, prepared)."""
    timing = replace(reply.timing or StageTimes(), received=ready.timing.received, prepared=ready.timing.prepared)
    return replace(reply, timing=timing)

