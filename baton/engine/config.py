"""vLLM engine arguments of one pool, as the user writes them (`<pool>.engine` in the YAML).

Turned into `EngineArgs` in exactly one place: baton/engine/args.py. The engine layer owns this
config, so it imports nothing from deployments/.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.engine.checkpoints.config import CheckpointConfig


class EngineConfig(BaseModel):
    """vLLM engine arguments of one pool; unknown fields fail by name (extra="forbid")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(..., description="path of an HF model folder, or a name under the model cache")
    tokenizer: str | None = None
    max_model_len: int = Field(4096, ge=16)
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    kv_cache_gib: float = Field(1.0, gt=0, description="KV pool size (VLLM_CPU_KVCACHE_SPACE on CPU)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1.0, description="GPU only")
    block_size: int | None = Field(None, ge=1, description="KV block size; None = the platform's default (128 on CPU)")
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    seed: int = 0
    cpu_threads: int = Field(1, ge=1, description="torch/OMP threads of an in-process CPU engine")
    cpu_threads_bind: str = Field("nobind", description="VLLM_CPU_OMP_THREADS_BIND: 'nobind', 'auto' or core ids")
    extra_engine_args: dict[str, Any] = Field(default_factory=dict, description="passed to EngineArgs unchanged")
    checkpoints: CheckpointConfig | None = Field(
        None, description="hybrid models only: recurrent-state checkpoints at planned positions (baton/engine/checkpoints/)"
    )
