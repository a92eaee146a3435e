"""User-facing memory-store settings (the `memory` block of an application's args).

Pydantic with extra="forbid" (a misspelled field fails with its name) and frozen. Relative
`db_path` is relative to the repository root; the caller resolves it (`resolved_db_path`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MemoryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    db_path: str = Field(".cache/baton/memories.sqlite3",
                         description="SQLite file holding every user's facts; relative to the repo root.")
    embedder: Literal["all-MiniLM-L6-v2", "hashing"] = Field(
        "all-MiniLM-L6-v2", description="Sentence-embedding model for retrieval (hashing: model-free, tests).")
    default_k: int = Field(5, ge=1, description="Facts retrieved when a request asks for memories without k.")
    max_k: int = Field(100, ge=1, description="Largest k a request may ask for.")
    context_window: int = Field(2, ge=0, description=(
        "w: how many preceding facts of the same source are the context when a fact's KV is "
        "encoded (0 = the fact alone)."))
    recompute_tail_tokens: int = Field(0, ge=0, le=8192, description=(
        "Fidelity knob: the last facts of the memory block, the fewest holding at least this many "
        "tokens, are computed by the engine (attending to the injected facts before them) instead of "
        "injected as KV. Costs at most this many prefill tokens per request whatever k is; 0 = inject "
        "every fact. See README, Memories."))
    segment_capacity_mb: int = Field(256, ge=1, description=(
        "Byte budget of the memory store's encoded-KV segment cache (one arena of this size)."))
    user_segment_quota_mb: int | None = Field(None, ge=1, description=(
        "Most of the segment cache one user's fact segments may take; a user over it loses its own "
        "least recently used segments first, so one tenant cannot evict the others' (None = no quota; "
        "shared anchor segments never count)."))
    segment_transport: Literal["nixl", "ray"] = Field("nixl", description=(
        "How engine replicas get segments from the store: nixl (read from the store's registered "
        "arena by address; falls back to ray when NIXL cannot start) or ray (copies through Ray)."))
    store_gpus: float = Field(0.0, ge=0.0, le=1.0, description=(
        "GPUs given to the memory-store actor; > 0 puts its segment arena in GPU memory."))
    replica_cache_mb: int = Field(128, ge=1, description=(
        "Byte budget of each engine replica's own cache of encoded segments (in front of the store's)."))
    mode: Literal["kv", "prompt"] = Field("kv", description=(
        "kv: inject encoded KV segments; prompt: paste the facts as text (baseline)."))
    max_fact_chars: int = Field(2000, ge=1, description="Longest fact text accepted.")
    max_facts_per_request: int = Field(256, ge=1, description="Most facts one add/get/delete call may carry.")
    idempotency_ttl_h: float = Field(24.0, gt=0, description=(
        "How long an Idempotency-Key of POST /v1/memories is remembered (a retry within it adds nothing)."))

    @model_validator(mode="after")
    def _k_bounds(self) -> MemoryConfig:
        if self.default_k > self.max_k:
            raise ValueError(f"default_k ({self.default_k}) must not exceed max_k ({self.max_k})")
        return self

    @property
    def segment_capacity_bytes(self) -> int:
        return self.segment_capacity_mb * 1024 * 1024

    @property
    def user_segment_quota_bytes(self) -> int | None:
        return None if self.user_segment_quota_mb is None else self.user_segment_quota_mb * 1024 * 1024

    @property
    def replica_cache_bytes(self) -> int:
        return self.replica_cache_mb * 1024 * 1024

    def resolved_db_path(self, root: Path) -> Path:
        """`db_path` as an absolute path: relative paths are taken from `root` (the repo root)."""
        p = Path(self.db_path).expanduser()
        return p if p.is_absolute() else Path(root) / p
