"""Routing policies as pure functions: which decoder serves a turn, and whether the turn's
prompt is prefilled on the prefill pool (then its KV moves to the decoder over NIXL).

| policy        | first turn                               | later turns                          |
|---------------|------------------------------------------|--------------------------------------|
| conversation  | prefill pool -> KV once -> chosen decoder | pinned decoder, prefilled locally    |
| per_turn_pd   | prefill pool -> KV -> least-loaded decoder| same, every turn (Ray Serve LLM, Dynamo) |
| colocated     | chosen unified replica (pinned)           | pinned replica                       |
| round_robin   | next unified replica                      | next unified replica                 |

Choosing a decoder for a new conversation uses observations only (no predictor of future turns):
the first turn's prompt length, each decoder's current KV occupancy and the conversations
already pinned to it. score = occupancy after admitting this prompt + pin_weight * pinned
conversations + queue_weight * requests in flight; the lowest score wins. Occupancy is what
fills up and forces preemption; pinned conversations are load the decoder has already accepted
(each will come back with more turns); requests in flight break ties within a burst.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["conversation", "per_turn_pd", "colocated", "round_robin"]
DISAGGREGATED: frozenset[str] = frozenset({"conversation", "per_turn_pd"})


@dataclass(frozen=True)
class DecoderView:
    """A live decode (or unified) replica as the directory observes it."""

    replica_id: str
    kv_usage: float  # fraction of the KV pool in use
    kv_capacity_tokens: int  # tokens the KV pool holds (0 = unknown)
    in_flight: int
    pinned: int  # conversations currently pinned to it


@dataclass(frozen=True)
class PlacementWeights:
    pin_weight: float = 0.02
    queue_weight: float = 0.05


@dataclass(frozen=True)
class TurnPlan:
    """How one turn is served."""

    decode_replica: str
    remote_prefill: bool  # prefill on the prefill pool and move the KV to decode_replica
    reason: Literal["pinned", "new", "repinned", "per_turn", "round_robin"]
    turn_index: int = field(default=0, compare=False)  # 0 for a conversation's first turn (set by the directory)


class NoReplicaAvailable(RuntimeError):
    """No live decode replica: the turn cannot be placed now (503)."""


def decoder_score(d: DecoderView, prompt_tokens: int, w: PlacementWeights) -> float:
    projected = d.kv_usage + (prompt_tokens / d.kv_capacity_tokens if d.kv_capacity_tokens else 0.0)
    return projected + w.pin_weight * d.pinned + w.queue_weight * d.in_flight


def choose_decoder(decoders: list[DecoderView], prompt_tokens: int, w: PlacementWeights) -> str:
    if not decoders:
        raise NoReplicaAvailable("no live decode replica")
    return min(decoders, key=lambda d: (decoder_score(d, prompt_tokens, w), d.replica_id)).replica_id


def plan_turn(
    policy: Policy,
    *,
    pinned: str | None,
    decoders: list[DecoderView],
    prompt_tokens: int,
    prefill_available: bool,
    rr_counter: int,
    w: PlacementWeights,
) -> TurnPlan:
    """Pure: the plan for one turn. `pinned` is the conversation's current decoder (None if new
    or unknown); `decoders` are the live decode replicas; `rr_counter` counts round-robin turns."""
    if not decoders:
        raise NoReplicaAvailable("no live decode replica")
    live = {d.replica_id for d in decoders}
    if policy == "round_robin":
        ordered = sorted(live)
        return TurnPlan(ordered[rr_counter % len(ordered)], remote_prefill=False, reason="round_robin")
    if policy == "per_turn_pd":
        return TurnPlan(choose_decoder(decoders, prompt_tokens, w), remote_prefill=prefill_available, reason="per_turn")
    if pinned is not None and pinned in live:
        return TurnPlan(pinned, remote_prefill=False, reason="pinned")
    reason: Literal["new", "repinned"] = "repinned" if pinned is not None else "new"
    remote = policy == "conversation" and prefill_available
    return TurnPlan(choose_decoder(decoders, prompt_tokens, w), remote_prefill=remote, reason=reason)
