"""The strategies the DP is compared with. Each is a pure function returning a CheckpointPlan.

All positions are positive block multiples ≤ `length` (the deepest depth worth serving); every
strategy but block-dense keeps at most `budget` positions.
  none        — no checkpoints: every hit resumes from 0 (prefix caching of the state off).
  block_dense — every block boundary (vLLM's `prefix_cache_retention_interval=None`).
  uniform     — one every `interval` tokens (vLLM's retention interval N); with a budget only,
                the interval is the smallest block multiple that fits the budget in `length`.
  balanced    — equal probability mass between consecutive checkpoints (quantiles of p).
  sqrt        — one every ⌈√(length/B)⌉ blocks (√L decomposition), widened to fit the budget.
  dyadic      — blocks 1, 2, 4, 8, … (powers of two), the deepest `budget` of them.
"""
from __future__ import annotations

import math

import numpy as np

from baton.engine.checkpoints.plan import CheckpointPlan, expected_recomputed


def _finish(name: str, positions: list[int], budget: int, block_size: int, depths: np.ndarray | None, probs: np.ndarray | None) -> CheckpointPlan:
    pos = tuple(sorted(set(positions)))
    cost = 0.0
    if depths is not None and probs is not None and float(np.sum(probs)) > 0:
        cost = expected_recomputed(pos, depths, np.asarray(probs, dtype=np.float64) / float(np.sum(probs)))
    return CheckpointPlan(name, pos, budget, block_size, cost)


def _every(step_blocks: int, length: int, block_size: int, budget: int) -> list[int]:
    return [k * block_size for k in range(step_blocks, length // block_size + 1, step_blocks)][:budget]


def none(length: int, budget: int, block_size: int, depths=None, probs=None) -> CheckpointPlan:
    return _finish("none", [], max(budget, 0), block_size, depths, probs)


def block_dense(length: int, budget: int, block_size: int, depths=None, probs=None) -> CheckpointPlan:
    n = length // block_size
    return _finish("block_dense", _every(1, length, block_size, n), n, block_size, depths, probs)


def uniform(length: int, budget: int, block_size: int, depths=None, probs=None, interval: int | None = None) -> CheckpointPlan:
    n = length // block_size
    if budget <= 0 or n == 0:
        return _finish("uniform", [], max(budget, 0), block_size, depths, probs)
    step = max(1, interval // block_size) if interval else max(1, math.ceil(n / budget))
    return _finish("uniform", _every(step, length, block_size, budget), budget, block_size, depths, probs)


def sqrt(length: int, budget: int, block_size: int, depths=None, probs=None) -> CheckpointPlan:
    n = length // block_size
    if budget <= 0 or n == 0:
        return _finish("sqrt", [], max(budget, 0), block_size, depths, probs)
    step = max(math.ceil(math.sqrt(n)), math.ceil(n / budget))
    return _finish("sqrt", _every(step, length, block_size, budget), budget, block_size, depths, probs)


def dyadic(length: int, budget: int, block_size: int, depths=None, probs=None) -> CheckpointPlan:
    n = length // block_size
    powers = []
    k = 1
    while k <= n:
        powers.append(k * block_size)
        k *= 2
    return _finish("dyadic", powers[max(len(powers) - budget, 0):] if budget > 0 else [], max(budget, 0), block_size, depths, probs)


def balanced(length: int, budget: int, block_size: int, depths=None, probs=None) -> CheckpointPlan:
    """Checkpoint k (k = 0..budget−1) at the first observed depth where cumulative mass ≥ k/budget."""
    if budget <= 0 or depths is None or probs is None or float(np.sum(probs)) <= 0:
        return _finish("balanced", [], max(budget, 0), block_size, depths, probs)
    d = np.asarray(depths, dtype=np.int64)
    w = np.asarray(probs, dtype=np.float64)
    keep = (w > 0) & (d > 0) & (d <= length)
    if not np.any(keep):
        return _finish("balanced", [], budget, block_size, depths, probs)
    xs, inv = np.unique(d[keep], return_inverse=True)
    mass = np.bincount(inv, weights=w[keep])
    before = np.concatenate(([0.0], np.cumsum(mass)[:-1])) / mass.sum()  # mass strictly below each x
    targets = np.arange(budget) / budget
    idx = np.searchsorted(before, targets, side="right") - 1
    return _finish("balanced", [int(xs[i]) for i in np.unique(np.clip(idx, 0, len(xs) - 1))], budget, block_size, depths, probs)


STRATEGIES = {"none": none, "block_dense": block_dense, "uniform": uniform, "balanced": balanced, "sqrt": sqrt, "dyadic": dyadic}
