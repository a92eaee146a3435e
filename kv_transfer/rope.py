"""Rotary position embedding (RoPE) for position-free KV segments, taken from vLLM's own module.

A segment's keys are stored *before* RoPE ("position-free"); loading it at positions q..q+T-1
applies RoPE there. Capturing a segment from the paged cache (keys stored after RoPE at the
positions they were computed at) removes RoPE again. Both are done in fp32 and cast once.

Where the rotation comes from: the engine's rotary embedding module itself (vLLM's
`RotaryEmbedding` family, as built by `get_rope`), never a formula re-derived from the HF config:
- `table`: the module's `cos_sin_cache` ([max positions, rotary_dim] = cos | sin, already rounded
  to the model dtype, with every scaling baked in: linear, dynamic NTK, llama3, YaRN incl. its
  mscale, longrope's short or long factors incl. their mscale);
- `style`: the module's `is_neox_style` — neox pairs dimension i with i + R/2 (the halves), gptj
  pairs 2i with 2i + 1 (interleaved);
- partial rotary: only the first rotary_dim = table width dims of a head rotate; the rest pass.
The engine computes the key at position p as rot(k, table[p]); remove_rope divides by the table
row's norm (not exactly 1 after rounding, and mscale² under YaRN/longrope), so it is the exact
inverse of that; moving p→q is then exact up to one rounding of the model dtype.

Exact only when the engine's rotation of position p depends on p alone, through this one table:
`rope_from_module` accepts a module whose class applies `cos_sin_cache` with vLLM's base forward
(RotaryEmbedding and its table-only subclasses: default, linear, ntk, dynamic NTK — static in vLLM:
one table for max_position, not re-derived per sequence length —, llama3, YaRN, Gemma's
proportional), and longrope (vLLM picks short or long factors once per engine from max_model_len,
never per sequence, so one half of its cache applies to every position). Anything else — M-RoPE
(multimodal positions), dual-chunk attention, DeepSeek's MLA rope, Fourier RoPE, layers with
different rotary embeddings, no rotary embedding — raises UnsupportedRope with the reason; the
segment connector then turns injection and capture off on that engine (SegmentScheduler.disabled,
worker rope None): memories and real-time windows are computed from tokens, the engine starts.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

logger = logging.getLogger("baton.kv_transfer.rope")


class UnsupportedRope(ValueError):
    """The model's RoPE variant is not one this module can re-rotate exactly."""


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """The rotation an engine applies: key dims [0, rotary_dim) rotate by table[position].

    table: fp32 [max_positions, rotary_dim], cos in the first half of each row, sin in the second
    (vLLM's cos_sin_cache layout), holding exactly the values the engine applies."""

    head_dim: int
    style: Literal["neox", "gptj"]
    table: torch.Tensor
    source: str = "unscaled"

    def __post_init__(self) -> None:
        if self.table.dim() != 2 or self.table.shape[0] == 0:
            raise UnsupportedRope(f"rope table must be [positions, rotary_dim], got {tuple(self.table.shape)}")
        r = self.rotary_dim
        if r <= 0 or r % 2 or r > self.head_dim:
            raise UnsupportedRope(f"rotary dim {r} must be positive, even and <= head_dim {self.head_dim}")
        if self.style not in ("neox", "gptj"):
            raise UnsupportedRope(f"unknown rope pairing style {self.style!r}")
        if self.table.dtype != torch.float:
            object.__setattr__(self, "table", self.table.to(torch.float))

    @property
    def rotary_dim(self) -> int:
        return int(self.table.shape[1])

    @property
    def max_positions(self) -> int:
        return int(self.table.shape[0])

    @classmethod
    def unscaled(cls, head_dim: int, base: float, style: Literal["neox", "gptj"] = "neox",
                 table_dtype: torch.dtype = torch.bfloat16, max_positions: int = 32768,
                 rotary_dim: int | None = None) -> RopeSpec:
        """Plain RoPE (θ_i = base^(-2i/R)) built as vLLM's RotaryEmbedding builds its cache: fp32
        `t * inv_freq`, cos/sin, rounded to table_dtype. For tests and engine-free tools; an engine's
        spec comes from its own module (rope_from_module)."""
        r = head_dim if rotary_dim is None else rotary_dim
        if base <= 0:
            raise UnsupportedRope(f"rope base must be positive, got {base}")
        if r <= 0 or r % 2:
            raise UnsupportedRope(f"rotary dim must be a positive even number, got {r}")
        inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float) / r))
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(table_dtype).to(torch.float)
        return cls(head_dim=head_dim, style=style, table=table, source=f"unscaled base={base}")

    def same_rotation(self, other: RopeSpec) -> bool:
        """Same head dim, pairing and table over the positions both cover."""
        n = min(self.max_positions, other.max_positions)
        return (self.head_dim == other.head_dim and self.style == other.style and self.rotary_dim == other.rotary_dim
                and torch.equal(self.table[:n], other.table[:n]))


