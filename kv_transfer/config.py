"""Which KV connector an engine gets, by the role its pool plays and whether it takes part in a
KV handoff between engines (the routing layer decides that; this module knows no routing policy).

This is the only place that decides `kv_transfer_config`; baton/engine/args.py calls it while building
EngineArgs, so adding a handoff or an injection connector changes this file, not the engines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

PoolRole = Literal["prefill", "decode"]


@dataclass(frozen=True)
class KVTransferPlan:
    """What connector (if any) an engine of a pool runs, in which role, with its buffer where."""

    connector: str | None
    role: str | None
    buffer_device: str


def kv_transfer_plan(role: PoolRole, *, handoff: bool, on_gpu: bool) -> KVTransferPlan:
    """Pure: the connector for an engine of `role`.

    handoff False: every replica serves whole requests, no KV moves between engines.
    handoff True: prefill engines produce KV, decode engines consume it (NIXL).
    """
    device = "cuda" if on_gpu else "cpu"
    if not handoff:
        return KVTransferPlan(connector=None, role=None, buffer_device=device)
    kv_role = "kv_producer" if role == "prefill" else "kv_both"
    return KVTransferPlan(connector="NixlConnector", role=kv_role, buffer_device=device)


# Connectors (by kv_connector name) that declare vLLM's SupportsHMA, so an engine running them keeps
# the hybrid KV cache manager a hybrid (Mamba/conv/GDN) model needs. A mirror of vLLM's own check
# (KVConnectorFactory.supports_hma_config; MultiConnector: every child), kept here so config
# validation needs no vLLM import; tests/unit/test_hma_connectors.py holds it equal to vLLM's answer.
HMA_CONNECTORS = frozenset({"CountingNixlConnector", "NixlConnector", "SegmentConnector"})

# The engine environment a NIXL handoff needs. vLLM's NIXL worker moves a hybrid model's conv state
# only in the "DS" (dim, state_len) layout (nixl/base_worker.py asserts it); vLLM's CPU platform picks
# DS by itself only for a connector *named* NixlConnector, and no platform does on GPUs. It changes
# nothing for a model without conv state.
NIXL_ENGINE_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}


def stack_supports_hma(kv_transfer: dict[str, Any] | None) -> bool:
    """Pure: whether the `kv_transfer_config` dict keeps vLLM's hybrid KV cache manager on (no
    connector: nothing turns it off)."""
    if kv_transfer is None:
        return True
    if kv_transfer.get("kv_connector") == "MultiConnector":
        children = (kv_transfer.get("kv_connector_extra_config") or {}).get("connectors") or []
        return bool(children) and all(stack_supports_hma(c) for c in children)
    return kv_transfer.get("kv_connector") in HMA_CONNECTORS


def kv_transfer_engine_env(role: PoolRole, *, handoff: bool, on_gpu: bool) -> dict[str, str]:
    """Pure: environment variables the engine of `role` needs for its connector (set before the
    engine is built)."""
    return dict(NIXL_ENGINE_ENV) if kv_transfer_plan(role, handoff=handoff, on_gpu=on_gpu).connector else {}


SEGMENT_CONNECTOR = {
    "kv_connector": "SegmentConnector",
    "kv_connector_module_path": "kv_transfer.segment_connector",
    "kv_role": "kv_both",
}


def kv_transfer_engine_arg(role: PoolRole, *, handoff: bool, on_gpu: bool, segments: bool = False,
                           segment_async_min_tokens: int | None = None) -> dict[str, Any] | None:
    """The `kv_transfer_config` engine argument.

    Handoff: vLLM's NIXL connector wrapped by Baton's counting subclass (kv_transfer/nixl.py), so
    every transfer is counted by the connector itself. Segments (memory injection): Baton's
    SegmentConnector (kv_transfer/segment_connector.py). Both: vLLM's MultiConnector, NIXL first —
    a request that arrives with NIXL handoff params loads from NIXL, one that carries segments
    loads them (the first connector that reports tokens wins). segment_async_min_tokens: the segment
    connector writes an injection of at least this many tokens on its loader thread while the
    engine steps other requests (kv_transfer/segment_loader.py), shorter ones on the engine thread
    before the forward pass; None: all of them there."""
    plan = kv_transfer_plan(role, handoff=handoff, on_gpu=on_gpu)
    nixl = None
    if plan.connector is not None:
        from kv_transfer.nixl import nixl_kv_transfer_config

        nixl = nixl_kv_transfer_config(plan.role or "kv_both", plan.buffer_device)
    seg = {**SEGMENT_CONNECTOR, "kv_buffer_device": plan.buffer_device, "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"async_load_min_tokens": segment_async_min_tokens}} if segments else None
    if nixl and seg:
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": plan.buffer_device,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [nixl, seg]},
        }
    return nixl or seg
