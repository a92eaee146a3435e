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
from deployments.errors import APIError, bad_request, conversation_not_found, unavailable
from deployments.frontend import OpenAIFrontend, Prepared
from deployments.input_limits import InputLimits, check_input
from deployments.memory_api import IDEMPOTENCY_HEADER, USER_HEADER, MemoryFrontend, resolve_user
from deployments.offload import Offload
from deployments.protocol import SESSION_ID_MAX, AddMemoriesRequest, ChatCompletionRequest, CompletionRequest
from deployments.realtime_api import CLOSE_POLICY, RealtimeFrontend
from deployments.request_body import parse_body

logger = logging.getLogger("baton.api")

SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "x-baton-replica"  # which engine replica served the request (debugging, tests)
INGRESS_HEADER = "x-baton-ingress"  # which ingress replica answered
_FACT_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_SESSION_RE = re.compile(rf"^[A-Za-z0-9._:@/+=-]{{1,{SESSION_ID_MAX}}}$")

HealthCheck = Callable[[], Awaitable[dict[str, Any]]]
Prepare = Callable[[Any, str | None, Request], Awaitable[Prepared]]  # (parsed body, session id, request) -> Prepared
EndConversation = Callable[[str, str | None], Awaitable[bool]]  # (session id, user) -> whether that user's conversation ended


def session_id_of(request: Request, body_session: str | None) -> str | None:
    """The conversation id: the x-session-id header, or the body's session_id; they must agree."""
    header = request.headers.get(SESSION_HEADER)
    if header is not None and body_session is not None and header != body_session:
        raise bad_request("x-session-id header and body session_id differ", param="session_id")
    sid = header if header is not None else body_session
    if sid is not None and not _SESSION_RE.match(sid):
        raise bad_request(f"session id must be 1-{SESSION_ID_MAX} characters of [A-Za-z0-9._:@/+=-]", param="session_id")
    return sid


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
) -> FastAPI:
    """limits: the request bounds (deployments/input_limits.py; default: InputLimits())."""
    app = FastAPI(title="Baton", description="OpenAI-compatible conversation serving on Ray Serve", version="0.1.0")
    app.state.input_limits = limits = limits or InputLimits()
    render = Offload(limits.render_threads)  # templating and tokenization run here, off the event loop

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

    async def serve_one(request: Request, endpoint: str, model: type[BaseModel], prepare: Prepare) -> Any:
        frontend.precheck(endpoint)  # overloaded: 429 before the body is read
        try:
            body = await _parse(request, model)
            bound = _bound_user(request)
            if bound is not None:  # an API key bound to a user speaks for that user only
                resolve_user(bound, body.user, request.headers.get(USER_HEADER), required=False)
                body = body.model_copy(update={"user": bound})
            sid = session_id_of(request, body.session_id)
            check_input(body, limits, frontend.max_model_len)  # before any rendering
            prepared = await prepare(body, sid, request)
        except APIError as e:
            frontend.record_rejected(endpoint, e.status)
            raise
        return await _respond(frontend, prepared, sid, ingress_id)

    async def prepare_chat(body: ChatCompletionRequest, sid: str | None, request: Request) -> Prepared:
        if body.memories is None or memory is None:
            return await render.run(frontend.prepare_chat, body, sid)
        user = resolve_user(_bound_user(request), body.user, request.headers.get(USER_HEADER), required=True)
        assert user is not None
        # the memories' user is the request's (and its tenant's, deployments/salt.py) in both modes
        recalled = await memory.chat_prompt(body, user)
        return await render.run(frontend.prepare_chat, body.model_copy(update={"user": user}), sid, recalled)

    async def prepare_completion(body: CompletionRequest, sid: str | None, _: Request) -> Prepared:
        return await render.run(frontend.prepare_completion, body, sid)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await serve_one(request, "chat", ChatCompletionRequest, prepare_chat)

    if memory is not None:
        _memory_routes(app, memory)

    if end_conversation is not None:
        _conversation_routes(app, end_conversation)

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
        return await serve_one(request, "completions", CompletionRequest, prepare_completion)

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


def _conversation_routes(app: FastAPI, end_conversation: EndConversation) -> None:
    """DELETE /v1/conversations/{id}: the owner ends a conversation. 404 (the same body) for one
    that is someone else's or nobody's; 503 with Retry-After when the directory cannot answer."""

    @app.delete("/v1/conversations/{session_id:path}")
    async def delete_conversation(request: Request, session_id: str) -> Any:
        if not _SESSION_RE.match(session_id):
            raise bad_request(f"session id must be 1-{SESSION_ID_MAX} characters of [A-Za-z0-9._:@/+=-]", param="session_id")
        user = resolve_user(_bound_user(request), request.headers.get(USER_HEADER), request.query_params.get("user"), required=False)
        try:
            ended = await end_conversation(session_id, user)
        except Exception as e:  # noqa: BLE001 - the directory is down or slow: the client retries
            logger.warning("ending a conversation failed: %s", type(e).__name__)
            raise unavailable(f"conversation directory unavailable ({type(e).__name__})") from None
        if not ended:
            raise conversation_not_found()
        return {"id": session_id, "object": "conversation.deleted", "deleted": True}


def _fact_id(fact_id: str) -> str:
    if not _FACT_ID_RE.match(fact_id):
        raise bad_request("a memory id is 32 lowercase hex characters", param="id", code="invalid_memory_id")
    return fact_id


async def _respond(frontend: OpenAIFrontend, prepared: Prepared, sid: str | None, ingress_id: str | None) -> Any:
    reply = await (frontend.open_stream(prepared) if prepared.stream else frontend.complete(prepared))
    headers = {SESSION_HEADER: sid} if sid else {}
    if ingress_id:
        headers[INGRESS_HEADER] = ingress_id
    if reply.replica:
        headers[REPLICA_HEADER] = reply.replica
    if reply.events is not None:
        return StreamingResponse(reply.events, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
    return JSONResponse(reply.body, headers=headers)