# ---- from vLLM's module ---------------------------------------------------------------------------

_BASE_FORWARDS = ("forward_static", "forward_native", "forward_cpu", "forward_cuda", "forward_hip", "forward_xpu", "forward")


def _table_only(cls: type) -> bool:
    """The class applies cos_sin_cache[position] with vLLM's RotaryEmbedding forward unchanged."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return issubclass(cls, RotaryEmbedding) and all(getattr(cls, f) is getattr(RotaryEmbedding, f) for f in _BASE_FORWARDS)


def is_rotary_module(module: Any) -> bool:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.rotary_embedding.dual_chunk_rope import DualChunkRotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import Phi3LongRoPEScaledRotaryEmbedding

    return isinstance(module, RotaryEmbeddingBase | Phi3LongRoPEScaledRotaryEmbedding | DualChunkRotaryEmbedding)


def rope_from_module(module: Any) -> RopeSpec:
    """The RopeSpec of one of vLLM's rotary embedding modules, or UnsupportedRope saying why."""
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import Phi3LongRoPEScaledRotaryEmbedding

    name = type(module).__name__
    if isinstance(module, Phi3LongRoPEScaledRotaryEmbedding):
        # cache rows [0, original_max) use the short factors, the rest the long ones; the engine
        # indexes it at position + original_max for every position when use_long_rope (decided
        # once from max_model_len), else at position: either way one fixed table per engine
        cache = module.long_short_cos_sin_cache
        k = module.original_max_position_embeddings
        table = cache[k:] if module.use_long_rope else cache[:k]
        which = "long" if module.use_long_rope else "short"
        return RopeSpec(head_dim=module.head_size, style="neox", table=table.detach().to(torch.float),
                        source=f"{name} ({which} factors)")
    if not is_rotary_module(module):
        raise UnsupportedRope(f"{name} is not a vLLM rotary embedding")
    if not _table_only(type(module)):
        raise UnsupportedRope(f"{name} does not apply one cos/sin table by position (its own forward): "
                              "its rotation cannot be re-applied exactly")
    cache = getattr(module, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor):
        raise UnsupportedRope(f"{name} has no cos_sin_cache")
    if cache.shape[1] != module.rotary_dim:
        raise UnsupportedRope(f"{name}'s table width {cache.shape[1]} != rotary dim {module.rotary_dim}")
    style: Literal["neox", "gptj"] = "neox" if module.is_neox_style else "gptj"
    return RopeSpec(head_dim=module.head_size, style=style, table=cache.detach().to(torch.float),
                    source=f"{name} ({style}, rotary_dim {module.rotary_dim} of {module.head_size})")


def rope_from_model(model: Any) -> RopeSpec:
    """The RopeSpec of a loaded vLLM model: the one rotary embedding all its layers use.

    Several module objects are fine when they rotate identically (some models build one per
    layer); layers with different rotations (e.g. local/global RoPE bases) are unsupported."""
    found = [(n, m) for n, m in model.named_modules() if is_rotary_module(m)]
    if not found:
        raise UnsupportedRope(f"{type(model).__name__} has no rotary embedding (keys are not position-free)")
    first_name, first = found[0]
    spec = rope_from_module(first)
    for name, m in found[1:]:
        if m is first:
            continue
        if not spec.same_rotation(rope_from_module(m)):
            raise UnsupportedRope(f"layers use different rotary embeddings ({first_name} vs {name})")
    return spec


# ---- the engine's module, from its config ---------------------------------------------------------

# vLLM model classes that call get_rope differently from the common (Llama) convention
_GPTJ_ARCHS = {"GPTJForCausalLM"}


def _rope_parameters(hf: Any) -> dict[str, Any]:
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = {}
        if getattr(hf, "rope_theta", None) is not None:
            params["rope_theta"] = hf.rope_theta
        params.update(getattr(hf, "rope_scaling", None) or {})
    if not isinstance(params, dict):
        params = dict(params)
    return params


