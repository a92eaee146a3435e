"""Rotary position embedding (RoPE) math for position-free KV segments.

A segment's keys are stored *before* RoPE ("position-free"); loading it at positions q..q+T-1
applies RoPE there. Capturing a segment from the paged cache (keys stored after RoPE at the
positions they were computed at) removes RoPE again. Both are done in fp32 and cast once.

RoPE rotates each pair of a key's dimensions by angle p·θ_i, θ_i = base^(-2i/D):
- neox style pairs dimension i with i + D/2 (the halves);
- gptj style pairs 2i with 2i + 1 (interleaved).
The cos/sin table is built exactly as vLLM builds its own (fp32 `t * inv_freq`, cos/sin, then
rounded to the model dtype), so a re-rotated key matches the engine's key at the new position up
to one rounding of the model dtype. Only unscaled ("default") RoPE is supported; other rope types
raise UnsupportedRope with the type named. The segment connector then turns injection and capture
off on that engine (kv_transfer/segment_scheduler.py `disabled`): memories and real-time windows
are computed from tokens, and the engine starts as usual.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch


class UnsupportedRope(ValueError):
    """The model's RoPE variant is not one this module can re-rotate exactly."""


@dataclass(frozen=True)
class RopeSpec:
    head_dim: int
    base: float
    style: Literal["neox", "gptj"] = "neox"
    table_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise UnsupportedRope(f"head_dim must be a positive even number, got {self.head_dim}")
        if self.base <= 0:
            raise UnsupportedRope(f"rope base must be positive, got {self.base}")


def rope_spec_from_hf_config(cfg: Any, table_dtype: torch.dtype = torch.bfloat16) -> RopeSpec:
    """RopeSpec of a Llama-style HF config (transformers 5 `rope_parameters` or older fields).

    Llama-family models in vLLM use neox-style RoPE over the whole head dimension."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(params, dict):
        params = dict(params)
    legacy = getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or params.get("type") or legacy.get("rope_type") or "default"
    if rope_type != "default":
        raise UnsupportedRope(f"rope type {rope_type!r} is not supported for KV re-rotation (only 'default')")
    base = params.get("rope_theta") or getattr(cfg, "rope_theta", None)
    if base is None:
        raise UnsupportedRope("the model config names no rope_theta")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedRope("partial rotary embeddings are not supported for KV re-rotation")
    return RopeSpec(head_dim=int(head_dim), base=float(base), style="neox", table_dtype=table_dtype)


def cos_sin(spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin of shape [T, D/2] for integer positions [T], rounded like vLLM's table."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.base ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = positions.to(torch.float)[:, None] * inv_freq[None, :]
    cos = freqs.cos().to(spec.table_dtype).to(torch.float)
    sin = freqs.sin().to(spec.table_dtype).to(torch.float)
    return cos, sin


def _pairs(x: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    if style == "neox":
        half = x.shape[-1] // 2
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def _join(a: torch.Tensor, b: torch.Tensor, style: str) -> torch.Tensor:
    if style == "neox":
        return torch.cat((a, b), dim=-1)
    return torch.stack((a, b), dim=-1).flatten(-2)


def _rotate(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, sign: float) -> torch.Tensor:
    """keys [..., T, H, D] (any float dtype) rotated by sign·p·θ; returns fp32 of the same shape."""
    if keys.shape[-1] != spec.head_dim:
        raise ValueError(f"key head dim {keys.shape[-1]} != rope head dim {spec.head_dim}")
    if keys.shape[-3] != positions.shape[0]:
        raise ValueError(f"{keys.shape[-3]} tokens but {positions.shape[0]} positions")
    cos, sin = cos_sin(spec, positions)
    if sign < 0:
        # the exact inverse of the engine's rotation: its rounded (cos, sin) pair has a norm
        # that is not exactly 1, so divide it out instead of assuming an orthogonal rotation
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2], broadcast over heads
    x1, x2 = _pairs(keys.to(torch.float), spec.style)
    return _join(x1 * cos - x2 * sin, x2 * cos + x1 * sin, spec.style)


def apply_rope(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Position-free keys [..., T, H, D] → keys at `positions` (fp32)."""
    return _rotate(keys, positions, spec, +1.0)


def remove_rope(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Keys computed at `positions` [..., T, H, D] → position-free keys (fp32)."""
    return _rotate(keys, positions, spec, -1.0)


class Rotator:
    """Applies RoPE to many keys at once with vLLM's fused CPU/GPU kernel when it is available
    (in-place `_C::rotary_embedding`, ~10x faster than the torch ops above on this machine),
    falling back to `apply_rope`. The kernel gets an fp32 table holding the same rounded values
    as the engine's own, so the math is fp32 and matches `apply_rope`."""

    def __init__(self, spec: RopeSpec, max_positions: int):
        self.spec = spec
        cos, sin = cos_sin(spec, torch.arange(max_positions))
        self._table = torch.cat((cos, sin), dim=-1).contiguous()  # [max_positions, D] fp32
        self._op: Any = None
        try:
            from vllm import _custom_ops as ops

            self._op = ops.rotary_embedding
        except Exception:  # noqa: BLE001 - no compiled vLLM here: torch path
            self._op = None

    def apply(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Position-free keys [L, T, H, D] → fp32 keys at `positions` [T] for every layer (a copy)."""
        return self.apply_(keys.to(torch.float, copy=True).contiguous(), positions)

    def apply_(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """In place on contiguous fp32 keys [L, T, H, D]; returns them."""
        if keys.dtype != torch.float or not keys.is_contiguous():
            raise ValueError("apply_ needs contiguous fp32 keys")
        if int(positions.max()) >= self._table.shape[0]:
            raise ValueError(f"position {int(positions.max())} beyond the rope table ({self._table.shape[0]})")
        if self._op is None:
            keys.copy_(apply_rope(keys, positions, self.spec))
            return keys
        layers, t, h, d = keys.shape
        self._op(positions.repeat(layers), keys.view(layers * t, h * d), None, d, self._table, self.spec.style == "neox")
        return keys
