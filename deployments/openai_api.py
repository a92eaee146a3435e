"""HTTP surface: the FastAPI app (routes, error handlers, session ids) over an OpenAIFrontend.

Conversations: a session id (x-session-id header or body `session_id`) names a conversation; it
belongs to the user who opened it (body `user`, or the API key's user). DELETE
/v1/conversations/{id} lets that user end it (its pin and ownership go; the id is free again);
the user is named as for /v1/memories (API key, `x-baton-user` header or `user` query
parameter; none for a conversation opened without a user)."""
from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api_keys import access_refusal, authenticate, authorized
from deployments.api_keys import api_keys_from_env as api_keys_from_env  # re-exported: the ingress imports it from here
from deployments.chat_service import CallContext, ChatService, Ready, check_session_id, session_id
from deployments.errors import APIError, bad_request, conversation_not_found, unavailable
from deployments.frontend import OpenAIFrontend, Reply
from deployments.hop_timing import server_timing
from deployments.input_limits import InputLimits
from deployments.memory_api import IDEMPOTENCY_HEADER, USER_HEADER, MemoryFrontend, memory_headers, resolve_user
from deployments.protocol import AddMemoriesRequest, ChatCompletionRequest, CompletionRequest
from deployments.realtime_api import CLOSE_POLICY, RealtimeFrontend
from deployments.request_body import parse_body

logger = logging.getLogger("baton.api")

SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "x-baton-replica"  # which engine replica served the request (debugging, tests)
INGRESS_HEADER = "x-baton-ingress"  # which ingress replica answered
_FACT_ID_RE = re.compile(r"^[0-9a-f]{32}$")

HealthCheck = Callable[[], Awaitable[dict[str, Any]]]
EndConversation = Callable[[str, str | None], Awaitable[bool]]  # (session id, user) -> whether that user's conversation ended
DescribeConversation = Callable[[str, str | None], Awaitable[dict[str, Any] | None]]  # (session id, user) -> its info, None: not theirs


def session_id_of(request: Request, body_session: str | None) -> str | None:
    """The conversation id: the x-session-id header, or the body's session_id; they must agree."""
    return session_id(request.headers.get(SESSION_HEADER), body_session)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as `model`, within this app's ingress.max_body_bytes (deployments/request_body.py)."""
    return await parse_body(request, model, request.app.state.input_limits.max_body_bytes)


