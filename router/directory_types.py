"""The conversation directory's settings and records (router/directory_state.py keeps them)."""
from __future__ import annotations

from dataclasses import dataclass, field

from router.policy import DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS, Policy
from router.report import ReplicaReport
from router.scoring import LoadWeights


@dataclass(frozen=True)
class Reported:
    """A replica's latest report and when the directory received it."""

    report: ReplicaReport
    at: float


@dataclass(slots=True)  # no __dict__: one object per pin for the garbage collector to walk, not two
class Pin:
    decoder: str
    user: str | None
    created: float
    last_seen: float
    turns: int = 1
    handoffs: int = 0
    adopted: bool = False  # rebuilt from a decoder's report; no turn placed by this directory yet
    prompt_tokens: int = 0  # the last turn's prompt: the context whose KV the decoder was asked to hold


@dataclass(frozen=True)
class DirectorySettings:
    policy: Policy = "colocated"
    conversation_ttl_s: float = 1800.0
    stale_after_s: float = 10.0  # a replica silent this long is not live
    weights: LoadWeights = field(default_factory=LoadWeights)
    max_conversations: int = 1_000_000
    # after a (re)start, how long an existing conversation without a pin waits for the decoders'
    # reports to restore it (about two report periods); 0 places it at once
    rebuild_grace_s: float = 0.0
    # conditional_pd: prefill remotely only when the uncached suffix is longer (router/policy.py)
    conditional_pd_threshold_tokens: int = DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS
    # every prefill replica has more prompt tokens queued than this while the decoder is idle:
    # the decoder prefills the turn itself (totals["prefill_fallback_local"])
    prefill_queue_limit_tokens: int = 16384
    # this directory is shard `shard` of `shards` (router/directory_shards.py): it adopts from the
    # decoders' reports only the conversations whose session ids hash to it
    shard: int = 0
    shards: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"directory shard {self.shard} out of range for {self.shards} shards")
