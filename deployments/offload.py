"""CPU-heavy request work (chat templating, tokenization) off the event loop.

A request's prompt is rendered on one of a few threads, so a large prompt delays only itself:
the ingress's event loop keeps accepting, streaming and refusing other requests meanwhile. The
pool is small and bounded — at most `threads` renders run at once, the rest wait their turn —
and its threads start on first use and end when it is dropped."""
from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Offload:
    def __init__(self, threads: int = 2, name: str = "baton-render"):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._threads, self._name = threads, name
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on a pool thread; its exception (an APIError for bad input) is raised here."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
            weakref.finalize(self, self._pool.shutdown, wait=False)  # its threads end with the app that owns it
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
