"""RoPE re-rotation of position-free keys (kv_transfer/rope.py): pure torch on CPU, no engine.

Tolerances (measured here, stated in the asserts):
- table_dtype float32: moving a key from p to q equals rotating it directly at q within 1e-5
  absolute for keys of unit scale (pure fp32 rounding);
- table_dtype bfloat16 (the default: vLLM rounds its cos/sin cache to the model dtype):
  remove_rope divides out the rounded table's norm, so it is the exact inverse of the engine's
  rotation at p, and the move p→q matches the direct rotation at q to ~1e-7 of the key scale
  (measured 1.1e-7 over 512 random positions < 8192); asserted at 1e-5. When the key at p was
  stored in bf16 (as the paged cache holds it), one bf16 rounding remains: measured 2.5e-3 of
  the key scale, asserted at 2^-8 ≈ 3.9e-3.
"""
from __future__ import annotations

import pytest
import torch

from kv_transfer.rope import (
    RopeSpec,
    UnsupportedRope,
    apply_rope,
    cos_sin,
    remove_rope,
)

F32 = RopeSpec.unscaled(head_dim=64, base=100000.0, table_dtype=torch.float32)
BF16 = RopeSpec.unscaled(head_dim=64, base=100000.0)  # default table dtype: bf16


def keys(t: int, h: int = 3, d: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=g)


def pos(*p: int) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.long)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_move_p_to_q_equals_direct_rotation_fp32(style: str) -> None:
    spec = RopeSpec.unscaled(head_dim=64, base=100000.0, style=style, table_dtype=torch.float32)
    k = keys(5)
    p, q = pos(0, 7, 100, 2048, 4095), pos(3, 900, 1, 4096, 17)
    at_p = apply_rope(k, p, spec)
    moved = apply_rope(remove_rope(at_p, p, spec), q, spec)
    direct = apply_rope(k, q, spec)
    assert moved.dtype == torch.float32
    assert (moved - direct).abs().max().item() < 1e-5
    assert (at_p - direct).abs().max().item() > 0.1  # the positions really differ


def test_move_p_to_q_with_the_default_bf16_table() -> None:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(256, 2, 64, generator=g)
    p, q = torch.randint(0, 8192, (256,), generator=g), torch.randint(0, 8192, (256,), generator=g)
    at_p = apply_rope(k, p, BF16)  # what the engine computed at p (its own rounded table)
    direct = apply_rope(k, q, BF16)  # what the engine would have computed at q
    moved = apply_rope(remove_rope(at_p, p, BF16), q, BF16)
    assert ((moved - direct).abs().max() / k.abs().max()).item() < 1e-5
    # the paged cache holds the key at p in bf16: one rounding of the model dtype remains
    moved_bf16 = apply_rope(remove_rope(at_p.to(torch.bfloat16), p, BF16), q, BF16)
    rel = ((moved_bf16 - direct).abs().max() / k.abs().max()).item()
    assert 1e-4 < rel < 2**-8
    # an orthogonal inverse (ignoring the rounded table's norm) would not be exact at p
    c, s = cos_sin(BF16, p)
    assert (c * c + s * s - 1).abs().max().item() > 1e-4


@pytest.mark.parametrize("spec", [F32, BF16, RopeSpec.unscaled(head_dim=8, base=10000.0, style="gptj")])
def test_remove_after_apply_is_identity(spec: RopeSpec) -> None:
    k = keys(6, d=spec.head_dim)
    p = pos(0, 1, 2, 50, 1000, 30000)
    assert (remove_rope(apply_rope(k, p, spec), p, spec) - k).abs().max().item() < 1e-5
    assert (apply_rope(remove_rope(k, p, spec), p, spec) - k).abs().max().item() < 1e-5


def test_position_zero_is_no_rotation_and_norm_is_kept() -> None:
    k = keys(3)
    assert torch.allclose(apply_rope(k, pos(0, 0, 0), F32), k, atol=0)
    rotated = apply_rope(k, pos(5, 60, 700), F32)
    assert torch.allclose(rotated.norm(dim=-1), k.norm(dim=-1), atol=1e-5)


