"""What the fact store accepts as a user id, a source and a fact text (InvalidInput otherwise).

Pure checks, shared by memory_store/db.py and the logs beside the facts."""

from __future__ import annotations

import re

from memory_store.errors import InvalidInput

USER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+\-]{0,127}")
MAX_SOURCE_CHARS = 256


def validate_user(user: str) -> str:
    if not isinstance(user, str) or not USER_RE.fullmatch(user):
        raise InvalidInput("user must be 1-128 characters of [A-Za-z0-9_.:@+-], starting alphanumeric")
    return user


def validate_source(source: str) -> str:
    if not isinstance(source, str) or not source.strip() or len(source) > MAX_SOURCE_CHARS:
        raise InvalidInput(f"source must be a non-blank string of at most {MAX_SOURCE_CHARS} characters")
    if any(ord(c) < 32 for c in source):
        raise InvalidInput("source must not contain control characters")
    return source


def validate_text(text: str, max_chars: int) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput("fact text must be a non-blank string")
    if len(text) > max_chars:
        raise InvalidInput(f"fact text has {len(text)} characters; the limit is {max_chars}")
    if "\x00" in text:
        raise InvalidInput("fact text must not contain NUL characters")
    return text
