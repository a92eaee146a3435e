"""The check both injection suites make on real captured keys: a span's layer-0 keys captured at
position p, re-rotated to q, equal the keys the engine itself computed for the span at q."""
from __future__ import annotations

from typing import Any

import torch

from kv_transfer.rope import apply_rope, remove_rope


def assert_keys_moved_p_to_q_match(at_p: torch.Tensor, at_q: torch.Tensor, p: int, q: int, rope: Any) -> None:
    """at_p / at_q: the position-free layer-0 keys of the same n-token span captured at p and at q."""
    n = at_p.shape[0]
    moved = apply_rope(at_p, torch.arange(q, q + n), rope)
    computed = apply_rope(at_q, torch.arange(q, q + n), rope)  # the engine's own post-RoPE key at q
    scale = computed.abs().max().item()
    err = (moved - computed).abs().max().item()
    assert err <= 2 * scale / 128, (err, scale)  # 2 bf16 ulps of the largest element
    # the rotation really differs between p and q, so the comparison is not vacuous
    assert (apply_rope(at_p, torch.arange(p, p + n), rope) - computed).abs().max().item() > 4 * err
    # and the round trip through remove_rope is the identity on the stored form
    assert torch.allclose(remove_rope(moved, torch.arange(q, q + n), rope), at_p, atol=1e-3 * scale)
