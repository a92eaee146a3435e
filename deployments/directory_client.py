"""The conversation directory as its callers see it: one object over the handles of its shards
(router/directory_shards.py for what a shard owns and why).

- a conversation's calls (route, served, end, describe, the pin-cache sync of its shard's cache)
  go to the shard its session id hashes to: `for_session(session_id)`;
- an engine replica's report reaches every shard (each places new conversations from the loads
  the replicas report): `report`, fire and forget as before — sent to each shard, or with
  `relay` to the replica's home shard only, which passes it on (router/report_relay.py), and to
  every shard while the home shard does not answer; a shard that answers that it lacks the
  replica's complete list of conversations (router/held_mirror.py) is sent it at once;
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
    def __init__(self, handles: Sequence[Any], relay: bool = False):
        if not 1 <= len(handles) <= MAX_SHARDS:
            raise ValueError(f"a directory has 1 to {MAX_SHARDS} shards, got {len(handles)}")
        self._handles = tuple(handles)
        self.relay = relay and len(handles) > 1
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
        """An engine replica's report, to every shard (or its home shard, relaying); fire and forget
        (a slow shard never delays the replica). `complete`: builds the replica's report with its
        complete list of conversations, sent to each shard whose answer asks for it (answers are
        awaited in the background)."""
        if self.relay:
            home = self.index_of(report.replica_id)
            self._answered(home, self._handles[home].report.remote(report, relay=True), complete, report)
            return
        for i, h in enumerate(self._handles):
            self._answered(i, h.report.remote(report), complete, None)

    def _answered(self, shard: int, reply: Any, complete: Callable[[], Any] | None, relayed: Any) -> None:
        if complete is None and relayed is None:
            return
        task = asyncio.get_running_loop().create_task(self._on_answer(shard, reply, complete, relayed))
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    async def _on_answer(self, shard: int, reply: Any, complete: Callable[[], Any] | None, relayed: Any) -> None:
        try:
            asking = await reply
        except Exception as e:  # noqa: BLE001 - a shard down or restarting: it asks for what it lacks once back
            logger.debug("directory shard %d did not answer a report (%s: %s)", shard, type(e).__name__, e)
            if relayed is not None:  # the home shard relays nothing meanwhile: reach the others directly
                for i, h in enumerate(self._handles):
                    if i != shard:
                        self._answered(i, h.report.remote(relayed), complete, None)
            return
        if complete is not None and asking:
            full = complete()
            for i in asking:
                self._handles[i].report.remote(full)

    async def replica_failed(self, replica_id: str) -> int:
        """Every shard re-places its conversations on `replica_id`; how many were held, over all shards."""
        held = await asyncio.gather(*(h.replica_failed.remote(replica_id) for h in self._handles))
        return sum(held)

    async def snapshot(self) -> dict[str, Any]:
        snaps = await asyncio.gather(*(h.snapshot.remote() for h in self._handles))
        return merge_snapshots(snaps)