def test_neox_and_gptj_pair_different_dimensions() -> None:
    k = keys(1, h=1, d=8)
    neox = RopeSpec.unscaled(head_dim=8, base=10000.0, style="neox", table_dtype=torch.float32)
    gptj = RopeSpec.unscaled(head_dim=8, base=10000.0, style="gptj", table_dtype=torch.float32)
    a, b = apply_rope(k, pos(3), neox), apply_rope(k, pos(3), gptj)
    assert (a - b).abs().max().item() > 1e-2
    # neox rotates (x0, x4) by 3·θ0 = 3 rad; gptj rotates (x0, x1) by the same angle
    c, s = torch.cos(torch.tensor(3.0)), torch.sin(torch.tensor(3.0))
    x = k[0, 0]
    assert torch.allclose(a[0, 0, 0], x[0] * c - x[4] * s, atol=1e-6)
    assert torch.allclose(a[0, 0, 4], x[4] * c + x[0] * s, atol=1e-6)
    assert torch.allclose(b[0, 0, 0], x[0] * c - x[1] * s, atol=1e-6)
    assert torch.allclose(b[0, 0, 1], x[1] * c + x[0] * s, atol=1e-6)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_query_key_dot_depends_only_on_relative_position(style: str) -> None:
    spec = RopeSpec.unscaled(head_dim=64, base=100000.0, style=style, table_dtype=torch.float32)
    qv, kv = keys(1, h=1, seed=4), keys(1, h=1, seed=5)

    def score(m: int, n: int) -> float:
        return float((apply_rope(qv, pos(m), spec) * apply_rope(kv, pos(n), spec)).sum())

    base = score(10, 3)
    for shift in (0, 1, 100, 5000):
        assert score(10 + shift, 3 + shift) == pytest.approx(base, abs=1e-3)
    assert abs(score(10, 4) - base) > 1e-3  # a different offset gives a different score


def test_leading_dims_broadcast() -> None:
    k = keys(4).expand(2, 4, 3, 64)  # [layers, T, H, D]
    p = pos(1, 2, 3, 4)
    out = apply_rope(k, p, F32)
    assert out.shape == (2, 4, 3, 64)
    assert torch.allclose(out[1], apply_rope(k[0], p, F32))


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="head dim"):
        apply_rope(keys(2, d=32), pos(0, 1), F32)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(keys(2), pos(0, 1, 2), F32)


def test_cos_sin_is_rounded_to_the_table_dtype() -> None:
    c32, _ = cos_sin(F32, pos(1000))
    c16, s16 = cos_sin(BF16, pos(1000))
    assert c16.dtype == torch.float32
    assert torch.equal(c16, c16.to(torch.bfloat16).to(torch.float32))
    assert torch.equal(s16, s16.to(torch.bfloat16).to(torch.float32))
    assert not torch.equal(c16, c32)


def test_spec_validation() -> None:
    with pytest.raises(UnsupportedRope):
        RopeSpec.unscaled(head_dim=63, base=10000.0)
    with pytest.raises(UnsupportedRope):
        RopeSpec.unscaled(head_dim=0, base=10000.0)
    with pytest.raises(UnsupportedRope):
        RopeSpec.unscaled(head_dim=64, base=0.0)
    with pytest.raises(UnsupportedRope, match="rotary dim"):
        RopeSpec(head_dim=32, style="neox", table=torch.zeros(8, 64))  # wider than the head
    with pytest.raises(UnsupportedRope, match="style"):
        RopeSpec(head_dim=64, style="halves", table=torch.zeros(8, 64))  # type: ignore[arg-type]


def test_positions_beyond_the_table_are_refused() -> None:
    spec = RopeSpec.unscaled(head_dim=8, base=10000.0, max_positions=16)
    with pytest.raises(ValueError, match="beyond the rope table"):
        apply_rope(keys(1, d=8), pos(16), spec)
