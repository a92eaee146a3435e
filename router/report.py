"""What an engine replica reports about itself, every routing-stats period: one typed value from
the replica (deployments/pool.py builds it from its engine's stats) to the conversation directory
(router/directory.py), which stores it and places turns on its figures.

The same figures, flattened (`figures()`), are what the replica returns to Serve's
`record_routing_stats` (read by router/serve_router.py) and what the directory's snapshot shows
per replica (/baton/stats).

The token figures (`retained_tokens`, `offered_growth_tokens_per_s`, `served_growth_tokens_per_s`)
are what the cliff predictor (router/cliff.py) reads: the real-time sessions' KV in the pool and
how fast it grows (baton/engine/realtime/growth.py).

`conversations` is how a restarted directory gets its pins back: the conversations whose KV the
replica holds (it served a turn of them lately), with how long each has been idle there. A
decoder sends the whole list only when a directory asks for it; every other report is a delta
(`conversations_complete=False`): the conversations it served and those it dropped since its
previous report, numbered by `seq` (router/held_mirror.py keeps the directory's copy)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from router.cliff import DecoderTokens

POOLS = ("prefill", "decode")
MAX_REPORTED_CONVERSATIONS = 4096  # the most recent conversations one report lists
_NOT_FIGURES = frozenset({"replica_id", "pool", "extra", "conversations", "node_id", "conversations_complete", "dropped", "seq"})
_COUNTS = ("kv_capacity_tokens", "num_running", "num_waiting", "pending_prefill_tokens", "in_flight",
           "kv_transfers_received", "kv_bytes_received", "kv_transfer_failures", "kv_transfers_offered", "retained_tokens")
_RATES = ("offered_growth_tokens_per_s", "served_growth_tokens_per_s")


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's load and transfer counters at one moment.

    extra: display-only figures (name, value) such as checkpoint or segment counters; shown in the
    snapshot, never used for placement. Invariants (checked at construction): a known pool,
    no negative fraction or count, finite token rates, extra names distinct and not shadowing a field.

    conversations: (session id, seconds since this replica last served a turn of it), most
    recent first, at most MAX_REPORTED_CONVERSATIONS, ids non-empty and distinct, idle >= 0.
    Not a figure: used by the directory to rebuild pins (DirectoryState.report)."""

    replica_id: str
    pool: str  # one of POOLS
    kv_usage: float = 0.0  # fraction of the KV pool in use
    kv_resident: float = 0.0  # fraction holding KV: in use, or cached for reuse
    kv_capacity_tokens: int = 0  # tokens the KV pool holds (0 = unknown)
    num_running: int = 0
    num_waiting: int = 0
    pending_prefill_tokens: int = 0  # prompt tokens not yet computed, over running + waiting
    in_flight: int = 0  # requests the replica is serving
    kv_transfers_received: int = 0  # KV handoffs this replica pulled (its connector's count)
    kv_bytes_received: int = 0
    kv_transfer_failures: int = 0
    kv_transfers_offered: int = 0  # KV handoffs this replica produced for a decoder
    retained_tokens: int = 0  # KV tokens its real-time sessions hold in the pool now (ticks in flight included)
    offered_growth_tokens_per_s: float = 0.0  # how fast those sessions append tokens (their tick periods)
    served_growth_tokens_per_s: float = 0.0  # how fast the engine really got through their ticks
    extra: tuple[tuple[str, float], ...] = ()
    conversations: tuple[tuple[str, float], ...] = ()
    node_id: str = ""  # the Ray node the replica runs on ("" = unknown); shown, not a figure
    # True: `conversations` is everything the replica holds; False: a delta, what it served since
    # its report seq - 1, with `dropped` the conversations it no longer holds since then
    conversations_complete: bool = True
    dropped: tuple[str, ...] = ()
    seq: int = 0  # the replica's report number (1, 2, ...; 0: unnumbered, always complete)

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"unknown pool {self.pool!r} in the report of {self.replica_id}")
        negative = [name for name in ("kv_usage", "kv_resident", *_COUNTS, *_RATES) if not getattr(self, name) >= 0]
        if negative or not all(math.isfinite(getattr(self, name)) for name in _RATES):
            raise ValueError(f"negative (or non-finite) figures {negative or list(_RATES)} in the report of {self.replica_id}")
        names = [name for name, _ in self.extra]
        own = {f.name for f in fields(self)}
        if len(set(names)) != len(names) or own & set(names):
            raise ValueError(f"extra figures repeat a name: {sorted(names)}")
        held = [sid for sid, _ in self.conversations]
        if len(held) > MAX_REPORTED_CONVERSATIONS:
            raise ValueError(f"{len(held)} conversations in the report of {self.replica_id} (at most {MAX_REPORTED_CONVERSATIONS})")
        if len(set(held)) != len(held) or not all(held) or any(idle < 0 for _, idle in self.conversations):
            raise ValueError(f"conversations in the report of {self.replica_id} must be distinct non-empty ids with idle >= 0")
        if self.seq < 0 or (not self.conversations_complete and self.seq == 0):
            raise ValueError(f"report of {self.replica_id}: seq must be >= 0, and > 0 for a delta")
        if self.dropped and (self.conversations_complete or len(set(self.dropped)) != len(self.dropped) or not all(self.dropped)
                             or set(self.dropped) & set(held)):
            raise ValueError(f"dropped conversations in the report of {self.replica_id} must be distinct non-empty ids, "
                             "not listed as held, and only in a delta")

    def decoder_tokens(self) -> DecoderTokens:
        """The token figures the cliff predictor reads (router/cliff.py)."""
        return DecoderTokens(self.kv_capacity_tokens, self.retained_tokens, self.offered_growth_tokens_per_s,
                             self.served_growth_tokens_per_s)

    def figures(self) -> dict[str, Any]:
        """The flat figures: every field but replica_id, pool, node_id, extra and conversations, then the extra figures."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_FIGURES}
        return {**flat, **dict(self.extra)}
