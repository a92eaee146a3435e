"""The engine of one pool, as the user writes it (`<pool>.engine` in the YAML): vLLM's engine
arguments, or (`kind: simulated`) a stand-in engine timed by AIConfigurator.

Turned into an EngineSpec in exactly one place: baton/engine/args.py. The engine layer owns this
config, so it imports nothing from deployments/.

A simulated engine keeps `model` (the HF folder the API layer tokenizes with), `tokenizer`,
`max_model_len`, `enable_prefix_caching`, `block_size`, `max_num_seqs`, `max_num_batched_tokens`
and `seed`: they mean what they mean to vLLM's scheduler. The fields that only build a vLLM engine
(VLLM_ONLY_FIELDS) are refused when written with `kind: simulated`, so nothing written is silently
ignored; their defaults are ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.simulated.config import SimulatedEngineConfig

EngineKind = Literal["vllm", "simulated"]
VLLM_ONLY_FIELDS = ("dtype", "enforce_eager", "kv_cache_gib", "gpu_memory_utilization", "cpu_threads", "cpu_threads_bind",
                    "segment_async_load_min_tokens", "extra_engine_args", "checkpoints")


class EngineConfig(BaseModel):
    """The engine of one pool; unknown fields fail by name (extra="forbid")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: EngineKind = Field("vllm", description="vllm: a real vLLM engine | simulated: a stand-in timed by AIConfigurator")
    simulated: SimulatedEngineConfig | None = Field(None, description="kind simulated only: the GPU, model and KV pool it simulates")

    model: str = Field(..., description="path of an HF model folder, or a name under the model cache")
    tokenizer: str | None = None
    max_model_len: int = Field(4096, ge=16)
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = Field("auto", description=(
        "auto: the model's own dtype on a GPU; on a CPU bfloat16 where the CPU computes it natively "
        "(AVX-512 BF16 or AMX), else float32 (resolved on the replica's host)"))
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
    segment_async_load_min_tokens: int | None = Field(
        1024, ge=0, description="an injected memory/window KV of at least this many tokens is written on a loader thread "
        "while the engine steps other requests (shorter ones on the engine thread, where writing costs less than the "
        "step the request would wait); null: all on the engine thread; 0: all on the loader thread")
    extra_engine_args: dict[str, Any] = Field(default_factory=dict, description="passed to EngineArgs unchanged")
    step_trace_dir: str | None = Field(
        None, description="write every engine step's wall time and batch shape as JSON lines, one file per engine, under "
        "this folder, a relative one taken from the project root (baton/engine/step_trace.py: what calibrates the fleet "
        "simulator); null: off")
    checkpoints: CheckpointConfig | None = Field(
        None, description="hybrid models only: recurrent-state checkpoints at planned positions (baton/engine/checkpoints/)"
    )

    @model_validator(mode="after")
    def _kind_fits_fields(self) -> EngineConfig:
        if self.kind == "vllm":
            if self.simulated is not None:
                raise ValueError("engine.simulated is for kind: simulated (this engine is kind: vllm)")
            return self
        if self.simulated is None:
            raise ValueError("kind: simulated needs engine.simulated (gpu, model, and kv_capacity_tokens or kv_cache_gib)")
        written = sorted(set(VLLM_ONLY_FIELDS) & self.model_fields_set)
        if written:
            raise ValueError(f"{', '.join(written)}: vLLM-only, meaningless for kind: simulated (the KV pool size is "
                             f"engine.simulated.kv_capacity_tokens or kv_cache_gib)")
        return self
