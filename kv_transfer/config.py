"""Which KV connector an engine gets, by the role its pool plays.

This is the only place that decides `kv_transfer_config`; engine/args.py calls it while building
EngineArgs, so adding a handoff or an injection connector changes this file, not the engines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

PoolRole = Literal["prefill", "decode"]
RoutingPolicy = Literal["colocated", "conversation", "per_turn_pd", "round_robin"]


@dataclass(frozen=True)
class KVTransferPlan:
    """What connector (if any) an engine of a pool runs, in which role, with its buffer where."""

    connector: str | None
    role: str | None
    buffer_device: str


def kv_transfer_plan(role: PoolRole, policy: RoutingPolicy, on_gpu: bool) -> KVTransferPlan:
    """Pure: the connector for an engine of `role` under `policy`.

    colocated / round_robin: every replica serves whole requests, no KV moves between engines.
    conversation / per_turn_pd: prefill engines produce KV, decode engines consume it (NIXL).
    """
    device = "cuda" if on_gpu else "cpu"
    if policy in ("colocated", "round_robin"):
        return KVTransferPlan(connector=None, role=None, buffer_device=device)
    kv_role = "kv_producer" if role == "prefill" else "kv_both"
    return KVTransferPlan(connector="NixlConnector", role=kv_role, buffer_device=device)


def kv_transfer_engine_arg(role: PoolRole, policy: RoutingPolicy, on_gpu: bool) -> dict[str, Any] | None:
    """The `kv_transfer_config` engine argument: vLLM's NIXL connector wrapped by Baton's counting
    subclass (kv_transfer/nixl.py), so every transfer is counted by the connector itself."""
    plan = kv_transfer_plan(role, policy, on_gpu)
    if plan.connector is None:
        return None
    from kv_transfer.nixl import nixl_kv_transfer_config

    return nixl_kv_transfer_config(plan.role or "kv_both", plan.buffer_device)
