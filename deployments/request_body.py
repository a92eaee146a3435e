"""Request bodies in: a bounded read, a strict JSON decode, then the request model.

Bounded: a body over `max_bytes` is refused with 413 from its Content-Length before any of it is
read, and a body without one (chunked) is read only up to the limit. Strict: text that Python's
JSON decoder accepts but nothing downstream can use is refused with 400 `invalid_json`, never a
5xx later — a lone UTF-16 surrogate escape ("\\ud800": no Unicode character; tokenizers and
SQLite fail on it), nesting deeper than the decoder's recursion, integers past Python's
digit limit. The WebSocket API decodes its frames with `decode_json` too."""
from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from deployments.errors import APIError, bad_request

_SURROGATE = re.compile("[\ud800-\udfff]")


class InvalidJSON(ValueError):
    """Text that is not JSON Baton can use; the message says why (and where, for a bad string)."""


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body is larger than {max_bytes} bytes (ingress.max_body_bytes)", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed max_bytes (Content-Length, or the
    bytes received so far): a refused body is never read to its end."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("Content-Length is not a byte count", code="invalid_request")
        if int(declared) > max_bytes:
            raise too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large(max_bytes)
    return bytes(body)


def decode_json(raw: bytes | str) -> Any:
    """json.loads, refusing (InvalidJSON) what it would pass on as unusable strings or fail on
    with errors other than JSONDecodeError."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidJSON("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers beyond the digit limit
        raise InvalidJSON(str(e)) from None
    # from a "\ud800" escape, or bytes json.loads decoded with surrogatepass (UTF-8 ED A0 80)
    where = lone_surrogate_at(data)
    if where is not None:
        raise InvalidJSON(f"a lone UTF-16 surrogate is not a character (in {where[:200] or 'the body'})")
    return data


def lone_surrogate_at(data: Any) -> str | None:
    """The path (a.0.b) of a string or key holding a surrogate code point, or None when none does."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    return f"{path}.<a key>" if path else "<a key>"  # never echo the bad text
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):  # numbers (a token-id prompt) hold no strings: not walked
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))
    return None


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    """The request's JSON object body validated as `model`; 413 / 400 (invalid_json,
    invalid_value naming the field) otherwise."""
    raw = await read_body(request, max_bytes)
    try:
        data = decode_json(raw)
    except InvalidJSON as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    return validate_body(data, model)


def validate_body(data: Any, model: type[BaseModel]) -> Any:
    """A decoded body validated as `model`; 400 (invalid_json for a non-object, invalid_value
    naming the field) otherwise. The gRPC API validates its requests here too."""
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise bad_request(f"{where}: {err['msg']}{more}", param=where or None, code="invalid_value") from None
