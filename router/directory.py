"""The conversation directory: ONE Serve replica that every ingress replica asks where a turn
goes, and every engine replica reports to. Because it is a single replica that handles one call
at a time, two ingress replicas can never pin one conversation to two decoders. Ingresses plan a
pinned conversation's later turns from their own cache of its pins and sync with the directory
every `routing.pin_cache_sync_s` (router/pin_cache.py), so the directory is asked on first turns,
moves and misses, not on every turn.

Conversation ownership is kept in a SQLite file (`routing.ownership_db_path`, router/ownership.py),
so a restarted directory still refuses one user's session id to another; its pins come back from
the decoders' reports (DirectoryState.report). New conversations' claims are written in group
commits off the event loop (router/claim_batch.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, replace
from typing import Any

from ray import serve
from ray.serve import metrics

from router.claim_batch import ClaimBatcher
from router.directory_shards import deployment_name
from router.directory_state import DirectorySettings, DirectoryState
from router.heap import freeze_startup_heap
from router.ownership import KnownOwners, OwnershipStore
from router.pin_cache import PinSync, Placed, Touch
from router.policy import TurnPlan
from router.report import ReplicaReport
from router.report_relay import RelayAsks, ReportOutbox

logger = logging.getLogger("ray.serve")

EXPIRY_PERIOD_S = 5.0
ADOPT_CHUNK = 256  # pins adopted between two yields to the loop (~1.5 ms of work)


class ConversationDirectory:
    def __init__(self, settings: DirectorySettings, ownership_db_path: str = ":memory:", relay_period_s: float = 0.0):
        """relay_period_s > 0 with several shards: relay the reports received as a home shard to the
        other shards in one call each per period (router/report_relay.py)."""
        self._shard, self._shards = settings.shard, settings.shards
        self._relay_period_s = relay_period_s if settings.shards > 1 else 0.0
        self._outbox, self._asks = ReportOutbox(), RelayAsks(settings.shard, settings.shards)
        self._relay_task: asyncio.Task | None = None
        self._peers: dict[int, Any] = {}
        self._owners = OwnershipStore(ownership_db_path)
        logger.info("conversation ownership in %s (%d conversations)", ownership_db_path, self._owners.count())
        owners = KnownOwners(self._owners)
        self._state = DirectoryState(settings, owners)
        self._claims = ClaimBatcher(owners)
        self._expiry_task: asyncio.Task | None = None
        self._live_pins = metrics.Gauge("baton_live_pins", "conversations pinned to a decoder")
        self._conversations = metrics.Counter("baton_conversations", "conversations seen")
        self._handoffs = metrics.Counter("baton_planned_handoffs", "turns prefilled on the prefill pool with a KV handoff")
        self._fallbacks = metrics.Counter(
            "baton_prefill_fallback_local", "turns planned for the prefill pool but prefilled on their idle decoder: every prefill "
            "replica had more than routing.prefill_queue_limit_tokens queued")
        self._occupancy = metrics.Gauge("baton_decoder_kv_usage", "KV occupancy of each decode replica", tag_keys=("decoder",))
        self._pinned = metrics.Gauge("baton_decoder_pinned_conversations", "conversations pinned to each decode replica", tag_keys=("decoder",))
        self._kv_in = metrics.Gauge(
            "baton_decoder_kv_bytes_received", "KV bytes a decode replica pulled over NIXL (its connector's count)", tag_keys=("decoder",))
        self._eta = metrics.Gauge(
            "baton_cliff_eta_seconds",
            "seconds until a decode replica's KV pool is forecast full: (capacity - retained real-time tokens) / their growth, "
            "capped at what the engine serves (router/cliff.py); -1: not filling",
            tag_keys=("decoder",))
        self._retained = metrics.Gauge(
            "baton_cliff_retained_tokens", "KV tokens a decode replica's real-time sessions hold in its pool (ticks in flight included)", tag_keys=("decoder",))
        self._growth = metrics.Gauge(
            "baton_cliff_growth_tokens_per_second", "how fast those tokens grow (min of offered and served)", tag_keys=("decoder",))
        self._relayed_in = metrics.Counter(
            "baton_directory_reports_relayed", "engine replicas' reports this shard received relayed from their home shard")
        self._kv_transfers = metrics.Gauge(
            "baton_decoder_kv_transfers_received", "KV transfers a decode replica completed (its connector's count)", tag_keys=("decoder",))
        logger.info("froze %d startup objects out of the garbage collector's walks (router/heap.py)", freeze_startup_heap())

    def _ensure_expiry(self) -> None:
        if self._expiry_task is None:
            self._expiry_task = asyncio.get_running_loop().create_task(self._expire_forever())

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_PERIOD_S)
            gone = self._state.expire(time.monotonic())
            if gone:
                logger.info("expired %d idle conversations", len(gone))
            self._live_pins.set(self._state.live_pins())

    async def report(self, report: ReplicaReport, relay: bool = False) -> tuple[int, ...]:
        """Store an engine replica's report; answer the shards that want its complete list of
        conversations (router/held_mirror.py; deployments/directory_client.py sends it to them).
        relay: this is the replica's home shard; pass the report on to the other shards."""
        self._ensure_expiry()
        owners = await self._adoption_owners([report])
        asking = (self._shard,) if await self._apply_adopting(report, owners) else ()
        if relay and self._relay_period_s > 0:
            if self._relay_task is None:
                self._relay_task = asyncio.get_running_loop().create_task(self._relay_forever())
            self._outbox.add(report)
            asking += self._asks.take(report.replica_id)
        return asking

    async def forwarded(self, reports: list[ReplicaReport]) -> list[str]:
        """Reports relayed by another shard (their home); the replicas whose complete list this shard wants."""
        self._ensure_expiry()
        self._relayed_in.inc(len(reports))
        self._state.totals["reports_relayed_in"] += len(reports)
        owners = await self._adoption_owners(reports)
        return [r.replica_id for r in reports if await self._apply_adopting(r, owners)]

    async def _adoption_owners(self, reports: list[ReplicaReport]) -> dict[str, str] | None:
        """The owners of the conversations these reports may have adopted (after a restart: up to
        4,096 a decoder, none cached), read in one lookup off the loop, ordered with the ownership
        writes (router/claim_batch.py). None when there is nothing to adopt (no read, no wait)."""
        now = time.monotonic()
        wanted = [sid for r in reports for sid in self._state.adoption_candidates(r, now)]
        return await self._claims.owners_of(wanted) if wanted else None

    async def _relay_forever(self) -> None:
        while True:
            await asyncio.sleep(self._relay_period_s)
            try:
                await self._relay_once()
            except Exception:  # the loop must outlive one bad flush: peers ask for what they missed
                logger.exception("relaying reports to the other directory shards failed; retrying next period")

    async def _relay_once(self) -> None:
        batch = self._outbox.take()
        if not batch:
            return
        peers = self._peer_handles()
        replies = await asyncio.gather(*(h.forwarded.remote(batch) for h in peers.values()), return_exceptions=True)
        for j, reply in zip(peers, replies, strict=True):
            if isinstance(reply, BaseException):  # that shard is down or restarting: it asks for what it lacks once back
                logger.warning("relaying %d reports to directory shard %d failed (%s: %s)", len(batch), j, type(reply).__name__, reply)
            else:
                self._asks.add(j, reply)

    def _peer_handles(self) -> dict[int, Any]:
        if not self._peers:
            app = serve.get_replica_context().app_name
            self._peers = {j: serve.get_deployment_handle(deployment_name(j, self._shards), app_name=app)
                           for j in range(self._shards) if j != self._shard}
        return self._peers

    async def _apply_adopting(self, report: ReplicaReport, owners: dict[str, str] | None) -> bool:
        """_apply, with a long list to adopt (a restart's: up to 4,096 pins, ~6 µs each) adopted
        ADOPT_CHUNK at a time, the loop serving other calls between the parts."""
        before = self._state.totals["pins_adopted"]
        held = report.conversations
        in_parts = owners is not None and len(held) > ADOPT_CHUNK
        wants_complete = self._apply(report, {} if in_parts else owners)  # in parts: stored now, nothing adopted yet
        adopted = self._state.totals["pins_adopted"] - before
        if in_parts:
            assert owners is not None
            for i in range(0, len(held), ADOPT_CHUNK):  # other reports may adopt between the parts: count this one's
                await asyncio.sleep(0)
                adopted += self._state.adopt(replace(report, conversations=held[i:i + ADOPT_CHUNK]), time.monotonic(), owners)
            self._live_pins.set(self._state.live_pins())
        if adopted:
            logger.info("adopted %d pins from the report of %s", adopted, report.replica_id)
        return wants_complete

    def _apply(self, report: ReplicaReport, owners: dict[str, str] | None = None) -> bool:
        """Store a report (DirectoryState.report) and publish its replica's figures; True: its complete list is wanted."""
        wants_complete = self._state.report(report, time.monotonic(), owners)
        if report.pool == "decode":
            replica_id = report.replica_id
            tags = {"decoder": replica_id}
            self._occupancy.set(report.kv_usage, tags=tags)
            self._pinned.set(self._state.pinned_on(replica_id), tags=tags)
            self._kv_in.set(float(report.kv_bytes_received), tags=tags)
            self._kv_transfers.set(float(report.kv_transfers_received), tags=tags)
            forecast = self._state.cliff_forecast(replica_id)
            if forecast is not None:
                self._eta.set(forecast.eta_s if forecast.eta_s is not None else -1.0, tags=tags)
                self._retained.set(float(forecast.retained_tokens), tags=tags)
                self._growth.set(forecast.growth_tokens_per_s, tags=tags)
        return wants_complete

    async def route(self, session_id: str | None, user: str | None, prompt_tokens: int, *, owned: bool = True,
                    cliff_horizon_s: float | None = None, via: str | None = None) -> TurnPlan:
        """owned=False: a session whose id the server made and whose connection is its only key
        (a real-time WebSocket): pinned like a conversation, never written to the ownership store.
        cliff_horizon_s: a new session avoids decoders whose KV cliff is that close (real-time).
        via: the asking ingress's pin cache (router/pin_cache.py)."""
        self._ensure_expiry()
        before, fallbacks = self._state.totals["conversations"], self._state.totals["prefill_fallback_local"]
        claimed = None
        if owned and session_id:  # claimed in a group commit, the loop serving other calls meanwhile (router/claim_batch.py)
            claimed = await self._claims.claim(session_id, user)
        plan = self._state.route(session_id, user, prompt_tokens, time.monotonic(), owned=owned, cliff_horizon_s=cliff_horizon_s,
                                 via=via, claimed=claimed)
        if self._state.totals["conversations"] > before:
            self._conversations.inc()
        if self._state.totals["prefill_fallback_local"] > fallbacks:
            self._fallbacks.inc()
        if plan.remote_prefill:
            self._handoffs.inc()
        self._live_pins.set(self._state.live_pins())
        return plan

    async def sync(self, via: str, incarnation: str | None, after_seq: int, touches: list[Touch], placed: list[Placed] | None = None) -> PinSync:
        """An ingress's pin cache: record the turns it planned, answer what changed elsewhere (router/pin_cache.py)."""
        self._ensure_expiry()
        return self._state.sync(via, incarnation, after_seq, touches, time.monotonic(), placed or ())

    async def served(self, session_id: str | None, replica_id: str) -> None:
        self._state.served(session_id, replica_id, time.monotonic())

    async def replica_failed(self, replica_id: str) -> int:
        held = self._state.replica_failed(replica_id, time.monotonic())
        logger.warning("replica %s failed; %d conversations will be re-placed on their next turn", replica_id, held)
        return held

    async def end_conversation(self, session_id: str, user: str | None) -> bool:
        """DELETE /v1/conversations/{id}: True when `user` owned it (now ended and unpinned).
        The end is written in a group commit off the loop (router/claim_batch.py); shielded, so a
        caller that goes away mid-write still has the pin dropped once the file has ended it."""
        return await asyncio.shield(asyncio.ensure_future(self._end(session_id, user)))

    async def _end(self, session_id: str, user: str | None) -> bool:
        forgotten = await self._claims.end(session_id, user)
        ended = self._state.end_conversation(session_id, user, forgotten=forgotten)
        self._live_pins.set(self._state.live_pins())
        return ended

    async def describe_conversation(self, session_id: str, user: str | None) -> dict[str, Any] | None:
        """GET /v1/conversations/{id}: the owner's view of it (ConversationInfo), None otherwise.
        An owner the cache lacks (after a restart) is read off the loop, in order with the writes."""
        if not session_id or not await self._claims.owners_of([session_id]):
            return None  # nobody owns it: nothing to show (and no read of the file on the loop)
        info = self._state.describe(session_id, user, time.monotonic())
        return info.as_json() if info is not None else None

    async def snapshot(self) -> dict[str, Any]:
        return {**self._state.snapshot(time.monotonic()), "ownership_claims": asdict(self._claims.stats())}


ConversationDirectoryDeployment = serve.deployment(
    ConversationDirectory, name="directory", num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}
)
