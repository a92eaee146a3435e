"""The ingress's side of the pin cache (router/pin_cache.py): a background task that syncs the
cache with the conversation directory every period, and `flush` for the calls that must see this
ingress's own turns first (GET/DELETE of a conversation, /baton/stats).

A sync that fails or times out gives its touches back to the next one; after two periods without
a sync the cache plans nothing (every turn asks the directory, which fails closed on its own
terms), so a directory that is down never leaves a stale cache in use. The task starts with the
first turn (an event loop is running then) and is cancelled with the replica. `ShardedPins`: one
cache and syncer per directory shard (router/directory_shards.py)."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from deployments.directory_client import DirectoryShards
from router.pin_cache import PinCache

logger = logging.getLogger("ray.serve")

SYNC_TIMEOUT_S = 5.0


class PinSyncer:
    def __init__(self, cache: PinCache, directory: Any):
        self.cache = cache
        self.ingress_id = uuid.uuid4().hex  # this cache's name in the directory's change log
        self._directory = directory
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._failing = False  # log a run of failed syncs once, not every period

    def start(self) -> None:
        """Idempotent; call from a coroutine (needs the running loop)."""
        if self._task is None and self.cache.enabled:
            self._task = asyncio.get_running_loop().create_task(self._forever())

    async def _forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:  # one sync per period, counted from each start: a slow answer does not stretch the period
            due = loop.time() + self.cache.sync_period_s
            await self.sync_once()
            await asyncio.sleep(max(0.0, due - loop.time()))

    async def sync_once(self) -> bool:
        """One sync; False when the directory did not answer (its touches wait for the next)."""
        async with self._lock:
            incarnation, seq = self.cache.sync_args()
            touches, placed = self.cache.take_touches(), self.cache.take_placed()
            try:
                reply = await asyncio.wait_for(self._directory.sync.remote(self.ingress_id, incarnation, seq, touches, placed=placed),
                                               SYNC_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the cache goes stale and stops planning; turns ask the directory
                self.cache.give_back(touches, placed)
                if not self._failing:
                    logger.warning("pin cache sync with the directory failed (%s); %d touches kept for the next, every turn asks "
                                   "the directory until a sync succeeds", type(e).__name__, len(touches))
                self._failing = True
                return False
            if self._failing:
                logger.info("pin cache sync with the directory works again")
            self._failing = False
            self.cache.apply(reply, asked=(incarnation, seq))
            return True

    async def flush(self) -> None:
        """Send this ingress's pending turns now (before a read of the directory's state)."""
        if self.cache.enabled:
            await self.sync_once()


class ShardedPins:
    """One pin cache and syncer per directory shard (deployments/directory_client.py): a
    conversation's pins live in its shard's cache and sync with that shard; turns without a
    session id are planned from shard 0's view of the loads and reported to it."""

    def __init__(self, syncers: Sequence[PinSyncer], directory: DirectoryShards):
        if len(syncers) != directory.count:
            raise ValueError(f"{len(syncers)} pin caches for {directory.count} directory shards")
        self._directory = directory
        self.syncers = tuple(syncers)

    @classmethod
    def over(cls, make_cache: Callable[[], PinCache], directory: DirectoryShards) -> ShardedPins:
        """A fresh cache for each shard of `directory`, syncing with that shard."""
        return cls([PinSyncer(make_cache(), h) for h in directory.shards()], directory)

    @property
    def enabled(self) -> bool:
        return self.syncers[0].cache.enabled

    def for_session(self, session_id: str | None) -> PinSyncer:
        return self.syncers[self._directory.index_of(session_id)]

    def start(self) -> None:
        for s in self.syncers:
            s.start()

    async def flush(self) -> None:
        await asyncio.gather(*(s.flush() for s in self.syncers))

    def forget_decoder(self, replica_id: str) -> int:
        return sum(s.cache.forget_decoder(replica_id) for s in self.syncers)

    def snapshot(self) -> dict[str, object]:
        """The caches' counts summed (`fresh`: every shard's cache is; `live_decoders`: the fewest any shard sees)."""
        snaps = [s.cache.snapshot() for s in self.syncers]
        if len(snaps) == 1:
            return snaps[0]
        out: dict[str, object] = {}
        for key, value in snaps[0].items():
            if key == "fresh" or isinstance(value, bool):
                out[key] = all(bool(s[key]) for s in snaps)
            elif key == "live_decoders":
                out[key] = min(int(s[key]) for s in snaps)  # type: ignore[call-overload]
            elif key == "sync_period_s":
                out[key] = value
            else:
                out[key] = sum(s[key] for s in snaps)  # type: ignore[misc]
        out["shards"] = len(snaps)
        return out
