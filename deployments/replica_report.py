"""How an engine replica describes itself to the router: its engine's stats, this process's
KV-transfer totals and the conversations it served lately (`HeldConversations`) become one
router.report.ReplicaReport (pure; deployments/pool.py sends it). The conversations let a
restarted directory rebuild its pins from the decoders themselves."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from baton.engine.realtime.growth import TokenGrowth
from baton.engine.types import EngineStats
from kv_transfer.ledger import TransferTotals
from router.report import MAX_REPORTED_CONVERSATIONS, ReplicaReport


class HeldConversations:
    """The session ids of the turns this replica served lately, most recent last: a bounded LRU
    (its KV is likely still in the prefix cache). Clock-injected by the caller (monotonic).

    Reported two ways (router/held_mirror.py): `recent` lists them all; `delta` lists only what
    changed since the previous delta (served, and dropped from the LRU) and numbers it. Invariant:
    `_fresh` is held, `_dropped` is not."""

    def __init__(self, capacity: int = MAX_REPORTED_CONVERSATIONS):
        if not 1 <= capacity <= MAX_REPORTED_CONVERSATIONS:
            raise ValueError(f"capacity must lie in [1, {MAX_REPORTED_CONVERSATIONS}]")
        self.capacity = capacity
        self._last: OrderedDict[str, float] = OrderedDict()  # session id -> when last served
        self._fresh: set[str] = set()  # served since the last delta
        self._dropped: set[str] = set()  # dropped from the LRU since the last delta (and not served again)
        self.seq = 0  # deltas made so far: the number of the latest

    def served(self, session_id: str | None, now: float) -> None:
        if not session_id:
            return
        self._last[session_id] = now
        self._last.move_to_end(session_id)
        self._fresh.add(session_id)
        self._dropped.discard(session_id)
        if len(self._last) > self.capacity:
            gone, _ = self._last.popitem(last=False)
            self._fresh.discard(gone)
            self._dropped.add(gone)

    def delta(self, now: float) -> tuple[int, tuple[tuple[str, float], ...], tuple[str, ...]]:
        """(seq, served since the previous delta as (session id, idle seconds) most recent first,
        dropped since then); starts the next delta."""
        served = tuple(sorted(((sid, max(0.0, now - self._last[sid])) for sid in self._fresh), key=lambda e: (e[1], e[0])))
        dropped = tuple(sorted(self._dropped))
        self._fresh.clear()
        self._dropped.clear()
        self.seq += 1
        return self.seq, served, dropped

    def check_integrity(self) -> None:
        if not self._fresh <= self._last.keys() or self._dropped & self._last.keys() or len(self._last) > self.capacity:
            raise AssertionError("held conversations: a fresh id not held, a dropped id held, or over capacity")

    def recent(self, now: float) -> tuple[tuple[str, float], ...]:
        """(session id, idle seconds), most recent first: ReplicaReport.conversations."""
        return tuple((sid, max(0.0, now - at)) for sid, at in reversed(self._last.items()))

    def __len__(self) -> int:
        return len(self._last)


def replica_report(replica_id: str, pool: str, stats: EngineStats, transfers: TransferTotals,
                   extra: Mapping[str, float] | None = None,
                   conversations: tuple[tuple[str, float], ...] = (), growth: TokenGrowth | None = None,
                   node_id: str = "", delta: tuple[int, tuple[str, ...]] | None = None) -> ReplicaReport:
    """The report of one replica; `extra`: display-only figures (checkpoint, segment counters);
    `conversations`: HeldConversations.recent(), or the served part of HeldConversations.delta()
    with `delta` its (seq, dropped) (decoders only); `growth`: its real-time sessions' tokens
    (RealtimeSessions.token_growth); `node_id`: the Ray node it runs on."""
    return ReplicaReport(
        replica_id=replica_id,
        pool=pool,
        kv_usage=stats.kv_usage,
        kv_resident=stats.kv_resident,
        kv_capacity_tokens=stats.kv_capacity_tokens,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        pending_prefill_tokens=stats.pending_prefill_tokens,
        in_flight=stats.in_flight,
        kv_transfers_received=transfers.requests_received,
        kv_bytes_received=transfers.bytes_received,
        kv_transfer_failures=transfers.failures,
        kv_transfers_offered=transfers.requests_offered,
        extra=tuple((extra or {}).items()),
        conversations=conversations,
        retained_tokens=growth.retained_tokens if growth else 0,
        offered_growth_tokens_per_s=growth.offered_tokens_per_s if growth else 0.0,
        served_growth_tokens_per_s=growth.served_tokens_per_s if growth else 0.0,
        node_id=node_id,
        conversations_complete=delta is None,
        seq=delta[0] if delta else 0,
        dropped=delta[1] if delta else (),
    )
