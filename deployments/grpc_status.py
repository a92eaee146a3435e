"""How the gRPC API reports refusals and failures: an APIError (or a real-time close) as a gRPC
status, and the caller's API key read from gRPC metadata. Pure functions, no Serve.

    HTTP  gRPC                 HTTP  gRPC
    400   INVALID_ARGUMENT     422   FAILED_PRECONDITION
    401   UNAUTHENTICATED      429   RESOURCE_EXHAUSTED  + retry-after, RetryInfo
    403   PERMISSION_DENIED    499   CANCELLED (the client went away)
    404   NOT_FOUND            500   INTERNAL
    413   RESOURCE_EXHAUSTED   503   UNAVAILABLE         + retry-after, RetryInfo
          (gRPC's own code for a message over a size limit; unlike 429 it has no retry-after,
          and `baton-error` says `request_too_large`)

The details are the OpenAI error message, never a stack trace. Trailing metadata: `baton-error`
(the OpenAI error object as ASCII JSON: message, type, param, code), and with a Retry-After
`retry-after` (seconds) and `grpc-status-details-bin` (a google.rpc.Status holding a
google.rpc.RetryInfo: what gRPC clients' retry helpers read).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from deployments.api_keys import Caller, access_refusal, authenticate
from deployments.errors import APIError

_BY_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.FAILED_PRECONDITION,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
RETRY_AFTER = "retry-after"
ERROR_KEY = "baton-error"
DETAILS_KEY = "grpc-status-details-bin"

Metadata = Sequence[tuple[str, str | bytes]]


class StatusContext(Protocol):
    """The slice of a gRPC servicer context the API sets (Serve's RayServegRPCContext, grpc.aio's)."""

    def invocation_metadata(self) -> Any: ...
    def set_code(self, code: grpc.StatusCode) -> None: ...
    def set_details(self, details: str) -> None: ...
    def set_trailing_metadata(self, trailing_metadata: Any) -> None: ...


class GrpcStatus(NamedTuple):
    code: grpc.StatusCode
    details: str
    trailing: tuple[tuple[str, str | bytes], ...] = ()

    def apply(self, context: StatusContext) -> None:
        context.set_code(self.code)
        context.set_details(self.details)
        if self.trailing:
            context.set_trailing_metadata(list(self.trailing))


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP status (the table above; other 4xx INVALID_ARGUMENT, 5xx INTERNAL)."""
    if http_status in _BY_STATUS:
        return _BY_STATUS[http_status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= http_status < 500 else grpc.StatusCode.INTERNAL


def retry_after_s(e: APIError) -> int | None:
    raw = next((v for k, v in e.headers.items() if k.lower() == RETRY_AFTER), None)
    return int(raw) if raw is not None and raw.isdigit() else None


def error_status(e: APIError) -> GrpcStatus:
    code = status_code(e.status)
    error = json.dumps(e.body()["error"], separators=(",", ":"))  # ensure_ascii: a valid metadata value
    trailing: list[tuple[str, str | bytes]] = [(ERROR_KEY, error)]
    retry = retry_after_s(e)
    if retry is not None:
        trailing.append((RETRY_AFTER, str(retry)))
        trailing.append((DETAILS_KEY, retry_details(code, e.message, retry)))
    return GrpcStatus(code, e.message, tuple(trailing))


def retry_details(code: grpc.StatusCode, message: str, seconds: int) -> bytes:
    """A serialized google.rpc.Status with one google.rpc.RetryInfo (grpc-status-details-bin)."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds)))
    return status_pb2.Status(code=code.value[0], message=message, details=[info]).SerializeToString()


def retry_info_seconds(trailing: Metadata) -> int | None:
    """The RetryInfo delay in a status's trailing metadata (what a client reads; None: none)."""
    raw = metadata_value(trailing, DETAILS_KEY)
    if not isinstance(raw, bytes):
        return None
    status = status_pb2.Status.FromString(raw)
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return int(info.retry_delay.seconds)
    return None


def metadata_value(metadata: Metadata | None, key: str) -> str | bytes | None:
    """The first value of `key` (gRPC metadata keys are lowercase)."""
    return next((v for k, v in metadata or () if k == key), None)


def metadata_text(metadata: Metadata | None, key: str) -> str | None:
    v = metadata_value(metadata, key)
    return v if isinstance(v, str) else None


def caller_of(metadata: Metadata | None, keys: Mapping[str, str | None], method: str) -> Caller:
    """The caller of RPC `method` by its `authorization: Bearer <key>` metadata, as HTTP checks
    its header (deployments/api_keys.py); APIError 401 when keys are on and the key is not valid.
    Keys off: an unauthenticated caller with no user, as over HTTP."""
    if not keys:
        return Caller(False, None)
    caller = authenticate(metadata_text(metadata, "authorization"), keys)
    refusal = access_refusal(method, caller)
    if refusal is not None:
        raise refusal
    return caller
