"""How an engine replica describes itself to the router: its engine's stats and this process's
KV-transfer totals become one router.report.ReplicaReport (pure; deployments/pool.py sends it)."""
from __future__ import annotations

from collections.abc import Mapping

from baton.engine.types import EngineStats
from kv_transfer.ledger import TransferTotals
from router.report import ReplicaReport


def replica_report(replica_id: str, pool: str, stats: EngineStats, transfers: TransferTotals,
                   extra: Mapping[str, float] | None = None) -> ReplicaReport:
    """The report of one replica; `extra`: display-only figures (checkpoint, segment counters)."""
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
    )
