"""The ingress's way to the engine pools over Serve handles, with Ray failures turned into the
engine errors the frontend understands (503 / 400), never a stack trace."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from engine.types import EngineRequestError, EngineUnavailable, GenerationDelta, GenerationRequest

logger = logging.getLogger("ray.serve")


def translate_error(e: BaseException) -> BaseException:
    """Map what a Serve handle can raise to EngineUnavailable / EngineRequestError (or `e` itself)."""
    if isinstance(e, ray_exceptions.RayTaskError):  # an exception raised inside the replica
        cause = getattr(e, "cause", None)
        if isinstance(cause, (EngineUnavailable, EngineRequestError)):
            return type(cause)(str(cause))
        return EngineUnavailable(f"engine replica error: {type(cause or e).__name__}")
    if isinstance(e, (EngineUnavailable, EngineRequestError)):
        return e
    if isinstance(e, BackPressureError):
        return EngineUnavailable("engine pool is at capacity; retry later")
    if isinstance(e, DeploymentUnavailableError):
        return EngineUnavailable("engine pool is not available")
    if isinstance(e, ray_exceptions.RayActorError):  # died / unavailable replica
        return EngineUnavailable("the engine replica died while serving the request")
    return e


class PoolBackend:
    """Sends whole requests to the decode pool; the handle's session_id drives conversation affinity."""

    def __init__(self, decode_handle: Any):
        self._decode = decode_handle

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        opts: dict[str, Any] = {"stream": True}
        if request.session_id:
            opts["session_id"] = request.session_id
        gen = self._decode.options(**opts).generate.remote(request)
        done = False
        try:
            async for delta in gen:
                yield delta
                done = delta.finished
        except Exception as e:  # noqa: BLE001 - translated; unknown errors re-raised as they are
            translated = translate_error(e)
            if translated is e:
                raise
            logger.warning("request %s failed: %s", request.request_id, translated)
            raise translated from None
        finally:
            if not done:
                gen.cancel()
