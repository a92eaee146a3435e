"""The one load score of an engine replica, used wherever Baton picks a replica by load: the
directory choosing a decoder for a new conversation (router/policy.py) and the Serve request
router ranking replicas when a request has no target (router/placement.py).

    score = kv_weight * projected KV occupancy
          + pin_weight * conversations pinned to it
          + queue_weight * requests in flight
          + prefill_token_weight * prompt tokens queued or being prefilled
    projected KV occupancy = kv_usage + prompt_tokens / kv_capacity_tokens (0 when capacity unknown)

Lower is less loaded. A signal a call site does not observe is 0 in its ReplicaLoad (the Serve
router sees no pins; the directory sends no prompt to prefill replicas), so its term is exactly 0.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router can observe about one replica right now."""

    replica_id: str
    kv_usage: float = 0.0  # fraction of the KV pool in use (engine-reported)
    kv_capacity_tokens: int = 0  # tokens the KV pool holds (0 = unknown)
    in_flight: int = 0  # requests in flight (router/engine view, whichever is larger)
    pending_prefill_tokens: int = 0  # prompt tokens queued or being prefilled (engine-reported)
    pinned: int = 0  # conversations currently pinned to it (directory view)
    # fraction of the KV pool its pinned conversations' contexts hold (directory view, at most
    # the engine-reported kv_resident: KV in use or cached); what a new conversation cannot take
    kv_held: float = 0.0


@dataclass(frozen=True)
class LoadWeights:
    kv_weight: float = 1.0
    queue_weight: float = 0.05
    pin_weight: float = 0.02
    prefill_token_weight: float = 1.0 / 8192  # one full 8k-token prefill ~ one full KV pool


def projected_kv(load: ReplicaLoad, prompt_tokens: int = 0) -> float:
    """KV occupancy after admitting a prompt of `prompt_tokens` (kv_usage when capacity is unknown)."""
    return load.kv_usage + (prompt_tokens / load.kv_capacity_tokens if load.kv_capacity_tokens else 0.0)


def kv_fits(load: ReplicaLoad, prompt_tokens: int) -> bool:
    """The prompt's KV fits beside what the replica has in use or holds for its pinned
    conversations (always, when the capacity is unknown)."""
    if not load.kv_capacity_tokens:
        return True
    return max(load.kv_usage, load.kv_held) + prompt_tokens / load.kv_capacity_tokens <= 1.0


def load_score(load: ReplicaLoad, w: LoadWeights, prompt_tokens: int = 0) -> float:
    """Pure: the replica's load if it took a prompt of `prompt_tokens` (see the module docstring)."""
    return (
        w.kv_weight * projected_kv(load, prompt_tokens)
        + w.pin_weight * load.pinned
        + w.queue_weight * load.in_flight
        + w.prefill_token_weight * load.pending_prefill_tokens
    )
