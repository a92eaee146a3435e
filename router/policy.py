"""Routing policies as pure functions: which decoder serves a turn, and whether the turn's
prompt is prefilled on the prefill pool (then its KV moves to the decoder over NIXL).

| policy        | first turn                               | later turns                          |
|---------------|------------------------------------------|--------------------------------------|
| conversation  | prefill pool -> KV once -> chosen decoder | pinned decoder, prefilled locally    |
| per_turn_pd   | prefill pool -> KV -> least-loaded decoder| same, every turn (Ray Serve LLM, Dynamo) |
| conditional_pd| least-loaded decoder; prefill pool only if the prompt is long | pinned decoder; prefill pool only if the uncached suffix is long |
| colocated     | chosen unified replica (pinned)           | pinned replica                       |
| round_robin   | next unified replica                      | next unified replica                 |

Choosing a decoder for a new conversation uses observations only (no predictor of future turns):
the first turn's prompt length, each decoder's current KV occupancy and the conversations
already pinned to it, scored by router/scoring.py's load_score: kv_weight * occupancy after
admitting this prompt + pin_weight * pinned conversations + queue_weight * requests in flight;
the lowest score wins. Occupancy is what fills up and forces preemption; pinned conversations
are load the decoder has already accepted (each will come back with more turns); requests in
flight break ties within a burst.

conditional_pd is llm-d's P/D decider and Dynamo's conditional disaggregation: a turn is prefilled
remotely only when its uncached suffix (prompt tokens minus the tokens its decoder is known to
hold for the conversation: the last turn's prompt, as the directory recorded it) exceeds
`threshold_tokens`; a short suffix is cheaper to prefill where the KV already is.

A new conversation never goes to a decoder whose KV would overflow with its prompt while another
decoder fits it (`kv_fits`: max(occupancy, KV held by its pinned conversations) + the prompt,
router/scoring.py); when none fits it still goes to the least loaded, and the plan says so
(`kv_overflow`).

The policy names are defined here, once (`Policy`); the config and the directory use this type.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from router.scoring import LoadWeights, ReplicaLoad, kv_fits, load_score

Policy = Literal["conversation", "per_turn_pd", "conditional_pd", "colocated", "round_robin"]
DISAGGREGATED: frozenset[str] = frozenset({"conversation", "per_turn_pd", "conditional_pd"})
PINNING: frozenset[str] = frozenset({"conversation", "conditional_pd", "colocated"})  # a conversation keeps its decoder
DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS = 512


@dataclass(frozen=True)
class TurnPlan:
    """How one turn is served."""

    decode_replica: str
    remote_prefill: bool  # prefill on the prefill pool and move the KV to decode_replica
    reason: Literal["pinned", "new", "repinned", "per_turn", "round_robin"]
    turn_index: int = field(default=0, compare=False)  # 0 for a conversation's first turn (set by the directory)
    # every live decoder reported requests waiting in its engine queue (set by the directory; the
    # ingress's adaptive admission does not raise its limit then, router/chat_admission.py)
    pool_queueing: bool = field(default=False, compare=False)
    # requests the live engine replicas reported serving, plus the turns placed since their last
    # reports (set by the directory): the pools' concurrency, whichever ingress sent them
    pool_in_flight: int = field(default=0, compare=False)
    # seconds until decode_replica's KV pool is forecast full (router/cliff.py, set by the
    # directory); None: not filling, or not known. Real-time admission reads it (realtime.cliff)
    cliff_eta_s: float | None = field(default=None, compare=False)
    # the prefill replica for a remote prefill (set by the directory: least queued prefill tokens,
    # router/placement.py); None: the Serve router places it by load
    prefill_replica: str | None = field(default=None, compare=False)
    # a new conversation placed on a decoder its prompt overflows: no live decoder had room
    kv_overflow: bool = field(default=False, compare=False)
    # the directory that planned it and its latest pin change then (router/pin_log.py): where an
    # ingress's pin cache starts from (router/pin_cache.py); None: not from a directory
    incarnation: str | None = field(default=None, compare=False)
    pin_seq: int = field(default=0, compare=False)


class NoReplicaAvailable(RuntimeError):
    """No live decode replica: the turn cannot be placed now (503)."""


def choose_decoder(decoders: list[ReplicaLoad], prompt_tokens: int, w: LoadWeights) -> str:
    """The least-loaded decoder for a prompt of `prompt_tokens` (ties in replica-id order)."""
    return place_new(decoders, prompt_tokens, w)[0]


def place_new(decoders: list[ReplicaLoad], prompt_tokens: int, w: LoadWeights) -> tuple[str, bool]:
    """(decoder, fits): the least-loaded decoder among those whose KV fits the prompt; when none
    fits, the least loaded of all, and fits=False."""
    if not decoders:
        raise NoReplicaAvailable("no live decode replica")
    room = [d for d in decoders if kv_fits(d, prompt_tokens)]
    best = min(room or decoders, key=lambda d: (load_score(d, w, prompt_tokens), d.replica_id))
    return best.replica_id, bool(room)


def needs_remote_prefill(prompt_tokens: int, held_tokens: int, threshold_tokens: int) -> bool:
    """conditional_pd: prefill on the prefill pool only when the uncached suffix is long.

    [0, held)            KV the decoder holds for this conversation (its last turn's prompt)
    [held, prompt)       the uncached suffix: the new messages (the last reply, tool results, ...)
    """
    return prompt_tokens - min(held_tokens, prompt_tokens) > threshold_tokens


def plan_turn(
    policy: Policy,
    *,
    pinned: str | None,
    decoders: list[ReplicaLoad],
    prompt_tokens: int,
    prefill_available: bool,
    rr_counter: int,
    w: LoadWeights,
    held_tokens: int = 0,
    threshold_tokens: int = DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS,
) -> TurnPlan:
    """Pure: the plan for one turn. `pinned` is the conversation's current decoder (None if new
    or unknown); `decoders` are the live decode replicas; `rr_counter` counts round-robin turns;
    `held_tokens`: tokens the pinned decoder holds for the conversation (conditional_pd)."""
    if not decoders:
        raise NoReplicaAvailable("no live decode replica")
    live = {d.replica_id for d in decoders}
    if policy == "round_robin":
        ordered = sorted(live)
        return TurnPlan(ordered[rr_counter % len(ordered)], remote_prefill=False, reason="round_robin")
    if policy == "per_turn_pd":
        return TurnPlan(choose_decoder(decoders, prompt_tokens, w), remote_prefill=prefill_available, reason="per_turn")
    if pinned is not None and pinned in live:
        remote = policy == "conditional_pd" and prefill_available and needs_remote_prefill(prompt_tokens, held_tokens, threshold_tokens)
        return TurnPlan(pinned, remote_prefill=remote, reason="pinned")
    reason: Literal["new", "repinned"] = "repinned" if pinned is not None else "new"
    remote = prefill_available and (policy == "conversation" or (
        policy == "conditional_pd" and needs_remote_prefill(prompt_tokens, 0, threshold_tokens)))
    decoder, fits = place_new(decoders, prompt_tokens, w)
    return TurnPlan(decoder, remote_prefill=remote, reason=reason, kv_overflow=not fits)