def build_openai_app(
    frontend: OpenAIFrontend,
    health: HealthCheck,
    stats: HealthCheck | None = None,
    ingress_id: str | None = None,
    api_keys: Mapping[str, str | None] | None = None,
    memory: MemoryFrontend | None = None,
    realtime: RealtimeFrontend | None = None,
    end_conversation: EndConversation | None = None,
    limits: InputLimits | None = None,
    chat: ChatService | None = None,
    describe_conversation: DescribeConversation | None = None,
) -> FastAPI:
    """limits: the request bounds (deployments/input_limits.py; default: InputLimits()).
    chat: the generation requests' shared logic (deployments/chat_service.py), when the ingress
    shares it with another transport; default: one over `frontend`, `memory` and `limits`."""
    app = FastAPI(title="Baton", description="OpenAI-compatible conversation serving on Ray Serve", version="0.1.0")
    chat_service = chat or ChatService(frontend, memory, limits)
    app.state.input_limits = chat_service.limits

    if api_keys:

        @app.middleware("http")
        async def _require_api_key(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
            caller = authenticate(request.headers.get("authorization"), api_keys)
            refusal = access_refusal(_route_path(request), caller)
            if refusal is not None:
                return refusal.response()
            request.state.bound_user = caller.user
            return await call_next(request)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(str(exc.errors()[:1]), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # a bug of ours: log it with the trace, answer without one
        logger.exception("unexpected error in the ingress")
        return APIError(500, f"internal error ({type(exc).__name__})", type="server_error", code="internal_error").response()

    @app.get("/health")
    async def health_route() -> JSONResponse:
        report = await health()
        return JSONResponse(report, status_code=200 if report.get("status") == "ok" else 503)

    if stats is not None:

        @app.get("/baton/stats")
        async def stats_route() -> JSONResponse:
            """Routing state: policy, live pins, handoffs, each replica's reported load and KV transfers."""
            try:
                return JSONResponse(await stats())
            except Exception as e:  # noqa: BLE001
                raise APIError(503, f"directory unavailable: {type(e).__name__}") from None

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return frontend.models()

    async def serve_one(request: Request, endpoint: str, model: type[BaseModel]) -> Any:
        chat_service.precheck(endpoint)  # overloaded: 429 before the body is read
        call = CallContext(_bound_user(request), request.headers.get(USER_HEADER), request.headers.get(SESSION_HEADER))
        ready = await chat_service.prepare(endpoint, lambda: _parse(request, model), call)
        return _respond(await chat_service.respond(ready), ready, ingress_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await serve_one(request, "chat", ChatCompletionRequest)

    if memory is not None:
        _memory_routes(app, memory)

    if end_conversation is not None:
        _conversation_routes(app, end_conversation, describe_conversation)

    if realtime is not None:

        @app.websocket("/v1/realtime")
        async def realtime_session(ws: WebSocket) -> None:
            # HTTP middleware does not see WebSocket handshakes: check the key here
            if api_keys and not authorized(ws.headers.get("authorization"), api_keys):
                await ws.close(CLOSE_POLICY, reason="invalid or missing API key")
                return
            await realtime.serve(ws, authenticate(ws.headers.get("authorization"), api_keys).user if api_keys else None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serve_one(request, "completions", CompletionRequest)

    return app


def _bound_user(request: Request) -> str | None:
    return getattr(request.state, "bound_user", None)


def _route_path(request: Request) -> str:
    """The path the router matches (url.path also holds a mount's root_path): the key rules must
    judge exactly the path that picks the route."""
    return get_route_path(request.scope) or "/"


def _memory_user(request: Request, claimed: str | None = None) -> str:
    user = resolve_user(_bound_user(request), claimed, request.headers.get(USER_HEADER), request.query_params.get("user"), required=True)
    assert user is not None
    return user


def _memory_routes(app: FastAPI, memory: MemoryFrontend) -> None:
    """/v1/memories: add (facts or a conversation), list, get, delete one, delete all — all scoped
    to the request's user (resolve_user)."""

    @app.post("/v1/memories")
    async def add_memories(request: Request) -> Any:
        body = await _parse(request, AddMemoriesRequest)
        sid = session_id_of(request, None)
        return await memory.add(_memory_user(request, body.user), body, sid, request.headers.get(IDEMPOTENCY_HEADER))

    @app.get("/v1/memories")
    async def list_memories(request: Request, limit: int = 100, offset: int = 0) -> Any:
        return await memory.list(_memory_user(request), limit, offset)

    @app.get("/v1/memories/{fact_id}")
    async def get_memory(request: Request, fact_id: str) -> Any:
        return await memory.get(_memory_user(request), _fact_id(fact_id))

    @app.delete("/v1/memories/{fact_id}")
    async def delete_memory(request: Request, fact_id: str) -> Any:
        return await memory.delete(_memory_user(request), _fact_id(fact_id))

    @app.delete("/v1/memories")
    async def delete_memories(request: Request) -> Any:
        return await memory.delete_all(_memory_user(request))


def _conversation_routes(app: FastAPI, end_conversation: EndConversation, describe: DescribeConversation | None) -> None:
    """DELETE /v1/conversations/{id}: the owner ends a conversation; GET: the owner sees its
    decoder, turns, handoffs and context (router/conversation_info.ConversationInfo). 404 (the
    same body) for one that is someone else's or nobody's; 503 with Retry-After when the
    directory cannot answer."""

    async def ask(request: Request, session_id: str, what: str, call: Callable[[str, str | None], Awaitable[Any]]) -> Any:
        """The directory's answer for the request's user; 404 when it has none (falsy), 503 when
        it cannot answer."""
        check_session_id(session_id)
        user = resolve_user(_bound_user(request), request.headers.get(USER_HEADER), request.query_params.get("user"), required=False)
        try:
            answer = await call(session_id, user)
        except Exception as e:  # noqa: BLE001 - the directory is down or slow: the client retries
            logger.warning("%s a conversation failed: %s", what, type(e).__name__)
            raise unavailable(f"conversation directory unavailable ({type(e).__name__})") from None
        if not answer:
            raise conversation_not_found()
        return answer

    @app.delete("/v1/conversations/{session_id:path}")
    async def delete_conversation(request: Request, session_id: str) -> Any:
        await ask(request, session_id, "ending", end_conversation)
        return {"id": session_id, "object": "conversation.deleted", "deleted": True}

    if describe is None:
        return

    @app.get("/v1/conversations/{session_id:path}")
    async def get_conversation(request: Request, session_id: str) -> Any:
        return await ask(request, session_id, "describing", describe)


def _fact_id(fact_id: str) -> str:
    if not _FACT_ID_RE.match(fact_id):
        raise bad_request("a memory id is 32 lowercase hex characters", param="id", code="invalid_memory_id")
    return fact_id


def _respond(reply: Reply, ready: Ready, ingress_id: str | None) -> Any:
    """The reply with its headers: session id, ingress, replica, recalled memories, Server-Timing."""
    headers = {SESSION_HEADER: ready.session_id} if ready.session_id else {}
    if ingress_id:
        headers[INGRESS_HEADER] = ingress_id
    if reply.replica:
        headers[REPLICA_HEADER] = reply.replica
    headers.update(memory_headers(ready.memory))  # x-baton-memories, x-baton-memory-mode
    if reply.timing is not None:
        headers["Server-Timing"] = server_timing(reply.timing)
    if reply.events is not None:
        return StreamingResponse(reply.events, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
    return JSONResponse(reply.body, headers=headers)
