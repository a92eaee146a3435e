"""The ingress deployment: OpenAI-compatible HTTP, and the same API over gRPC, in front of the engine pools."""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from deployments.backend import PoolBackend
from deployments.chat import PromptRenderer
from deployments.chat_service import ChatService
from deployments.config import RealtimeConfig
from deployments.directory_client import DirectoryShards
from deployments.frontend import OpenAIFrontend
from deployments.grpc_api import GrpcFrontend
from deployments.inflight import InflightLimit
from deployments.input_limits import InputLimits
from deployments.memory_api import MemoryFrontend
from deployments.metrics import ServeIngressMetrics, ServeRealtimeMetrics
from deployments.openai_api import api_keys_from_env, build_openai_app
from deployments.pin_sync import ShardedPins
from deployments.realtime_api import RealtimeFrontend
from deployments.salt import PrefixCacheScope
from deployments.tool_calls import ToolCalling
from memory_store.config import MemoryConfig
from router.chat_admission import ChatAdmissionConfig
from router.heap import freeze_startup_heap
from router.pin_cache import PinCache
from router.policy import DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS, Policy


@dataclass(frozen=True)
class IngressSettings:
    model_id: str
    model_path: str
    max_model_len: int
    default_max_tokens: int
    disaggregated: bool  # the policy prefills on the prefill pool
    api_keys_env: str | None = None  # environment variable with the API keys (None: no auth)
    max_inflight_requests: int = 128  # generation requests at once; beyond: 429
    admission: ChatAdmissionConfig = ChatAdmissionConfig()  # fixed, or adaptive to a TTFT target under the cap above
    memory: MemoryConfig | None = None  # the memory store's settings (None: no memories)
    realtime: RealtimeConfig | None = None  # real-time sessions (None: no /v1/realtime)
    input_limits: InputLimits = InputLimits()  # request bounds (body bytes, messages, prompt characters)
    prefix_cache: PrefixCacheScope = "tenant"  # which requests may share prefix-cache KV (deployments/salt.py)
    tool_call_parser: str | None = None  # vLLM's tool parser for this model (None: no tool calling)
    chat_template: str | None = None  # absolute path of a template that replaces the model's (None: its own)
    incremental_tokenization: bool = True  # deployments/token_prefix.py
    policy: Policy = "conversation"  # the routing policy (the pin cache plans only under pinning ones)
    pin_cache_sync_s: float = 0.0  # routing.pin_cache_sync_s: 0, every turn asks the directory
    conditional_pd_threshold_tokens: int = DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS


