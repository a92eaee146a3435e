"""The typed result every checkpoint strategy returns, and the exact cost it is judged by.

A plan is a set of token positions (block multiples) where a recurrent-state checkpoint is kept.
A request whose prompt matches the cache to depth t resumes from s(t) = the deepest planned
position <= t (0 when none) and recomputes t - s(t) matched tokens. That is the whole cost model:
attention KV stays dense, so only the recurrent state decides where a request can resume.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CheckpointPlan:
    """Positions of kept recurrent states for one prefix family.

    Invariants (check_integrity): positions strictly increase, are positive block multiples, and
    number at most `budget` (block-dense is the one strategy whose budget is its own count).
    `expected_recomputed_tokens` is Σ_t p(t)·(t − s(t)) under the histogram it was planned on.
    """

    strategy: str
    positions: tuple[int, ...]
    budget: int
    block_size: int
    expected_recomputed_tokens: float = 0.0

    def resume_position(self, depth: int) -> int:
        """s(depth): the deepest planned position <= depth, 0 when none."""
        k = bisect.bisect_right(self.positions, depth)
        return self.positions[k - 1] if k else 0

    def recomputed(self, depth: int) -> int:
        """Matched tokens a request with this match depth recomputes: depth − s(depth)."""
        return depth - self.resume_position(depth)

    def next_after(self, position: int) -> int | None:
        """The shallowest planned position strictly deeper than `position` (None when none)."""
        k = bisect.bisect_right(self.positions, position)
        return self.positions[k] if k < len(self.positions) else None

    def holds(self, position: int) -> bool:
        k = bisect.bisect_left(self.positions, position)
        return k < len(self.positions) and self.positions[k] == position

    def check_integrity(self) -> None:
        if len(self.positions) > self.budget:
            raise AssertionError(f"{self.strategy}: {len(self.positions)} positions over budget {self.budget}")
        prev = 0
        for p in self.positions:
            if p <= prev:
                raise AssertionError(f"{self.strategy}: positions not strictly increasing and positive: {self.positions}")
            if p % self.block_size:
                raise AssertionError(f"{self.strategy}: position {p} is not a multiple of block {self.block_size}")
            prev = p
        if self.expected_recomputed_tokens < -1e-9:
            raise AssertionError(f"{self.strategy}: negative expected cost {self.expected_recomputed_tokens}")


def expected_recomputed(positions: Sequence[int], depths: np.ndarray, probs: np.ndarray) -> float:
    """Σ_t p(t)·(t − s(t)) evaluated directly (the referee for every strategy, DP included)."""
    if len(depths) == 0:
        return 0.0
    pos = np.asarray(sorted(positions), dtype=np.int64)
    d = np.asarray(depths, dtype=np.int64)
    k = np.searchsorted(pos, d, side="right")
    resume = np.where(k > 0, pos[np.maximum(k - 1, 0)] if len(pos) else 0, 0)
    return float(np.dot(np.asarray(probs, dtype=np.float64), d - resume))
