"""Group commit of conversation-ownership writes (claims and ends), and the reads ordered among
them, off the directory's event loop.

Why: the first turn of every conversation claims its session id in the ownership file
(router/ownership.py: SQLite, WAL, synchronous=FULL), and its owner's DELETE ends it there, so
each waits for a write to disk (an fsync, 0.4 ms p50 and 1.5 ms p99 measured on this project's
disk). Made on the directory's event loop, as they were, that wait blocks every other call the
directory serves meanwhile (pinned turns, reports, pin-cache syncs), and it caps new and ended
conversations at one fsync each.

How: a claim the directory's cache cannot answer (KnownOwners.known), and every end, joins the
pending batch and its caller awaits it. One flush at a time writes the whole pending batch, in
arrival order, in one transaction (OwnershipStore.write_many: one fsync) on a worker thread, while
the loop goes on serving; the writes that arrive during that flush form the next batch. So a batch
is as large as the load makes it: one write when idle (no added wait), many under a burst — the
same group commit databases use for their logs. The answer is given only after its batch
committed, so an opened conversation is on disk before its first turn is planned, and an ended
one is gone from disk before its DELETE is answered, as before.

Reads: a restarted directory adopts pins from the decoders' reports (router/pin_adoption.py) and
asks the owner of each conversation they hold, up to 4,096 per report, none of them cached yet:
one SELECT each on the loop was ~8 µs, 33 ms per report. `owners_of` queues one Lookup of the
uncached ids in the same order as the writes (SELECT … IN, off the loop), so what it answers is the
file as of every write queued before it — an end that committed first is never adopted back.

Ordering: a batch applies its writes in arrival order, and the cache is updated from the answers
in that order. A claim the cache answers while an end of the same id waits in a batch is answered
as of before that end (it has not been answered yet, so that order is one the callers can see).
Ends are never answered from the cache.

Invariants: KnownOwners is touched on the loop's thread only (before and after the await); at
most one flush runs; every queued write's future is resolved (its answer, or the flush's error for
every write of that batch) — none is left waiting (`check_integrity`).
"""
from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import dataclass

from router.ownership import Claim, KnownOwners, Lookup, Write

MAX_BATCH = 512  # writes per transaction: a bound on one flush's time, not a batching delay


@dataclass(frozen=True)
class BatchStats:
    """What the batcher has done since it started (the directory's snapshot shows it)."""

    claims_cached: int  # answered from the cache, no file access
    claims_committed: int  # written through a flush
    ends_committed: int  # conversations ended (their owner's DELETE) through a flush, whether or not it was theirs
    lookups: int  # owners_of reads that went to the file (a restarted directory adopting pins)
    flushes: int  # transactions (fsyncs)
    largest_batch: int
    flush_errors: int


class ClaimBatcher:
    """`await claim(session_id, user)` and `await end(session_id, user)` on the directory's event loop; see the module docstring."""

    def __init__(self, owners: KnownOwners, max_batch: int = MAX_BATCH):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.owners = owners
        self.max_batch = max_batch
        self._pending: list[tuple[Write | Lookup, asyncio.Future[Claim | bool | dict[str, str]]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._cached = self._committed = self._ended = self._lookups = self._flushes = self._largest = self._errors = 0

    async def claim(self, session_id: str, user: str | None) -> Claim:
        """As KnownOwners.claim, the file's write committed in a group and awaited off the loop."""
        if not session_id:
            raise ValueError("session id must be non-empty")  # refused alone, before it can fail a batch
        known = self.owners.known(session_id, user)
        if known is not None:
            self._cached += 1
            return known
        claim = await self._write(Write(session_id, user))
        assert isinstance(claim, Claim)
        return claim

    async def end(self, session_id: str, user: str | None) -> bool:
        """As KnownOwners.forget (True: `user` owned it and it is ended), committed in a group off the loop."""
        if not session_id:
            return False  # nobody owns the empty id
        ended = await self._write(Write(session_id, user, end=True))
        assert isinstance(ended, bool)
        return ended

    async def owners_of(self, session_ids: list[str]) -> dict[str, str]:
        """The owner of each session id that has one ("" = anonymous): the cached ones from the
        cache, the rest read from the file in one Lookup queued behind the writes before it."""
        found: dict[str, str] = {}
        missing = []
        for sid in session_ids:
            who = self.owners.cached(sid)
            if who is None:
                missing.append(sid)
            else:
                found[sid] = who
        if missing:
            read = await self._write(Lookup(tuple(missing)))
            assert isinstance(read, dict)
            found.update(read)
        return found

    async def _write(self, write: Write | Lookup) -> Claim | bool | dict[str, str]:
        done: asyncio.Future[Claim | bool | dict[str, str]] = asyncio.get_running_loop().create_future()
        self._pending.append((write, done))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush_all())
        return await done

    async def _flush_all(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
                try:
                    answers = await asyncio.to_thread(self.owners.store.write_many, [w for w, _ in batch])
                except (sqlite3.Error, OSError) as exc:  # the disk failed this batch: each of its callers gets the error
                    self._errors += 1
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                    continue
                self._flushes += 1
                self._largest = max(self._largest, len(batch))
                for (w, done), answer in zip(batch, answers, strict=True):
                    if isinstance(w, Lookup):
                        self._lookups += 1
                        assert isinstance(answer, dict)
                        self.owners.found(answer)
                    elif w.end:
                        self._ended += 1
                        if answer:
                            self.owners.forgotten(w.session_id)
                    else:
                        self._committed += 1
                        assert isinstance(answer, Claim)
                        self.owners.claimed(w.session_id, w.user, answer)
                    if not done.done():  # its caller may have been cancelled; the write stands
                        done.set_result(answer)
        finally:
            self._flushing = None

    def stats(self) -> BatchStats:
        return BatchStats(self._cached, self._committed, self._ended, self._lookups, self._flushes, self._largest, self._errors)

    def check_integrity(self) -> None:
        if self._pending and self._flushing is None:
            raise AssertionError(f"{len(self._pending)} writes pending with no flush to write them")
        if any(done.done() for _, done in self._pending):
            raise AssertionError("a pending write already has its answer")
        if self._flushes and not 1 <= self._largest <= self.max_batch:
            raise AssertionError(f"largest batch {self._largest} outside [1, {self.max_batch}]")
