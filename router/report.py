"""What an engine replica reports about itself, every routing-stats period: one typed value from
the replica (deployments/pool.py builds it from its engine's stats) to the conversation directory
(router/directory.py), which stores it and places turns on its figures.

The same figures, flattened (`figures()`), are what the replica returns to Serve's
`record_routing_stats` (read by router/serve_router.py) and what the directory's snapshot shows
per replica (/baton/stats)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

POOLS = ("prefill", "decode")
_COUNTS = ("kv_capacity_tokens", "num_running", "num_waiting", "pending_prefill_tokens", "in_flight",
           "kv_transfers_received", "kv_bytes_received", "kv_transfer_failures", "kv_transfers_offered")


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's load and transfer counters at one moment.

    extra: display-only figures (name, value) such as checkpoint or segment counters; shown in the
    snapshot, never used for placement. Invariants (checked at construction): a known pool,
    no negative fraction or count, extra names distinct and not shadowing a field."""

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
    extra: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"unknown pool {self.pool!r} in the report of {self.replica_id}")
        negative = [name for name in ("kv_usage", "kv_resident", *_COUNTS) if getattr(self, name) < 0]
        if negative:
            raise ValueError(f"negative figures {negative} in the report of {self.replica_id}")
        names = [name for name, _ in self.extra]
        own = {f.name for f in fields(self)}
        if len(set(names)) != len(names) or own & set(names):
            raise ValueError(f"extra figures repeat a name: {sorted(names)}")

    def figures(self) -> dict[str, Any]:
        """The flat figures: every field but replica_id, pool and extra, then the extra figures."""
        flat = asdict(self)
        for key in ("replica_id", "pool", "extra"):
            del flat[key]
        return {**flat, **dict(self.extra)}
