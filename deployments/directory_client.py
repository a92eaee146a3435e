"""The conversation directory as its callers see it: one object over the handles of its shards
(router/directory_shards.py for what a shard owns and why).

- a conversation's calls (route, served, end, describe, the pin-cache sync of its shard's cache)
  go to the shard its session id hashes to: `for_session(session_id)`;
- an engine replica's report goes to every shard (each places new conversations from the loads
  the replicas report): `report`, fire and forget as before; a shard that answers that it lacks
  the replica's complete list of conversations (router/held_mirror.py) is sent it at once;
- a replica failure is told to every shard (each re-places its own conversations): `replica_failed`;
- `snapshot` merges every shard's (router/directory_shards.merge_snapshots).

With one shard every call goes to that one handle, as before shards existed. The object is built
from bound deployments in deployments/app.py and passed to the replicas' constructors; Serve
replaces the bound deployments inside it with their handles."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from router.directory_shards import MAX_SHARDS, merge_snapshots, shard_of

logger = logging.getLogger("ray.serve")


class DirectoryShards:
    def __init__(self, handles: Sequence[Any]):
        if not 1 <= len(handles) <= MAX_SHARDS:
            raise ValueError(f"a directory has 1 to {MAX_SHARDS} shards, got {len(handles)}")
        self._handles = tuple(handles)
        self._asking: set[asyncio.Task[None]] = set()  # replies to reports being awaited

    @property
    def count(self) -> int:
        return len(self._handles)

    def shards(self) -> tuple[Any, ...]:
        return self._handles

    def index_of(self, session_id: str | None) -> int:
        return shard_of(session_id, len(self._handles))

    def for_session(self, session_id: str | None) -> Any:
        """The handle of the shard that owns `session_id` (shard 0 for none)."""
        return self._handles[self.index_of(session_id)]

    def report(self, report: Any, complete: Callable[[], Any] | None = None) -> None:
        """An engine replica's report, to every shard; fire and forget (a slow shard never delays the
        replica). `complete`: builds the replica's report with its complete list of conversations,
        sent to a shard whose reply asks for it (the reply is awaited in the background)."""
        for h in self._handles:
            reply = h.report.remote(report)
            if complete is not None:
                task = asyncio.get_running_loop().create_task(self._complete_if_asked(h, reply, complete))
                self._asking.add(task)
                task.add_done_callback(self._asking.discard)

    @staticmethod
    async def _complete_if_asked(handle: Any, reply: Any, complete: Callable[[], Any]) -> None:
        try:
            if await reply:
                handle.report.remote(complete())
        except Exception as e:  # noqa: BLE001 - a shard down or restarting: the next report asks again
            logger.debug("directory report not answered (%s: %s)", type(e).__name__, e)

    async def replica_failed(self, replica_id: str) -> int:
        """Every shard re-places its conversations on `replica_id`; how many were held, over all shards."""
        held = await asyncio.gather(*(h.replica_failed.remote(replica_id) for h in self._handles))
        return sum(held)

    async def snapshot(self) -> dict[str, Any]:
        snaps = await asyncio.gather(*(h.snapshot.remote() for h in self._handles))
        return merge_snapshots(snaps)
