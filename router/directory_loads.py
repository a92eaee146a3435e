"""What the conversation directory places on: each live replica's load as its last report showed
it, plus the turns the directory sent it since (the report does not show them yet). Pure.

Decoders: KV occupancy (+ the unreported prompts), requests in flight, conversations pinned,
and the KV their contexts hold (`kv_held`: the pins' last prompts, at most what the engine
reports resident — KV in use or cached; evicted KV is not held). Prefill replicas: prompt
tokens queued or being prefilled (+ the prompts sent since), requests in flight."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

from router.report import ReplicaReport
from router.scoring import ReplicaLoad

Unreported = Mapping[str, tuple[int, int]]  # replica -> (turns, prompt tokens) sent since its report


class PinView(Protocol):
    decoder: str
    prompt_tokens: int


def pin_sums(pins: Iterable[PinView]) -> tuple[Counter[str], Counter[str]]:
    """(pins per decoder, their prompt tokens per decoder), counted (router/pin_table.py keeps them as pins change)."""
    pinned: Counter[str] = Counter()
    held: Counter[str] = Counter()
    for p in pins:
        pinned[p.decoder] += 1
        held[p.decoder] += p.prompt_tokens
    return pinned, held


def decoder_loads(reports: Iterable[ReplicaReport], unreported: Unreported, pinned: Mapping[str, int],
                  held: Mapping[str, int]) -> list[ReplicaLoad]:
    """The decoders' loads; `pinned` / `held`: the conversations that count as committed load per
    decoder, and the prompt tokens they hold there (empty under per-turn policies; pin_sums)."""
    loads = []
    for r in reports:
        capacity = r.kv_capacity_tokens
        turns, tokens = unreported.get(r.replica_id, (0, 0))
        sent = tokens / capacity if capacity else 0.0
        kept = held.get(r.replica_id, 0) / capacity if capacity else 0.0
        kept = min(kept, r.kv_resident) if r.kv_resident > 0 else kept
        loads.append(ReplicaLoad(replica_id=r.replica_id, kv_usage=r.kv_usage + sent, kv_capacity_tokens=capacity,
                                 in_flight=r.in_flight + turns, pinned=pinned.get(r.replica_id, 0), kv_held=kept + sent))
    return loads


def prefill_loads(reports: Iterable[ReplicaReport], unreported: Unreported) -> list[ReplicaLoad]:
    """The prefill replicas' queues (router/placement.choose_prefill reads them)."""
    loads = []
    for r in reports:
        turns, tokens = unreported.get(r.replica_id, (0, 0))
        loads.append(ReplicaLoad(replica_id=r.replica_id, pending_prefill_tokens=r.pending_prefill_tokens + tokens,
                                 in_flight=r.in_flight + turns))
    return loads
