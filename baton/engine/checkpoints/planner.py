"""Exact placement of at most M recurrent-state checkpoints over a match-depth distribution.

Problem: depths t (block multiples) with probabilities p(t); choose ≤ M positions minimising
    E[recomputed] = Σ_t p(t)·(t − s(t)),   s(t) = deepest chosen position ≤ t (0 if none).

Facts the solver rests on (each one keeps it exact):
1. Only support points matter: a checkpoint at c with no observed depth in [c, next) saves
   nothing, and moving it up to the first observed depth ≥ c only raises s(t) for the depths it
   serves. So candidates = the depths with p > 0 (x_1 < … < x_n), plus the origin x_0 = 0.
2. With S_j = P(t ≥ x_j), the saving Σ p(t)·s(t) of checkpoints c_1 < … < c_k telescopes to
   Σ_k (c_k − c_{k−1})·S(c_k). Hence, with f_m(j) = best saving using at most m checkpoints, the
   deepest at x_j:
       f_m(j) = x_j·S_j + max_i [ f_{m−1}(i) − x_i·S_j ]
   — a maximum over lines (slope −x_i, intercept f_{m−1}(i)) at the point S_j: the upper convex
   hull of the points (x_i, f_{m−1}(i)) answers every j by a binary search on its edge slopes.
3. The constraint i < j may be dropped: for i ≥ j the line's value is bounded by the saving of a
   valid configuration ending at x_j with ≤ m checkpoints (truncate at x_j; every later S ≤ S_j),
   so it never exceeds f_m(j). When the hull picks such an i (only in a tie), the arg is redone
   over i ≤ j so the plan can be read back.
Cost: O(M·n) Python steps for the hulls plus vectorised numpy queries; see tests / README for the
measured time at n = 10⁴, M = 64.
"""
from __future__ import annotations

import numpy as np

from baton.engine.checkpoints.plan import CheckpointPlan, expected_recomputed


def _upper_hull(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Indices of the upper convex hull of the valid points, x strictly increasing (monotone chain)."""
    hull: list[int] = []
    xs = x.tolist()
    ys = y.tolist()
    for i in np.flatnonzero(valid).tolist():
        xi, yi = xs[i], ys[i]
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or below the segment a→i
            if (ys[b] - ys[a]) * (xi - xs[a]) <= (yi - ys[a]) * (xs[b] - xs[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.asarray(hull, dtype=np.int64)


def _best_lines(x: np.ndarray, f: np.ndarray, valid: np.ndarray, s: np.ndarray) -> np.ndarray:
    """For each query s_j: argmax_i over valid i of f_i − x_i·s_j (upper hull + slope search)."""
    h = _upper_hull(x, f, valid)
    if len(h) == 1:
        return np.full(len(s), h[0], dtype=np.int64)
    slopes = np.diff(f[h]) / np.diff(x[h])  # strictly decreasing along the upper hull
    # vertex k is optimal when slope(k−1,k) ≥ s ≥ slope(k,k+1): k = #edges with slope > s
    k = np.searchsorted(-slopes, -s, side="left")
    return h[k]


def solve(depths: np.ndarray, probs: np.ndarray, budget: int, block_size: int) -> CheckpointPlan:
    """Exact optimum of at most `budget` checkpoints for the given depth distribution.

    `depths` are block multiples (positions in tokens); `probs` are non-negative weights (they
    are normalised). Returns the plan with its exact expected recomputed tokens.
    """
    d = np.asarray(depths, dtype=np.int64)
    w = np.asarray(probs, dtype=np.float64)
    if d.shape != w.shape:
        raise ValueError("depths and probs differ in shape")
    if np.any(w < 0):
        raise ValueError("negative probability")
    if np.any(d % block_size) or np.any(d < 0):
        raise ValueError("depths must be non-negative multiples of the block size")
    keep = (w > 0) & (d > 0)
    total = float(w.sum())
    if budget <= 0 or not np.any(keep) or total <= 0:
        return _plan((), budget, block_size, d, w, total)
    # merge duplicate depths, keep the support only (fact 1)
    xs, inv = np.unique(d[keep], return_inverse=True)
    mass = np.bincount(inv, weights=w[keep]) / total
    n = len(xs)
    x = np.concatenate(([0.0], xs.astype(np.float64)))          # index 0 = origin (no checkpoint)
    surv = np.concatenate(([1.0], np.cumsum(mass[::-1])[::-1]))  # S_j = P(t ≥ x_j)
    surv[0] = 1.0
    q = surv[1:]
    m_max = min(budget, n)
    f = np.full(n + 1, -np.inf)
    f[0] = 0.0
    args = np.zeros((m_max, n), dtype=np.int64)
    layers = 0
    for m in range(m_max):
        best = _best_lines(x, f, np.isfinite(f), q)
        val = f[best] - x[best] * q + x[1:] * q
        bad = np.flatnonzero(best > np.arange(1, n + 1))  # fact 3: a tie won by a later line
        for j0 in bad.tolist():
            cand = f[: j0 + 2] - x[: j0 + 2] * q[j0]
            cand[~np.isfinite(cand)] = -np.inf
            i = int(np.argmax(cand))
            best[j0], val[j0] = i, cand[i] + x[j0 + 1] * q[j0]
        new = np.concatenate(([0.0], np.maximum(val, np.where(np.isfinite(f[1:]), f[1:], -np.inf))))
        # keep "at most m": where the previous layer is at least as good, point back to itself
        same = np.isfinite(f[1:]) & (f[1:] >= val)
        best = np.where(same, np.arange(1, n + 1), best)
        args[m] = best
        layers = m + 1
        if np.array_equal(new, f):
            break
        f = new
    # read back: from the best end point, follow args layer by layer
    j = int(np.argmax(f))
    picked: list[int] = []
    m = layers - 1
    while j > 0 and m >= 0:
        i = int(args[m, j - 1])
        if i != j:
            picked.append(int(xs[j - 1]))
            j = i
        m -= 1
    return _plan(tuple(sorted(picked)), budget, block_size, d, w, total)


def _plan(positions: tuple[int, ...], budget: int, block_size: int, d: np.ndarray, w: np.ndarray, total: float) -> CheckpointPlan:
    cost = expected_recomputed(positions, d, w / total) if total > 0 else 0.0
    return CheckpointPlan("dp", positions, max(budget, 0), block_size, cost)


def brute_force(depths: np.ndarray, probs: np.ndarray, budget: int, block_size: int) -> CheckpointPlan:
    """Every subset of ≤ budget block positions up to the deepest depth (tests only: exponential)."""
    from itertools import combinations

    d = np.asarray(depths, dtype=np.int64)
    w = np.asarray(probs, dtype=np.float64)
    total = float(w.sum()) or 1.0
    cands = list(range(block_size, int(d.max(initial=0)) + 1, block_size))
    best: tuple[float, tuple[int, ...]] = (expected_recomputed((), d, w / total), ())
    for k in range(1, min(budget, len(cands)) + 1):
        for combo in combinations(cands, k):
            c = expected_recomputed(combo, d, w / total)
            if c < best[0] - 1e-12:
                best = (c, combo)
    return CheckpointPlan("brute_force", best[1], budget, block_size, best[0])
