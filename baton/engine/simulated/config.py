"""What a pool's simulated engine is (`<pool>.engine.simulated` in the YAML, with `engine.kind: simulated`).

Only what the simulator adds lives here: which GPU and model AIConfigurator times (and whether
through a cached step table or AIConfigurator itself), the KV pool's size, the link that carries
P/D handoffs, and a time scale. The scheduling limits a simulated
engine shares with vLLM (max_num_seqs, max_num_batched_tokens, block_size, enable_prefix_caching,
max_model_len) stay in EngineConfig, so a pool switches between the two kinds by `kind` alone.

Validation happens at load (the YAML is read by the Serve driver): the GPU must be one
AIConfigurator has measured vLLM data for, and the model one of its model configs; a missing
`aiconfigurator-core` fails here with the package's name, not later in an engine replica.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AIC_PACKAGE = "aiconfigurator-core"
AIC_MODULE = "aiconfigurator_core"

# AIConfigurator system names that ship measured vLLM data (systems/data/<gpu>/{gemm,attention}/vllm)
SimulatedGpu = Literal["h100_sxm", "h200_sxm", "a100_sxm", "l40s", "b200_sxm", "gb200"]


def aic_root() -> str:
    """The installed aiconfigurator_core package folder. Raises ImportError naming the package."""
    spec = importlib.util.find_spec(AIC_MODULE)
    if spec is None or spec.origin is None:
        raise ImportError(f"engine.kind simulated needs the PyPI package {AIC_PACKAGE} (pip install '{AIC_PACKAGE}==0.12.0'; "
                          f"`make setup` installs it from pyproject.toml)")
    return os.path.dirname(spec.origin)


def aic_model_config_path(model: str) -> str:
    """AIConfigurator's config file of `model` ("org/name", e.g. meta-llama/Meta-Llama-3.1-8B)."""
    return os.path.join(aic_root(), "model_configs", model.replace("/", "--") + "_config.json")


class SimulatedEngineConfig(BaseModel):
    """A stand-in engine timed by AIConfigurator's measured per-op vLLM data; unknown fields fail by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: SimulatedGpu = Field(..., description="AIConfigurator system whose measured vLLM kernels time each step")
    model: str = Field(..., min_length=3, description="AIConfigurator model name, e.g. meta-llama/Meta-Llama-3.1-8B "
                       "(the tokenizer still comes from engine.model)")
    tp: int = Field(1, ge=1, le=64, description="tensor-parallel size the step times are predicted for")
    kv_capacity_tokens: int | None = Field(None, ge=64, description="KV pool size in tokens (one of this or kv_cache_gib)")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV pool size per GPU in GiB, turned into tokens with the "
                                       "model's per-token KV bytes (bf16, its KV heads split over tp)")
    link_gbps: float = Field(400.0, gt=0, description="bandwidth of the link a P/D handoff's KV crosses, Gbit/s")
    time_scale: float = Field(1.0, gt=0, description="the engine sleeps predicted step and transfer times × this (0.1: ten times faster)")
    timer: Literal["table", "aiconfigurator"] = Field("table", description="table: step times interpolated from a table "
                                                      "sampled once from AIConfigurator and cached under .cache/baton/step-tables "
                                                      "(step_table.py); aiconfigurator: AIConfigurator in every replica")

    @model_validator(mode="after")
    def _known_to_aiconfigurator(self) -> SimulatedEngineConfig:
        if (self.kv_capacity_tokens is None) == (self.kv_cache_gib is None):
            raise ValueError("set exactly one of kv_capacity_tokens and kv_cache_gib")
        try:
            root = aic_root()
        except ImportError as e:  # a config error at load, naming the package
            raise ValueError(str(e)) from None
        if not os.path.isdir(os.path.join(root, "systems", "data", self.gpu, "gemm", "vllm")):
            raise ValueError(f"{AIC_PACKAGE} has no vLLM data for gpu {self.gpu!r}")
        if not os.path.isfile(aic_model_config_path(self.model)):
            known = sorted(f.removesuffix("_config.json").replace("--", "/") for f in os.listdir(os.path.join(root, "model_configs"))
                           if f.endswith("_config.json") and not f.endswith("_hf_quant_config.json"))
            raise ValueError(f"{AIC_PACKAGE} has no model {self.model!r}; known: {', '.join(known)}")
        return self


DEFAULT_BLOCK_SIZE = 16  # vLLM's block size on CUDA GPUs
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's default for an OpenAI server on H100/H200-class GPUs


@dataclass(frozen=True)
class SimulatedSpec:
    """Everything a simulated engine is built from (EngineSpec.simulated): the user's sub-config,
    the scheduling limits it shares with vLLM, and the part its pool plays in a handoff."""

    sim: SimulatedEngineConfig
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_prefix_caching: bool
    role: Literal["prefill", "decode"]
    handoff: bool
    step_table_dir: str  # where the step table is cached (<cache_root>/baton/step-tables)