def get_rope_args(hf: Any, head_size: int) -> dict[str, Any]:
    """The arguments the vLLM model class of `hf.architectures` passes to get_rope (read from
    vllm/model_executor/models/: llama.py, qwen2.py, … pass the config's rope_parameters with neox
    pairing; gpt_j.py adds partial_rotary_factor = rotary_dim / head_size, gptj pairing)."""
    arch = (getattr(hf, "architectures", None) or [""])[0]
    params = dict(_rope_parameters(hf))
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedRope("per-layer-type rope parameters (several rotary embeddings)")
    if arch in _GPTJ_ARCHS:
        params["partial_rotary_factor"] = hf.rotary_dim / head_size
        return {"head_size": head_size, "max_position": getattr(hf, "max_position_embeddings", 8192),
                "rope_parameters": params, "is_neox_style": False}
    return {"head_size": head_size, "max_position": getattr(hf, "max_position_embeddings", None),
            "rope_parameters": params, "is_neox_style": True}


@contextlib.contextmanager
def _vllm_config_context(vllm_config: Any) -> Iterator[None]:
    """vLLM's custom ops read the current VllmConfig when they are built."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is not None:
        yield
    elif isinstance(vllm_config, VllmConfig):
        with set_current_vllm_config(vllm_config):
            yield
    else:  # an engine-free test config
        with set_current_vllm_config(VllmConfig()):
            yield


def rope_from_vllm_config(vllm_config: Any) -> RopeSpec:
    """The engine's rotary module as its model class builds it: vLLM's own `get_rope` with the
    model class's arguments and the model dtype. get_rope memoizes by these arguments, so in the
    engine's process this returns the very module object the loaded model holds; `bind_model`
    (kv_transfer/segment_worker.py) checks that against the model itself once it is loaded."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    mc = vllm_config.model_config
    hf = mc.hf_config
    try:
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        args = get_rope_args(hf, int(head))
        if args.get("max_position") is None:
            args["max_position"] = mc.max_model_len
        with _vllm_config_context(vllm_config):
            module = get_rope(**args, dtype=mc.dtype)
    except UnsupportedRope:
        raise
    except (AttributeError, KeyError, ValueError, AssertionError, TypeError) as e:
        raise UnsupportedRope(f"vLLM's get_rope cannot build this model's rotary embedding: {type(e).__name__}: {e}") from e
    return rope_from_module(module)


# ---- the math ---------------------------------------------------------------------------------

def cos_sin(spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin [T, rotary_dim/2] the engine applies at integer positions [T]."""
    if positions.numel() and int(positions.max()) >= spec.max_positions:
        raise ValueError(f"position {int(positions.max())} beyond the rope table ({spec.max_positions})")
    rows = spec.table.index_select(0, positions.to(torch.long))
    half = spec.rotary_dim // 2
    return rows[:, :half], rows[:, half:]


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
    """keys [..., T, H, D] (any float dtype) rotated by ±table[p]; returns fp32 of the same shape.

    Head dims:  [0, rotary_dim) rotate (pairs by style) | [rotary_dim, head_dim) pass through."""
    if keys.shape[-1] != spec.head_dim:
        raise ValueError(f"key head dim {keys.shape[-1]} != rope head dim {spec.head_dim}")
    if keys.shape[-3] != positions.shape[0]:
        raise ValueError(f"{keys.shape[-3]} tokens but {positions.shape[0]} positions")
    cos, sin = cos_sin(spec, positions)
    if sign < 0:
        # the exact inverse of the engine's rotation: its rounded (cos, sin) pair has a norm that
        # is not exactly 1 (mscale² under YaRN/longrope), so divide it out
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2], broadcast over heads
    x = keys.to(torch.float)
    r = spec.rotary_dim
    x1, x2 = _pairs(x[..., :r], spec.style)
    rotated = _join(x1 * cos - x2 * sin, x2 * cos + x1 * sin, spec.style)
    if r == spec.head_dim:
        return rotated
    return torch.cat((rotated, x[..., r:]), dim=-1)


def apply_rope(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Position-free keys [..., T, H, D] → keys at `positions` (fp32)."""
    return _rotate(keys, positions, spec, +1.0)


def remove_rope(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Keys computed at `positions` [..., T, H, D] → position-free keys (fp32)."""
    return _rotate(keys, positions, spec, -1.0)


class Rotator:
    """Applies RoPE to many keys at once with vLLM's fused CPU/GPU kernel when it is available
    (in-place `_C::rotary_embedding`, ~10x faster than the torch ops above on this machine),
    falling back to `apply_rope`. The kernel gets the spec's fp32 table (the engine's own values),
    so the math is fp32 and matches `apply_rope`; it rotates the first table-width dims of each
    head (partial rotary) with the spec's pairing."""

    def __init__(self, spec: RopeSpec, max_positions: int | None = None):
        self.spec = spec
        if max_positions is not None and max_positions > spec.max_positions:
            logger.warning("rope table covers %d positions, the engine %d: loads beyond fall back to recompute",
                           spec.max_positions, max_positions)
        self._table = spec.table.contiguous()
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