@serve.deployment(name="ingress")
@serve.ingress()
class Ingress:
    def __init__(self, decode: Any, prefill: Any, directory: DirectoryShards, settings: IngressSettings, memory_store: Any = None):
        self._directory = directory
        self._settings = settings
        self._api_keys = api_keys_from_env(settings.api_keys_env, os.environ)
        renderer = PromptRenderer.from_path(settings.model_path, settings.chat_template, settings.incremental_tokenization)
        self._renderer = renderer
        tools = ToolCalling(settings.tool_call_parser, renderer.tokenizer, settings.model_id)
        self._memory = None
        if settings.memory is not None and memory_store is not None:
            self._memory = MemoryFrontend(settings.memory, memory_store, renderer, settings.model_id, encoder=decode)
        self._realtime = None
        if settings.realtime is not None:
            self._realtime = RealtimeFrontend(settings.realtime, decode, directory, renderer, ServeRealtimeMetrics())
        self._metrics = ServeIngressMetrics()
        self._admission = InflightLimit(settings.max_inflight_requests, settings.admission, metrics=self._metrics)
        pins = ShardedPins.over(lambda: PinCache(settings.policy, settings.pin_cache_sync_s, threshold_tokens=settings.conditional_pd_threshold_tokens),
                                directory)
        self._backend = PoolBackend(decode, prefill if settings.disaggregated else None, directory, resumes=self._metrics,
                                    load_hint=self._admission.note_pool, pins=pins if pins.enabled else None)
        self._frontend = OpenAIFrontend(
            model_id=settings.model_id,
            renderer=renderer,
            backend=self._backend,
            max_model_len=settings.max_model_len,
            default_max_tokens=settings.default_max_tokens,
            metrics=self._metrics,
            admission=self._admission,
            prefix_cache=settings.prefix_cache,
            tools=tools,
        )
        self._chat = ChatService(self._frontend, self._memory, settings.input_limits)  # HTTP and gRPC share it
        self._grpc = GrpcFrontend(self._chat, self._api_keys, self._realtime)
        freeze_startup_heap()  # router/heap.py: the collector's walks skip the startup heap (tokenizer, FastAPI, Serve)

    def __serve_build_asgi_app__(self) -> Any:
        try:
            ingress_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve
            ingress_id = None
        return build_openai_app(self._frontend, self._health, self._public_stats, ingress_id, self._api_keys, self._memory, self._realtime,
                                end_conversation=self._end_conversation, limits=self._settings.input_limits, chat=self._chat,
                                describe_conversation=self._describe_conversation)

    # ---- gRPC (baton.v1.Baton, deployments/grpc_api.py): Serve's gRPC proxy calls the method named after each RPC ----
    async def ChatCompletion(self, request: Any, grpc_context: Any) -> Any:
        return await self._grpc.chat_completion(request, grpc_context)

    async def ChatCompletionStream(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        async for chunk in self._grpc.chat_completion_stream(request, grpc_context):
            yield chunk

    async def Completion(self, request: Any, grpc_context: Any) -> Any:
        return await self._grpc.completion(request, grpc_context)

    async def CompletionStream(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        async for chunk in self._grpc.completion_stream(request, grpc_context):
            yield chunk

    async def ListModels(self, request: Any, grpc_context: Any) -> Any:
        return await self._grpc.list_models(request, grpc_context)

    async def Realtime(self, request_stream: Any, grpc_context: Any) -> AsyncIterator[Any]:
        async for f in self._grpc.realtime(request_stream, grpc_context):
            yield f

    async def _stats(self, flush: bool = True) -> dict[str, Any]:
        """The directory's snapshot; `flush`: after this ingress's cached turns reached it."""
        if flush:
            await self._backend.flush_pins()
        return await asyncio.wait_for(self._directory.snapshot(), timeout=5.0)

    async def _public_stats(self) -> dict[str, Any]:
        """GET /baton/stats: the directory's snapshot, and the streams this ingress replica resumed
        (by outcome; each ingress replica counts its own, deployments/resume.py), and this
        replica's chat admission (mode, current limit, counts; deployments/inflight.py), and its
        real-time sessions (live, AIMD cap, overload mode, sessions shed; deployments/realtime_api.py)."""
        ingress: dict[str, Any] = {"stream_resumes": dict(self._metrics.resume_totals), "admission": self._admission.snapshot(),
                                   "pin_cache": self._backend.pin_cache_snapshot(), "prompt_prefix_tokens": self._renderer.prefix_snapshot()}
        if self._realtime is not None:
            ingress["realtime"] = self._realtime.snapshot()
        return {**await self._stats(), "ingress": ingress}

    async def _end_conversation(self, session_id: str, user: str | None) -> bool:
        """DELETE /v1/conversations/{id}: the directory checks the owner, drops the pin and the ownership."""
        await self._backend.flush_pins()
        return await asyncio.wait_for(self._directory.for_session(session_id).end_conversation.remote(session_id, user), timeout=5.0)

    async def _describe_conversation(self, session_id: str, user: str | None) -> dict[str, Any] | None:
        """GET /v1/conversations/{id}: the directory checks the owner and describes the pin."""
        await self._backend.flush_pins()
        return await asyncio.wait_for(self._directory.for_session(session_id).describe_conversation.remote(session_id, user), timeout=5.0)

    async def _health(self) -> dict[str, Any]:
        """ok when the directory sees a live decode replica (and a prefill replica where the
        policy needs one); engines report to the directory every routing-stats period."""
        try:
            snap = await self._stats(flush=False)
        except Exception as e:  # noqa: BLE001 - a health probe reports, it does not raise
            return {"status": "unavailable", "model": self._frontend.model_id, "error": f"directory: {type(e).__name__}"}
        live = {"prefill": 0, "decode": 0}
        for r in snap["replicas"].values():
            if r["live"]:
                live[r["pool"]] = live.get(r["pool"], 0) + 1
        ready = live["decode"] > 0 and (live["prefill"] > 0 or not self._settings.disaggregated)
        return {"status": "ok" if ready else "unavailable", "model": self._frontend.model_id, "policy": snap["policy"], "live_replicas": live}
