"""KV bytes of a simulated model, from AIConfigurator's copy of its HF config.

bytes per token (whole model) = 2 (K and V) × layers × KV heads × head dim × 2 (bf16 KV cache).
Per GPU under tensor parallelism each GPU holds ceil(KV heads / tp) heads (replicated when tp
exceeds the KV head count, as vLLM does).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from baton.engine.simulated.config import aic_model_config_path

GIB = 1 << 30
KV_DTYPE_BYTES = 2  # bf16


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        """All layers, all KV heads: what a handoff moves per token."""
        return self.bytes_per_token_in(KV_DTYPE_BYTES)

    def bytes_per_token_in(self, dtype_bytes: int) -> int:
        """The same for a KV cache of `dtype_bytes` per element (4: float32)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def bytes_per_token_per_gpu(self, tp: int) -> int:
        return 2 * self.layers * -(-self.kv_heads // tp) * self.head_dim * KV_DTYPE_BYTES

    def tokens_in(self, gib: float, tp: int) -> int:
        """How many tokens a KV pool of `gib` GiB per GPU holds."""
        return int(gib * GIB) // self.bytes_per_token_per_gpu(tp)


def kv_geometry(model: str) -> KVGeometry:
    with open(aic_model_config_path(model)) as f:
        return geometry_of(json.load(f))


def geometry_of(cfg: dict) -> KVGeometry:
    """The KV geometry an HF `config.json` (parsed) describes."""
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    return KVGeometry(
        layers=int(cfg["num_hidden_layers"]),
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
    )
