"""An ingress's cache of the conversation directory's pins: a pinned conversation's later turns are
planned here, without a call to the directory (its one replica is otherwise asked on every turn).

What is cached: for a session id, the decoder the directory placed it on and the user whose
ownership the directory checked then. A turn is planned from the cache only when all hold:
- the policy pins (conversation, conditional_pd, colocated) and the cache is on (sync period > 0);
- the turn's user is the cached one (anyone else goes to the directory, which refuses them);
- the last sync with the directory is at most two periods old (the directory is answering);
- the cached decoder is live in the last sync's view (reporting, not marked failed);
- conditional_pd only: the uncached suffix is short, so the turn is prefilled on its decoder (a
  remote prefill needs the directory's choice of prefill replica).
Anything else is a miss: the directory plans the turn and its answer refills the entry.

Turns outside a conversation (no session id) on an ingress without a prefill pool are planned
here too (`plan_sessionless`): there is no owner to check, no pin to make and no remote prefill
to arrange, only a decoder to choose, and the cache holds what the directory would choose it
from: the live decoders' loads as of the last sync (`PinSync.decoder_loads`, the directory's own
view: reports, pins, turns placed since the reports) plus the turns this ingress placed since,
scored by the same policy function and weights (router/policy.plan_turn). Such a turn goes to the
directory with its next sync (`Placed`), which counts it as load on its decoder until that
decoder reports. A stale sync, no live decoder, or a policy the cache does not serve: the
directory plans the turn.

Sync (every period, deployments/pin_sync.py): the ingress sends the turns it planned from the
cache (`Touch`: the directory records them as if it had routed them: last seen, turn count, the
context the decoder holds) and the last change it has seen; the directory answers `PinSync`: the
conversations whose pins changed since then through anyone else, as they are now (`PinUpdate`):
one another ingress served on the same decoder keeps its entry here with the directory's turn
count; one that moved (a decoder failure's re-placement, a fallback, an adoption), ended or
expired is dropped, and its view of the live decoders and the pools' load (for admission). A directory that
restarted (a new incarnation) or whose change log no longer reaches back that far answers
`reset`: every entry is dropped. The directory's route answers carry its incarnation and latest
change too, so the first answer of a (re)started directory starts the cache there: the entries it
fills are vouched for by the next sync (changes after that answer), not dropped by it.

Staleness is bounded: a pin moved by someone else can be used here until the next sync, at most
two periods (the freshness bound) — a turn then runs on the conversation's previous decoder,
which is correct (every turn carries its whole history; that decoder recomputes what it lacks)
but costs a prefill; a turn sent to a decoder that died fails over as any turn does
(deployments/backend.py). Turn indices planned here are the directory's count as of the last
sync plus this ingress's turns since: exact unless two ingresses serve turns of one conversation
within one period.

Invariants (check_integrity): at most `capacity` entries, each with a non-empty id, a decoder and
turns >= 1; pending touches at most `max_pending`; the seq is never negative.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from router.policy import PINNING, NoReplicaAvailable, Policy, TurnPlan, needs_remote_prefill, plan_turn
from router.scoring import LoadWeights, ReplicaLoad

FRESHNESS_PERIODS = 2.0  # a cached pin is used only while the last sync is at most this many periods old
DEFAULT_CAPACITY = 100_000
DEFAULT_MAX_PENDING = 100_000
TOTALS = ("hits", "misses", "misses_unknown", "misses_other_user", "misses_stale", "misses_not_live", "misses_remote_prefill",
          "invalidated", "updated", "resets", "forgotten", "evicted", "syncs", "sync_failures", "touches_dropped",
          "sessionless_hits", "sessionless_misses")  # what snapshot() reports, 0 until counted


@dataclass(frozen=True)
class Touch:
    """A turn this ingress planned from its cache, for the directory to record."""

    session_id: str
    user: str | None
    decoder: str
    prompt_tokens: int
    age_s: float  # how long before the sync it was planned (clocks of two processes are not compared)


@dataclass(frozen=True)
class Placed:
    """A turn outside a conversation this ingress placed from its cache's view of the loads."""

    decoder: str
    prompt_tokens: int


