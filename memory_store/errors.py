"""Typed errors of the memory store. Callers map them to HTTP: InvalidInput -> 400,
FactNotFound -> 404 (the same for a foreign id as for an unknown one), IdempotencyKeyReused -> 422,
the rest -> 500."""

from __future__ import annotations

from collections.abc import Iterable


class MemoryStoreError(Exception):
    """Base of every error raised on purpose by memory_store."""


class InvalidInput(MemoryStoreError, ValueError):
    """A user id, source, fact text, embedding or request size that the store refuses."""


class FactNotFound(MemoryStoreError, LookupError):
    """Some requested fact ids are not the caller's. Says nothing about other users' facts."""

    def __init__(self, ids: Iterable[str]) -> None:
        self.ids: tuple[str, ...] = tuple(ids)
        super().__init__(f"{len(self.ids)} memory id(s) not found: {', '.join(self.ids)}")

    def __reduce__(self) -> tuple[type[FactNotFound], tuple[tuple[str, ...]]]:
        # it crosses Ray (pickled) from the memory-store actor: rebuild from the ids, not from
        # the message, which __init__ would otherwise split into characters
        return (type(self), (self.ids,))


class IdempotencyKeyReused(MemoryStoreError):
    """An Idempotency-Key the user already sent with a different request (memory_store/idempotency.py)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__("this Idempotency-Key was already used with a different request; use a new key")

    def __reduce__(self) -> tuple[type[IdempotencyKeyReused], tuple[str]]:
        return (type(self), (self.key,))


class SchemaVersionError(MemoryStoreError):
    """The database file was written by a newer (unknown) schema version."""


class StoreCorrupted(MemoryStoreError):
    """check_integrity() found the database inconsistent."""
