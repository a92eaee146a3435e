"""The ingress deployment: OpenAI-compatible HTTP in front of the engine pools."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ray import serve

from deployments.backend import PoolBackend
from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.metrics import ServeIngressMetrics
from deployments.openai_api import build_openai_app


@dataclass(frozen=True)
class IngressSettings:
    model_id: str
    model_path: str
    max_model_len: int
    default_max_tokens: int


@serve.deployment(name="ingress")
@serve.ingress()
class Ingress:
    def __init__(self, decode: Any, prefill: Any, settings: IngressSettings):
        self._decode = decode
        self._prefill = prefill
        self._frontend = OpenAIFrontend(
            model_id=settings.model_id,
            renderer=PromptRenderer.from_path(settings.model_path),
            backend=PoolBackend(decode),
            max_model_len=settings.max_model_len,
            default_max_tokens=settings.default_max_tokens,
            metrics=ServeIngressMetrics(),
        )

    def __serve_build_asgi_app__(self) -> Any:
        return build_openai_app(self._frontend, self._health)

    async def _health(self) -> dict[str, Any]:
        report: dict[str, Any] = {"status": "ok", "model": self._frontend.model_id, "pools": {}}
        pools = [("decode", self._decode)] + ([("prefill", self._prefill)] if self._prefill is not None else [])
        for name, handle in pools:
            try:
                stats = await asyncio.wait_for(handle.engine_stats.remote(), timeout=5.0)
                report["pools"][name] = {"healthy": stats.healthy, "kv_usage": stats.kv_usage, "running": stats.num_running}
                if not stats.healthy and name == "decode":
                    report["status"] = "degraded"
            except Exception as e:  # noqa: BLE001 - a health probe reports, it does not raise
                report["pools"][name] = {"healthy": False, "error": type(e).__name__}
                if name == "decode":
                    report["status"] = "unavailable"
        return report
