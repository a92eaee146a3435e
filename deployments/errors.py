"""OpenAI-style errors: every failure the API reports has a status, a type and a clear message."""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error the client should see, with the HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "service_unavailable"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(reason: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, f"service unavailable: {reason}", code="engine_unavailable", headers={"Retry-After": str(retry_after_s)})


def conversation_not_found() -> APIError:
    """The one answer for a session id that is not the caller's conversation: someone else's and
    nobody's look the same, so nothing leaks."""
    return APIError(404, "no such conversation for this user", param="session_id", code="conversation_not_found")


def overloaded(reason: str, retry_after_s: int = 1) -> APIError:
    return APIError(429, f"too many requests: {reason}", code="overloaded", headers={"Retry-After": str(retry_after_s)})
