"""User-facing settings of sparse recurrent checkpoints (the `checkpoints` field of a pool's engine)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Strategy = Literal["dp", "none", "block_dense", "uniform", "balanced", "sqrt", "dyadic"]


class CheckpointConfig(BaseModel):
    """Where a hybrid model's engine keeps recurrent-state checkpoints (per prefix family).

    Only meaningful for hybrid (Mamba/conv/GDN + attention) models with prefix caching on; the
    engine then runs Baton's scheduler subclass (baton/engine/checkpoints/scheduler.py).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Strategy = Field("dp", description="dp: exact DP over observed match depths; the rest are baselines")
    budget: int = Field(8, ge=0, description="checkpoints per prefix family (ignored by none and block_dense)")
    interval: int | None = Field(None, ge=1, description="uniform only: one checkpoint every this many tokens (block multiple)")
    half_life_s: float = Field(600.0, gt=0, description="exponential decay of the match-depth histogram")
    freeze_share: float = Field(0.2, gt=0, le=1, description="a depth holding this share of the mass becomes a frozen mode")
    freeze_min_weight: float = Field(8.0, ge=0, description="... once it has at least this many observations' weight")
    resolve_every: int = Field(1, ge=1, description="re-solve a family's plan after this many new observations (a solve takes ~ms)")
    continuation: bool = Field(True, description="plan for the family's next request continuing from this one's replay boundary, "
                               "with the continuation rate observed so far (a conversation's next turn extends its prompt)")
    fill_spare: bool = Field(True, description="dp only: budget the DP leaves unused goes to the widest gaps (covers depths not seen yet)")
    max_families: int = Field(1024, ge=1, description="prefix families tracked (least recently seen dropped)")

    @model_validator(mode="after")
    def _interval_only_for_uniform(self) -> CheckpointConfig:
        if self.interval is not None and self.strategy != "uniform":
            raise ValueError("interval is only used by strategy 'uniform'")
        return self
