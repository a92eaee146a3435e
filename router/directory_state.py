"""The conversation directory's state: live engine replicas (as they report themselves), the
pin of every conversation, and who owns each conversation. Clock-injected, and its one I/O (the
ownership file, router/ownership.py) is injected too, so it is tested without Ray.

Ownership is not the pin: a pin says where a conversation's KV is and expires with it; the owner
is durable (SQLite) and holds after pin expiry and directory restarts, until the owner ends the
conversation (`end_conversation`). Every turn with a session id is checked (and a new id
claimed) before it is placed.

Ingresses cache pins (router/pin_cache.py): pin changes are logged (router/pin_log.py), and the
turns an ingress planned from its cache come back as touches, recorded like routed turns; the
sessionless turns it placed from its view of the loads come back as unreported load.

Pins survive a directory restart through the decoders: each reports the conversations it served
lately (ReplicaReport.conversations) and a fresh directory adopts a pin for each conversation it
has none for, so returning conversations go back to their decoder ("pinned", no second handoff);
reports carry what changed, and a fresh directory asks for the whole list (router/held_mirror.py).

Invariants (check_integrity):
- every pin has a non-empty session id, last_seen >= created, turns >= 1, handoffs >= 0, and
  each decoder's pin count and held tokens are their sum (router/pin_table.py);
- at most max_conversations pins; unreported load is never negative and only on known replicas;
- a pin's user agrees with the conversation's owner wherever the owner is cached;
- the pin change log is in order (router/pin_log.py);
- (by construction) a replica marked failed is not live until it reports again after stale_after_s.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from router.cliff import CliffForecast, forecast_cliff, within_horizon
from router.conversation_info import ConversationInfo
from router.directory_loads import prefill_loads
from router.directory_types import DirectorySettings, Pin, Reported
from router.fleet import Fleet
from router.held_mirror import HeldMirror
from router.ownership import Claim, KnownOwners, OwnershipStore
from router.pin_adoption import adopt_pins, adoption_candidates
from router.pin_cache import PinSync, PinUpdate, Placed, Touch
from router.pin_log import PinChangeLog, record_touch
from router.pin_table import PinTable
from router.placement import choose_prefill, decoder_idle
from router.policy import DISAGGREGATED, PINNING, NoReplicaAvailable, TurnPlan, plan_turn
from router.report import ReplicaReport
from router.scoring import ReplicaLoad


class PinsRebuilding(RuntimeError):
    """A conversation this directory has never pinned came back within its first
    `rebuild_grace_s`: its decoder's report (which would restore its pin) may not have arrived
    yet, so placing it now could move it (a second handoff). Answered 503 + Retry-After."""


class ForeignConversation(LookupError):
    """The session id names a conversation opened by another user (answered like an unknown one)."""


class DirectoryState:
    def __init__(self, settings: DirectorySettings, owners: KnownOwners | None = None):
        """`owners`: the durable ownership store (default: an in-memory one, for tests)."""
        self.settings = settings
        self._owners = owners if owners is not None else KnownOwners(OwnershipStore(":memory:"))
        self._born: float | None = None  # the first report or turn this directory saw (its start)
        self._pins = PinTable()  # with each decoder's pin count and held tokens
        # the replicas' reports, failures and turns sent since, with the live lists and decoder loads kept
        self._fleet = Fleet(settings.stale_after_s, self._pins if settings.policy in PINNING else None)
        self._rr = 0
        self.totals: Counter[str] = Counter()
        self.changes = PinChangeLog()  # for the ingresses' pin caches
        self._held = HeldMirror()  # the conversations each decoder holds, from its reports

    # ---- replicas ------------------------------------------------------------------------
    def report(self, report: ReplicaReport, now: float, owners: Mapping[str, str] | None = None) -> bool:
        """Store a report, adopt the pins it allows (`adopt`); True: send the complete list of conversations."""
        self._born = now if self._born is None else self._born
        if not self._fleet.store(report, now):
            return False  # a report sent before the failure and delivered after it: ignore
        if report.pool == "decode":  # pins back from what the decoder holds (after a restart)
            self.adopt(report, now, owners)
            if self._held.apply(report, now):
                self.totals["complete_lists_asked"] += 1
                return True
        return False

    def adopt(self, part: ReplicaReport, now: float, owners: Mapping[str, str] | None = None) -> int:
        """Adopt pins from (part of) a stored report, unless its replica failed since; the number adopted. owners: those of
        adoption_candidates read beforehand (ClaimBatcher.owners_of; one missing has none); None: each read from the store."""
        if part.pool != "decode" or part.replica_id in self._fleet.failed or part.replica_id not in self._fleet.replicas:
            return 0
        adopted = adopt_pins(self._pins, part, now, self.settings, owners.get if owners is not None else self._owners.owner)
        for sid in adopted:
            self._changed(sid)
        self.totals["pins_adopted"] += len(adopted)
        return len(adopted)

    def adoption_candidates(self, report: ReplicaReport, now: float) -> list[str]:
        """The conversations of a decoder's report whose owner adopting them would read."""
        return adoption_candidates(self._pins, report, now, self.settings) if report.pool == "decode" else []

    def live(self, pool: str, now: float) -> list[ReplicaReport]:
        """The live replicas of `pool` (a shared list: do not modify)."""
        return self._fleet.live(pool, now)

    def _prefill_for(self, plan: TurnPlan, now: float) -> str | None:
        """The prefill replica for a planned remote prefill, or None: prefill on the decoder."""
        s = self.settings
        d = self._fleet.replicas[plan.decode_replica].report
        idle = decoder_idle(d.num_waiting, d.pending_prefill_tokens + self._fleet.unreported_of(d.replica_id)[1],
                            s.conditional_pd_threshold_tokens)
        return choose_prefill(prefill_loads(self.live("prefill", now), self._fleet.unreported), decoder_idle=idle,
                              limit_tokens=s.prefill_queue_limit_tokens)

    def cliff_forecast(self, replica_id: str) -> CliffForecast | None:
        """The KV cliff forecast of a decoder from its latest report, made when it arrived."""
        r = self._fleet.replicas.get(replica_id)
        return forecast_cliff(r.report.decoder_tokens(), r.at) if r is not None and r.report.pool == "decode" else None

    def cliff_eta(self, replica_id: str, now: float) -> float | None:
        fc = self.cliff_forecast(replica_id)
        return fc.eta_at(now) if fc is not None else None

    def _away_from_cliff(self, loads: list[ReplicaLoad], now: float, horizon_s: float | None) -> list[ReplicaLoad]:
        """The decoders whose KV cliff is not within horizon_s (all of them when none is, or no horizon)."""
        if horizon_s is None:
            return loads
        return [d for d in loads if not within_horizon(self.cliff_eta(d.replica_id, now), horizon_s)] or loads

    def pinned_counts(self) -> Counter[str]:
        return Counter(self._pins.counts())

    def live_pins(self) -> int:
        return len(self._pins)

    def pinned_on(self, replica_id: str) -> int:
        return self._pins.counts().get(replica_id, 0)

    # ---- turns ----------------------------------------------------------------------------
    def route(self, session_id: str | None, user: str | None, prompt_tokens: int, now: float, *, owned: bool = True,
              cliff_horizon_s: float | None = None, via: str | None = None, claimed: Claim | None = None) -> TurnPlan:
        """Plan a turn and record it: the pin is created (or moved) before the turn runs, so two
        ingress replicas asking at once for one new conversation get the same decoder.
        Ownership is checked (a new session id claimed for `user`) before placement, so a
        NoReplicaAvailable from here means the caller does own the conversation.
        Raises ForeignConversation when the session id belongs to another user. owned=False skips
        the ownership store (server-made ids of real-time sessions: their connection is the key).
        cliff_horizon_s: a new session avoids decoders whose KV cliff is closer than this, while any other is live.
        via: the asking ingress's pin cache (its own change is not sent back to it).
        claimed: the caller already claimed the session id for `user` (router/claim_batch.py's group commit)."""
        s = self.settings
        session_id = session_id or None
        claim = None
        if owned and session_id is not None:
            claim = claimed if claimed is not None else self._owners.claim(session_id, user)
        if claim is Claim.FOREIGN:
            # a conversation belongs to the user who opened it; to anyone else it does not exist
            self.totals["foreign_session_refused"] += 1
            raise ForeignConversation(session_id)
        pin = self._pins.get(session_id)
        if self._born is None:
            self._born = now
        if pin is None and claim is Claim.OWNED and now - self._born < s.rebuild_grace_s:
            self.totals["rebuild_wait_refused"] += 1
            raise PinsRebuilding(session_id)
        decoders = self.live("decode", now)  # once per turn: placement, the pools' queueing and in flight
        plan = plan_turn(
            s.policy,
            pinned=pin.decoder if pin else None,
            decoders=self._away_from_cliff(self._fleet.decoder_loads(decoders), now, cliff_horizon_s if pin is None else None),
            prompt_tokens=prompt_tokens,
            prefill_available=bool(self.live("prefill", now)) and s.policy in DISAGGREGATED,
            rr_counter=self._rr,
            w=s.weights,
            held_tokens=pin.prompt_tokens if pin else 0,
            threshold_tokens=s.conditional_pd_threshold_tokens,
        )
        self._rr += 1
        if plan.kv_overflow:
            self.totals["placed_without_kv_room"] += 1
        if plan.remote_prefill:
            prefill = self._prefill_for(plan, now)
            if prefill is None:
                self.totals["prefill_fallback_local"] += 1
                plan = replace(plan, remote_prefill=False)
            else:
                self._fleet.count(prefill, prompt_tokens, now)
                plan = replace(plan, prefill_replica=prefill)
        self._fleet.count(plan.decode_replica, prompt_tokens, now, session_id)
        self.totals["turns"] += 1
        self.totals[f"plan_{plan.reason}"] += 1
        if plan.remote_prefill:
            self.totals["planned_handoffs"] += 1
        if session_id is not None:
            self._record(session_id, user, plan, now, prompt_tokens)
            self._changed(session_id, via)
            plan = replace(plan, turn_index=self._pins[session_id].turns - 1)
        return replace(plan, pool_queueing=bool(decoders) and all(r.num_waiting > 0 for r in decoders),
                       pool_in_flight=self.pool_in_flight(now, decoders), cliff_eta_s=self.cliff_eta(plan.decode_replica, now),
                       incarnation=self.changes.incarnation, pin_seq=self.changes.seq)

    def pool_in_flight(self, now: float, live: list[ReplicaReport] | None = None) -> int:
        """Requests the live decoders reported serving, plus the turns placed on them since their
        reports (every turn has a decoder; a first turn's remote prefill is part of it)."""
        live, unreported = self.live("decode", now) if live is None else live, self._fleet.unreported
        return sum(r.in_flight + unreported.get(r.replica_id, (0, 0))[0] for r in live)

    def _record(self, session_id: str, user: str | None, plan: TurnPlan, now: float, prompt_tokens: int) -> None:
        pin = self._pins.get(session_id)
        if pin is None:
            if len(self._pins) >= self.settings.max_conversations:
                self._evict_oldest()
            self._pins.put(session_id, Pin(plan.decode_replica, user, now, now, 1, int(plan.remote_prefill), prompt_tokens=prompt_tokens))
            self.totals["conversations"] += 1
            return
        self._pins.hold(session_id, prompt_tokens)
        self._pins.move(session_id, plan.decode_replica)
        pin.last_seen = now
        pin.adopted = False
        pin.turns += 1
        pin.handoffs += int(plan.remote_prefill)

    def served(self, session_id: str | None, replica_id: str, now: float) -> None:
        """The turn actually ran on `replica_id` (the router may have fallen back): follow it."""
        pin = self._pins.get(session_id)
        if pin is None or not session_id:
            return
        if pin.decoder != replica_id:
            self._pins.move(session_id, replica_id)
            self._changed(session_id)
            self.totals["pin_moved_by_fallback"] += 1
        pin.last_seen = now

    def replica_failed(self, replica_id: str, now: float) -> int:
        """Stop placing on a replica that failed a request; its conversations are re-placed on
        their next turn. Returns how many pins it held."""
        self._fleet.fail(replica_id, now)
        held = self._pins.counts().get(replica_id, 0)
        self.totals["replica_failures"] += 1
        return held

    def describe(self, session_id: str, user: str | None, now: float) -> ConversationInfo | None:
        """The conversation as its owner may see it; None (the same for every other case: someone
        else's, nobody's, or owned but no longer pinned) unless `user` owns it and it is pinned."""
        pin = self._pins.get(session_id)
        owner = self._owners.owner(session_id)
        if pin is None or owner is None or owner != (user or ""):
            return None
        return ConversationInfo(session_id, pin.decoder, pin.turns, pin.handoffs, pin.prompt_tokens, self._held.holds(pin.decoder, session_id),
                                max(0.0, now - pin.last_seen), max(0.0, now - pin.created), pin.adopted)

    def end_conversation(self, session_id: str, user: str | None = None, forgotten: bool | None = None) -> bool:
        """The owner ends a conversation: its ownership is forgotten (the id is free again) and
        its pin dropped. False, changing nothing, when `user` does not own it (or nobody does).
        forgotten: the caller already ended its ownership (router/claim_batch.py's group commit)."""
        ended = forgotten if forgotten is not None else self._owners.forget(session_id, user)
        if not ended:
            return False
        self._pins.pop(session_id)
        self._changed(session_id)
        self.totals["ended"] += 1
        return True

    def expire(self, now: float) -> list[str]:
        """Drop conversations idle longer than the TTL; their KV is then only evictable cache."""
        ttl = self.settings.conversation_ttl_s
        gone = [sid for sid, p in self._pins.items() if now - p.last_seen > ttl]
        for sid in gone:
            self._pins.pop(sid)
            self._changed(sid)
        self.totals["expired"] += len(gone)
        return gone

    def _evict_oldest(self) -> None:
        oldest = self._pins.oldest()
        self._pins.pop(oldest)
        self._changed(oldest)
        self.totals["evicted"] += 1

    # ---- ingress pin caches -------------------------------------------------------------------
    def _changed(self, session_id: str, via: str | None = None) -> None:
        self.changes.changed(session_id, via)

    def sync(self, via: str, incarnation: str | None, after_seq: int, touches: Iterable[Touch], now: float,
             placed: Iterable[Placed] = ()) -> PinSync:
        """An ingress's pin cache: record its touches and sessionless placements (load on their decoders until
        those report, as routed turns are); answer the changes since `after_seq`, the live decoders' loads, the weights."""
        for t in touches:
            if record_touch(self._pins.get(t.session_id), t, now):
                self._pins.hold(t.session_id, t.prompt_tokens)
                self._changed(t.session_id, via)
                self.totals.update(("turns", "plan_pinned_at_ingress"))
                self._fleet.count(t.decoder, t.prompt_tokens, now)
            else:
                self.totals["pin_touches_stale"] += 1
        for p in placed:
            self.totals.update(("turns", "plan_sessionless_at_ingress"))
            self._fleet.count(p.decoder, p.prompt_tokens, now)
        changed, reset = self.changes.since(via, incarnation, after_seq)
        updates = tuple(PinUpdate(sid, p.decoder, p.user, p.turns, p.prompt_tokens) if (p := self._pins.get(sid)) else PinUpdate(sid, None)
                        for sid in changed)
        decoders = self.live("decode", now)
        self.totals["pin_syncs"] += 1
        return PinSync(self.changes.incarnation, self.changes.seq, updates, reset, tuple(sorted(r.replica_id for r in decoders)),
                       pool_queueing=bool(decoders) and all(r.num_waiting > 0 for r in decoders), pool_in_flight=self.pool_in_flight(now, decoders),
                       decoder_loads=tuple(self._fleet.decoder_loads(decoders)), weights=self.settings.weights)

    def pin_of(self, session_id: str) -> Pin | None:
        p = self._pins.get(session_id)
        return replace(p) if p is not None else None

    # ---- reporting --------------------------------------------------------------------------
    def snapshot(self, now: float) -> dict[str, Any]:
        pinned = self._pins.counts()
        convs = [p for p in self._pins.values()]
        handoffs = sum(p.handoffs for p in convs)
        replicas = {
            rid: {**r.report.figures(), "pool": r.report.pool, "node_id": r.report.node_id, "live": self._fleet.is_live(r, now), "pinned": pinned.get(rid, 0),
                  "age_s": round(now - r.at, 3), "cliff_eta_s": self.cliff_eta(rid, now)}
            for rid, r in self._fleet.replicas.items()
        }
        t = self.totals
        return {
            "policy": self.settings.policy, "live_pins": len(self._pins), "conversations_total": t["conversations"],
            "handoffs_planned_total": t["planned_handoffs"], "prefill_fallback_local_total": t["prefill_fallback_local"],
            "placed_without_kv_room_total": t["placed_without_kv_room"],
            "handoffs_per_live_conversation": (handoffs / len(convs)) if convs else 0.0,
            "turns_total": t["turns"], "owners_cached": len(self._owners), "totals": dict(t), "replicas": replicas,
        }

    def check_integrity(self) -> None:
        for sid, p in self._pins.items():
            if p.last_seen < p.created or p.turns < 1 or p.handoffs < 0 or not sid:
                raise AssertionError(f"bad pin {sid!r}: {p}")
        self._pins.check_integrity()
        self._held.check_integrity()
        if len(self._pins) > self.settings.max_conversations:
            raise AssertionError("more conversations than max_conversations")
        self._fleet.check_integrity()
        if len(self._owners) > self._owners.capacity:
            raise AssertionError("more cached owners than the cache holds")
        for sid, p in self._pins.items():
            owner = self._owners.cached(sid)
            if owner is not None and (p.user or "") != owner:
                raise AssertionError(f"pin {sid!r} is for {p.user!r} but the conversation is {owner!r}'s")
        self.changes.check_integrity()


__all__ = ["DirectorySettings", "DirectoryState", "NoReplicaAvailable", "Pin", "Reported"]
