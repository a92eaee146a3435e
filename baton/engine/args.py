"""The one place where a pool's config becomes an EngineSpec: vLLM engine arguments (including
kv_transfer_config), or a simulated engine's settings (`engine.kind: simulated`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.config import EngineConfig
from baton.engine.cpu_cores import CpuCores, core_slices
from baton.engine.simulated.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, SimulatedSpec
from baton.engine.simulated.step_table_cache import table_dir
from kv_transfer.config import PoolRole, kv_transfer_engine_arg, kv_transfer_engine_env

GIB = 1 << 30


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to start one engine: EngineArgs kwargs plus the process environment it
    needs, or (simulated set, engine_kwargs empty) a simulated engine's settings.

    cpu: the pool's CPU cores (None: not pinned; always None on GPUs); cores: the ones this
    engine runs on, once chosen (`pinned_to`: at build time when the pool has one slice, else by
    the replica that claimed a slice, baton/engine/cpu_cores.py)."""

    engine_kwargs: dict[str, Any]
    env: dict[str, str]
    model_path: str
    simulated: SimulatedSpec | None = None
    cpu: CpuCores | None = None
    cores: tuple[int, ...] = ()
    step_trace: tuple[str, str] | None = None  # (folder, role): write a step trace (baton/engine/step_trace.py)
    on_gpu: bool = False

    def pinned_to(self, cores: tuple[int, ...]) -> EngineSpec:
        """This spec on `cores`: torch/OMP threads = cpu_threads when set, else one per core."""
        if self.cpu is None:
            raise ValueError("the pool has no cpu_cores")
        return replace(self, cores=tuple(cores), env={**self.env, "OMP_NUM_THREADS": str(self.cpu.threads_for(tuple(cores)))})


def engine_dtype(dtype: str, *, on_gpu: bool, cpu_bf16: bool) -> str:
    """Pure: the dtype an engine is built with. `auto` is the model's own on a GPU; on a CPU it is
    bfloat16 where the CPU computes bf16 natively (`cpu_bf16`: AVX-512 BF16 or AMX on x86) and
    float32 elsewhere: on an AVX2-only x86 CPU vLLM emulates bf16 (SmolLM2's prefill measured 3.9x
    slower than float32 there; decode about the same). Any other value is kept."""
    if dtype != "auto" or on_gpu:
        return dtype
    return "bfloat16" if cpu_bf16 else "float32"


def step_trace_of(cfg: EngineConfig, role: str) -> tuple[str, str] | None:
    """(folder, role) of the engine's step trace; None: off. The app resolves a relative folder
    against the project root before it gets here (deployments/app.engine_paths)."""
    return (cfg.step_trace_dir, role) if cfg.step_trace_dir else None


def resolve_model_path(model: str, model_cache: str) -> str:
    """A model is a folder path, or a name under the model cache. Raises FileNotFoundError with a hint."""
    for candidate in (model, os.path.join(model_cache, model)):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return os.path.abspath(candidate)
    raise FileNotFoundError(
        f"model {model!r} not found as a folder nor under the model cache {os.path.abspath(model_cache)!r}; "
        f"run `make setup` (scripts/setup.sh) to provision the local models"
    )


def checkpoint_engine_args(cfg: CheckpointConfig) -> dict[str, Any]:
    """EngineArgs for sparse checkpoints: the scheduler subclass, its config, and dense state
    allocation (retention None) so that the plan, not vLLM's interval, decides what is kept."""
    return {
        "scheduler_cls": "baton.engine.checkpoints.scheduler.CheckpointScheduler",
        "additional_config": {"baton_checkpoints": cfg.model_dump()},
        "prefix_cache_retention_interval": None,
    }


def build_engine_spec(
    cfg: EngineConfig,
    *,
    role: PoolRole,
    handoff: bool,
    model_path: str,
    on_gpu: bool,
    cache_root: str,
    segments: bool = False,
    cpu_cores: tuple[int, ...] | None = None,
    cores_per_replica: int | None = None,
) -> EngineSpec:
    """Pure: EngineArgs kwargs and environment for one engine of a pool. `handoff`: the engine
    takes part in a KV handoff between pools (decided by the caller from its routing policy).
    cpu_cores / cores_per_replica: the pool's resources.cpu_cores (ignored on GPUs)."""
    if cfg.kind == "simulated":
        return simulated_engine_spec(cfg, role=role, handoff=handoff, model_path=model_path, cache_root=cache_root)
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tokenizer": cfg.tokenizer or model_path,
        "max_model_len": cfg.max_model_len,
        "dtype": cfg.dtype,
        "enforce_eager": cfg.enforce_eager,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "max_num_seqs": cfg.max_num_seqs,
        "seed": cfg.seed,
        "disable_log_stats": True,
        "kv_cache_memory_bytes": int(cfg.kv_cache_gib * GIB),
    }
    if on_gpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    if cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.checkpoints is not None:  # sparse recurrent checkpoints: Baton's scheduler decides every kept state
        kwargs.update(checkpoint_engine_args(cfg.checkpoints))
    kv_transfer = kv_transfer_engine_arg(role, handoff=handoff, on_gpu=on_gpu, segments=segments,
                                         segment_async_min_tokens=cfg.segment_async_load_min_tokens)
    if kv_transfer is not None:
        kwargs["kv_transfer_config"] = kv_transfer
    clash = set(kwargs) & set(cfg.extra_engine_args)
    if clash:
        raise ValueError(f"extra_engine_args repeats fields Baton sets from the config: {sorted(clash)}")
    kwargs.update(cfg.extra_engine_args)

    env = {
        # in-process engine core: one process per replica, ~3x faster start on CPU
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": os.path.join(cache_root, "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.update(kv_transfer_engine_env(role, handoff=handoff, on_gpu=on_gpu))
    if not on_gpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind
        env["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
    trace = step_trace_of(cfg, role)
    spec = EngineSpec(engine_kwargs=kwargs, env=env, model_path=model_path, step_trace=trace, on_gpu=on_gpu)
    if on_gpu or not cpu_cores:
        return spec
    # cpu_threads counts only when the user wrote it; otherwise one torch thread per core
    threads = cfg.cpu_threads if "cpu_threads" in cfg.model_fields_set else None
    cpu = CpuCores(core_slices(tuple(cpu_cores), cores_per_replica), threads)
    spec = replace(spec, cpu=cpu)
    return spec.pinned_to(cpu.slices[0]) if len(cpu.slices) == 1 else spec


def simulated_engine_spec(cfg: EngineConfig, *, role: PoolRole, handoff: bool, model_path: str, cache_root: str) -> EngineSpec:
    """Pure: a simulated engine's spec. No environment: it imports neither vLLM's engine nor NIXL."""
    assert cfg.simulated is not None  # EngineConfig's validator
    sim = SimulatedSpec(
        sim=cfg.simulated,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_model_len=cfg.max_model_len,
        block_size=cfg.block_size or DEFAULT_BLOCK_SIZE,
        enable_prefix_caching=cfg.enable_prefix_caching,
        role=role,
        handoff=handoff,
        step_table_dir=table_dir(cache_root),
    )
    trace = step_trace_of(cfg, role)
    return EngineSpec(engine_kwargs={}, env={}, model_path=model_path, simulated=sim, step_trace=trace)