@dataclass(frozen=True)
class PinUpdate:
    """A conversation whose pin changed elsewhere, as the directory holds it now."""

    session_id: str
    decoder: str | None  # None: no pin any more (ended, expired, evicted)
    user: str | None = None
    turns: int = 0  # the directory's count of its turns
    held_tokens: int = 0  # its last turn's prompt


@dataclass(frozen=True)
class PinSync:
    """The directory's answer to a sync."""

    incarnation: str  # this directory's identity; a new one (a restart) means nothing cached holds
    seq: int  # its latest pin change
    changed: tuple[PinUpdate, ...]  # the pins changed since the asker's seq, by anyone but the asker
    reset: bool  # the asker's seq is from another incarnation or older than the change log: drop everything
    live_decoders: tuple[str, ...]
    pool_queueing: bool = False
    pool_in_flight: int = 0
    decoder_loads: tuple[ReplicaLoad, ...] = ()  # the live decoders' loads as the directory places on them
    weights: LoadWeights = LoadWeights()  # the directory's placement weights


@dataclass
class _Entry:
    user: str | None
    decoder: str
    turns: int  # turns of the conversation planned so far (directory's count when filled, then this ingress's)
    held_tokens: int  # the last turn's prompt: the context the decoder was asked to hold


class PinCache:
    def __init__(self, policy: Policy, sync_period_s: float, *, threshold_tokens: int = 0, capacity: int = DEFAULT_CAPACITY,
                 max_pending: int = DEFAULT_MAX_PENDING, clock: Callable[[], float] = time.monotonic):
        if sync_period_s < 0 or capacity < 1 or max_pending < 1:
            raise ValueError("sync_period_s >= 0, capacity >= 1 and max_pending >= 1")
        self.policy = policy
        self.sync_period_s = sync_period_s
        self.enabled = policy in PINNING and sync_period_s > 0
        self._threshold = threshold_tokens
        self._capacity = capacity
        self._max_pending = max_pending
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._pending: list[tuple[Touch, float]] = []  # (touch with age 0, when planned)
        self._incarnation: str | None = None
        self._seq = 0
        self._synced_at: float | None = None
        self._live: frozenset[str] = frozenset()
        self.pool_queueing = False
        self.pool_in_flight = 0
        self._loads: tuple[ReplicaLoad, ...] = ()
        self._weights = LoadWeights()
        self._placed: list[Placed] = []  # sessionless turns placed here, not yet sent to the directory
        self._placed_sent: list[Placed] = []  # sent with the sync in flight (not in its view until it answers)
        self.totals: Counter[str] = Counter()

    # ---- turns ---------------------------------------------------------------------------
    def fresh(self, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        return self._synced_at is not None and now - self._synced_at <= FRESHNESS_PERIODS * self.sync_period_s

    def plan(self, session_id: str | None, user: str | None, prompt_tokens: int) -> TurnPlan | None:
        """The turn's plan from the cache (recorded as a pending touch), or None: ask the directory."""
        if not self.enabled or not session_id:
            return None
        entry = self._entries.get(session_id)
        now = self._clock()
        why = ("misses_unknown" if entry is None else "misses_other_user" if entry.user != user else
               "misses_stale" if not self.fresh(now) else "misses_not_live" if entry.decoder not in self._live else None)
        if why is not None:
            self.totals.update(("misses", why))
            return None
        if self.policy == "conditional_pd" and needs_remote_prefill(prompt_tokens, entry.held_tokens, self._threshold):
            self.totals["misses_remote_prefill"] += 1
            return None
        self._entries.move_to_end(session_id)
        turn_index = entry.turns
        entry.turns += 1
        entry.held_tokens = prompt_tokens
        if len(self._pending) >= self._max_pending:  # the directory has not answered for long: its oldest are dropped
            self._pending.pop(0)
            self.totals["touches_dropped"] += 1
        self._pending.append((Touch(session_id, user, entry.decoder, prompt_tokens, 0.0), now))
        self.totals["hits"] += 1
        return TurnPlan(entry.decoder, remote_prefill=False, reason="pinned", turn_index=turn_index,
                        pool_queueing=self.pool_queueing, pool_in_flight=self.pool_in_flight)

    def plan_sessionless(self, prompt_tokens: int) -> TurnPlan | None:
        """A turn without a session id, placed on the decoder the directory's policy would choose
        from the last sync's loads plus this ingress's placements since; None: ask the directory.
        Call it only where no remote prefill is possible (no prefill pool)."""
        now = self._clock()
        loads = [load for load in self._loads if load.replica_id in self._live]
        if not self.enabled or not self.fresh(now) or not loads:
            self.totals["sessionless_misses"] += 1
            return None
        try:
            plan = plan_turn(self.policy, pinned=None, decoders=with_placed(loads, self._placed_sent + self._placed), prompt_tokens=prompt_tokens,
                             prefill_available=False, rr_counter=0, w=self._weights, threshold_tokens=self._threshold)
        except NoReplicaAvailable:
            self.totals["sessionless_misses"] += 1
            return None
        self._placed.append(Placed(plan.decode_replica, prompt_tokens))
        if len(self._placed) > self._max_pending:
            self._placed.pop(0)
            self.totals["touches_dropped"] += 1
        self.totals["sessionless_hits"] += 1
        return TurnPlan(plan.decode_replica, remote_prefill=False, reason=plan.reason, kv_overflow=plan.kv_overflow,
                        pool_queueing=self.pool_queueing, pool_in_flight=self.pool_in_flight + len(self._placed_sent) + len(self._placed))

    def remember(self, session_id: str | None, user: str | None, plan: TurnPlan, prompt_tokens: int) -> None:
        """The directory planned this turn (and checked `user` owns the conversation): cache its pin."""
        if not self.enabled or not session_id or plan.reason not in ("pinned", "new", "repinned"):
            return
        if plan.incarnation is not None and plan.incarnation != self._incarnation:
            # the first answer of this directory (at start, or after it restarted): what was cached
            # came from another one; the next sync asks for changes after this plan's
            self._drop_all()
            self._incarnation, self._seq = plan.incarnation, plan.pin_seq
        self._entries[session_id] = _Entry(user, plan.decode_replica, plan.turn_index + 1, prompt_tokens)
        self._entries.move_to_end(session_id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
            self.totals["evicted"] += 1

    def forget(self, session_id: str | None) -> None:
        if session_id and self._entries.pop(session_id, None) is not None:
            self.totals["forgotten"] += 1

    def forget_decoder(self, replica_id: str) -> int:
        """A decoder failed a request here: none of its pins is used until the directory re-places them."""
        gone = [sid for sid, e in self._entries.items() if e.decoder == replica_id]
        for sid in gone:
            del self._entries[sid]
        self._live = self._live - {replica_id}
        self.totals["forgotten"] += len(gone)
        return len(gone)

    # ---- sync ----------------------------------------------------------------------------
    def sync_args(self) -> tuple[str | None, int]:
        """(incarnation, seq) to send: the directory answers the changes after them."""
        return self._incarnation, self._seq

    def take_touches(self) -> list[Touch]:
        """The pending touches, aged to now, handed over to one sync (give them back if it fails)."""
        now = self._clock()
        out = [Touch(t.session_id, t.user, t.decoder, t.prompt_tokens, max(0.0, now - at)) for t, at in self._pending]
        self._pending = []
        return out

    def take_placed(self) -> list[Placed]:
        """The sessionless placements since the last sync, handed over to one sync (they count as
        this ingress's own load until its answer, which has them in its view)."""
        self._placed_sent, self._placed = self._placed_sent + self._placed, []
        return list(self._placed_sent)

    def give_back(self, touches: Iterable[Touch], placed: Iterable[Placed] = ()) -> None:
        """A sync that failed: its touches and placements go out with the next one (oldest first, within max_pending)."""
        self._placed = [*placed, *self._placed][-self._max_pending:]
        self._placed_sent = []
        now = self._clock()
        back = [(Touch(t.session_id, t.user, t.decoder, t.prompt_tokens, 0.0), now - t.age_s) for t in touches]
        merged = back + self._pending
        drop = max(0, len(merged) - self._max_pending)
        self.totals["touches_dropped"] += drop
        self._pending = merged[drop:]
        self.totals["sync_failures"] += 1

    def apply(self, sync: PinSync, asked: tuple[str | None, int] | None = None) -> None:
        """The directory's answer to a sync asked with `asked` (sync_args() then; None: now): drop
        what changed elsewhere (everything on a reset), take its view. A route answer that started
        the cache at this directory while the sync was in flight (remember) has the newer start:
        the answer then only refreshes the view, and the next sync asks from that start (an
        answer of an older incarnation than that start is ignored)."""
        if asked is not None and asked[0] != self._incarnation:
            if sync.incarnation == self._incarnation:
                self._view(sync)
            return  # else: an answer of the directory before the one the cache now starts at
        if sync.reset or sync.incarnation != self._incarnation:
            self._drop_all()
        else:
            self._update(sync.changed)
        self._incarnation = sync.incarnation
        self._seq = sync.seq
        self._view(sync)

    def _update(self, changed: Iterable[PinUpdate]) -> None:
        """A pin that moved, ended or changed hands is dropped; one another ingress served on the
        same decoder is kept, its turn count and held context taken from the directory (plus the
        turns planned here since the sync left)."""
        pending = Counter(t.session_id for t, _ in self._pending)
        for u in changed:
            e = self._entries.get(u.session_id)
            if e is None:
                continue
            if u.decoder != e.decoder or u.user != e.user:
                del self._entries[u.session_id]
                self.totals["invalidated"] += 1
                continue
            e.turns = max(1, u.turns + pending[u.session_id])
            if not pending[u.session_id]:
                e.held_tokens = u.held_tokens
            self.totals["updated"] += 1

    def _view(self, sync: PinSync) -> None:
        self._live = frozenset(sync.live_decoders)
        self._loads, self._weights = sync.decoder_loads, sync.weights
        self._placed_sent = []  # the directory counted them before answering
        self.pool_queueing = sync.pool_queueing
        self.pool_in_flight = sync.pool_in_flight
        self._synced_at = self._clock()
        self.totals["syncs"] += 1

    def _drop_all(self) -> None:
        if self._entries:
            self.totals["resets"] += 1
        self.totals["invalidated"] += len(self._entries)
        self._entries.clear()

    # ---- reporting -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        counts = {k: self.totals[k] for k in TOTALS}
        return {"enabled": self.enabled, "sync_period_s": self.sync_period_s, "entries": len(self._entries),
                "pending_touches": len(self._pending), "pending_placed": len(self._placed), "fresh": self.fresh(), "live_decoders": len(self._live), **counts}

    def check_integrity(self) -> None:
        if len(self._entries) > self._capacity:
            raise AssertionError("more cached pins than the capacity")
        if len(self._pending) > self._max_pending or len(self._placed) > self._max_pending:
            raise AssertionError("more pending touches or placements than max_pending")
        if self._seq < 0:
            raise AssertionError("negative seq")
        for sid, e in self._entries.items():
            if not sid or not e.decoder or e.turns < 1 or e.held_tokens < 0:
                raise AssertionError(f"bad cached pin {sid!r}: {e}")


def with_placed(loads: Iterable[ReplicaLoad], placed: Iterable[Placed]) -> list[ReplicaLoad]:
    """The loads plus turns placed on them since (one more request in flight and its prompt's KV each)."""
    extra: dict[str, tuple[int, int]] = {}
    for p in placed:
        turns, tokens = extra.get(p.decoder, (0, 0))
        extra[p.decoder] = (turns + 1, tokens + p.prompt_tokens)
    out = []
    for load in loads:
        turns, tokens = extra.get(load.replica_id, (0, 0))
        grown = tokens / load.kv_capacity_tokens if load.kv_capacity_tokens else 0.0
        out.append(replace(load, kv_usage=load.kv_usage + grown, kv_held=load.kv_held + grown, in_flight=load.in_flight + turns)
                   if turns else load)
    return out


__all__ = ["FRESHNESS_PERIODS", "PinCache", "PinSync", "PinUpdate", "Placed", "Touch", "with_placed"]
