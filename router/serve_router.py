"""Ray Serve request router for engine pools.

Placement decisions that need shared state (which decoder holds a conversation) are made by the
conversation directory and arrive as `GenerationRequest.target_replica`; this router honours the
target when that replica is alive, and otherwise ranks replicas by engine-reported load (KV
occupancy, queued prefill tokens, requests in flight). Serve's default power-of-two router spread
bursts unevenly on this machine (16 requests 10/6 and 16/0 over two replicas)."""
from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from router.placement import rank_with_target
from router.scoring import LoadWeights, ReplicaLoad

logger = logging.getLogger("baton.router")


class TargetedLoadRouter(RequestRouter):
    def initialize_state(self, kv_weight: float = 1.0, queue_weight: float = 0.05, prefill_token_weight: float = 1.0 / 8192, **_: Any) -> None:
        self._weights = LoadWeights(kv_weight=kv_weight, queue_weight=queue_weight, prefill_token_weight=prefill_token_weight)

    def _load_of(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}  # ReplicaReport.figures() of the replica's last report
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return ReplicaLoad(
            replica_id=replica.replica_id.unique_id,
            kv_usage=float(stats.get("kv_usage", 0.0)),
            in_flight=max(int(stats.get("in_flight", 0)), cached or 0),
            pending_prefill_tokens=int(stats.get("pending_prefill_tokens", 0)),
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = None
        if pending_request is not None and pending_request.args:
            target = getattr(pending_request.args[0], "target_replica", None)
        ranks = rank_with_target(target, [self._load_of(r) for r in candidate_replicas], self._weights)
        if target is not None and ranks and ranks[0] != (target,):
            logger.warning("target replica %s is not available; placing by load", target)
        return [[by_id[i] for i in rank] for rank in ranks]
