"""The conversation directory split by conversation: which shard owns a session id, and one view
of the shards' snapshots. Pure functions; the handles live in deployments/directory_client.py.

Why shards: the directory is one Serve replica that handles one call at a time, and every
first turn, pin-cache sync, replica report and ownership claim goes through it — the one
serial piece of the control plane (measured by `baton bench control`: its CPU per routing
decision caps the decisions per second a single directory can take, whatever the number of
ingress and engine replicas). With `routing.directory_shards: K`, K directory replicas each
own the conversations whose session ids hash to them; an ingress asks a conversation's shard
only, engine replicas report to every shard (each places new conversations from the same
reported loads), and a replica failure is told to every shard.

The hash: a 64-bit BLAKE2b digest of the session id, mapped to a shard by jump consistent
hashing (Lamping and Veach, "A Fast, Minimal Memory, Consistent Hash Algorithm", 2014):
stable across processes and Python versions (no PYTHONHASHSEED), and growing K to K + 1 moves
only ~1/(K + 1) of the conversations (to the new shard). A moved conversation's pin is lost
(its next turn is placed anew and its decoder recomputes what it lacks); its owner is not:
every shard claims owners in the same SQLite file (router/ownership.py), so a session id keeps
its owner across any change of K.

Turns without a session id (no owner to check, no pin) go to shard 0.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

MAX_SHARDS = 64
_MULT = 2862933555777941757  # the 64-bit linear congruential step of the jump hash
_MASK = (1 << 64) - 1


def jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hash of a 64-bit key into [0, buckets)."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * _MULT + 1) & _MASK
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


def session_key(session_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little")


def shard_of(session_id: str | None, shards: int) -> int:
    """The shard that owns `session_id` among `shards` (0 for a turn without one)."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be in [1, {MAX_SHARDS}], got {shards}")
    if shards == 1 or not session_id:
        return 0
    return jump_hash(session_key(session_id), shards)


def deployment_name(shard: int, shards: int) -> str:
    """The Serve deployment of one shard: `directory` when there is one (as before shards
    existed), `directory-<i>` otherwise."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range for {shards} shards")
    return "directory" if shards == 1 else f"directory-{shard}"


_SUMMED = ("live_pins", "conversations_total", "handoffs_planned_total", "prefill_fallback_local_total",
           "placed_without_kv_room_total", "turns_total", "owners_cached")


def merge_snapshots(snaps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One directory snapshot (router/directory_state.DirectoryState.snapshot) from every shard's:
    counts and totals summed; handoffs per live conversation weighted by each shard's pins; a
    replica as the shard that heard from it last sees it (`age_s` smallest), with its `pinned`
    summed over the shards. `directory_shards` is K; `shards` (K > 1) each shard's own counts."""
    if not snaps:
        raise ValueError("no shard snapshots to merge")
    if len(snaps) == 1:
        return {**snaps[0], "directory_shards": 1}
    out: dict[str, Any] = {"policy": snaps[0].get("policy")}
    for key in _SUMMED:
        out[key] = sum(s.get(key, 0) for s in snaps)
    pins = out["live_pins"]
    out["handoffs_per_live_conversation"] = (
        sum(s.get("handoffs_per_live_conversation", 0.0) * s.get("live_pins", 0) for s in snaps) / pins if pins else 0.0)
    totals: dict[str, Any] = {}
    for s in snaps:
        for k, v in s.get("totals", {}).items():
            totals[k] = totals.get(k, 0) + v
    out["totals"] = totals
    replicas: dict[str, dict[str, Any]] = {}
    for s in snaps:
        for rid, r in s.get("replicas", {}).items():
            seen = replicas.get(rid)
            if seen is None:
                replicas[rid] = dict(r)
                continue
            pinned = seen.get("pinned", 0) + r.get("pinned", 0)
            if r.get("age_s", float("inf")) < seen.get("age_s", float("inf")):
                replicas[rid] = dict(r)
            replicas[rid]["pinned"] = pinned
    out["replicas"] = replicas
    out["directory_shards"] = len(snaps)
    out["shards"] = [{"shard": i, **{k: s.get(k, 0) for k in ("live_pins", "conversations_total", "turns_total")}}
                     for i, s in enumerate(snaps)]
    return out
