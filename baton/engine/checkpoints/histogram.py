"""Observed prefix-match depths of one prefix family, as a decaying histogram over block positions.

Pure state, no clock of its own: every call that ages the histogram takes `now` (seconds).
Invariants (check_integrity):
  * keys are non-negative block multiples; weights are finite and > 0 (zeroed entries are dropped);
  * frozen positions are a subset of the keys and never decay: a depth that became a mode (at least
    `freeze_share` of the mass and `freeze_min_weight` observations' worth) keeps its checkpoint
    even through a quiet spell, so the plan does not thrash between re-solves;
  * `pending` counts observations since the last re-solve; a re-solve is due when it reaches
    `resolve_every` (or when there is data and no plan yet).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DepthHistogram:
    block_size: int
    half_life_s: float = 600.0
    freeze_share: float = 0.2
    freeze_min_weight: float = 8.0
    resolve_every: int = 32
    weights: dict[int, float] = field(default_factory=dict)
    frozen: set[int] = field(default_factory=set)
    pending: int = 0
    solved_once: bool = False
    _t: float | None = None

    def observe(self, depth: int, now: float, weight: float = 1.0) -> None:
        """Record one request's match depth (floored to a block multiple) at time `now`."""
        self._decay_to(now)
        pos = max(depth, 0) // self.block_size * self.block_size
        self.weights[pos] = self.weights.get(pos, 0.0) + weight
        self.pending += 1
        total = sum(self.weights.values())
        w = self.weights[pos]
        if pos > 0 and w >= self.freeze_min_weight and w >= self.freeze_share * total:
            self.frozen.add(pos)

    def _decay_to(self, now: float) -> None:
        if self._t is not None and now > self._t and self.half_life_s > 0:
            factor = 0.5 ** ((now - self._t) / self.half_life_s)
            for pos in list(self.weights):
                if pos in self.frozen:
                    continue
                w = self.weights[pos] * factor
                if w < 1e-9:
                    del self.weights[pos]
                else:
                    self.weights[pos] = w
        if self._t is None or now > self._t:
            self._t = now

    def resolve_due(self) -> bool:
        return bool(self.weights) and (not self.solved_once or self.pending >= self.resolve_every)

    def mark_resolved(self) -> None:
        self.pending = 0
        self.solved_once = True

    def thaw(self) -> None:
        """Unfreeze every mode (e.g. when the workload is known to have changed)."""
        self.frozen.clear()

    def distribution(self) -> tuple[np.ndarray, np.ndarray]:
        """(depths, probabilities) sorted by depth; probabilities sum to 1 (empty when no data)."""
        if not self.weights:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        d = np.array(sorted(self.weights), dtype=np.int64)
        w = np.array([self.weights[int(x)] for x in d], dtype=np.float64)
        return d, w / w.sum()

    def check_integrity(self) -> None:
        for pos, w in self.weights.items():
            if pos < 0 or pos % self.block_size:
                raise AssertionError(f"histogram key {pos} is not a block multiple")
            if not (w > 0 and math.isfinite(w)):
                raise AssertionError(f"histogram weight {w} at {pos} is not positive and finite")
        if not self.frozen <= set(self.weights):
            raise AssertionError(f"frozen modes {sorted(self.frozen - set(self.weights))} have no weight")
        if self.pending < 0:
            raise AssertionError("negative pending count")
