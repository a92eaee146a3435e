"""The checkpoint planner (baton/engine/checkpoints/): exact DP, baselines, histogram, policy. No engine."""
from __future__ import annotations

import time

import numpy as np
import pytest
from pydantic import ValidationError

from baton.engine.checkpoints import baselines
from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.depth import PrefixDepthTracker
from baton.engine.checkpoints.histogram import DepthHistogram
from baton.engine.checkpoints.plan import CheckpointPlan, expected_recomputed
from baton.engine.checkpoints.planner import brute_force, solve
from baton.engine.checkpoints.policy import CheckpointPolicy, plan_for

B = 16


def random_hist(rng: np.random.Generator, max_blocks: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    d = rng.integers(0, max_blocks + 1, size=n) * B
    w = rng.random(n) ** 3 * (rng.random(n) < 0.8)
    return d, w


# ---- the DP is exact -----------------------------------------------------------------------------


def test_dp_equals_brute_force_on_small_histograms() -> None:
    rng = np.random.default_rng(1)
    for trial in range(250):
        d, w = random_hist(rng, max_blocks=9, n=int(rng.integers(1, 9)))
        if trial % 5 == 0:
            w = np.round(w * 4)  # integer weights: ties between placements
        budget = int(rng.integers(0, 5))
        dp, bf = solve(d, w, budget, B), brute_force(d, w, budget, B)
        dp.check_integrity()
        assert dp.expected_recomputed_tokens == pytest.approx(bf.expected_recomputed_tokens, abs=1e-9), (d, w, budget)
        if w.sum() > 0:  # the reported cost is the plan's true cost
            assert dp.expected_recomputed_tokens == pytest.approx(expected_recomputed(dp.positions, d, w / w.sum()), abs=1e-9)


def test_dp_never_worse_than_any_baseline_with_the_same_budget() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        d, w = random_hist(rng, max_blocks=int(rng.integers(4, 200)), n=int(rng.integers(1, 60)))
        length = int(d.max())
        for budget in (1, 2, 4, 8, 16):
            dp = solve(d, w, budget, B)
            for name, fn in baselines.STRATEGIES.items():
                base = fn(length, budget, B, d, w)
                base.check_integrity()
                if len(base.positions) <= budget:
                    assert dp.expected_recomputed_tokens <= base.expected_recomputed_tokens + 1e-9, (name, budget)


def test_dp_with_enough_budget_matches_block_dense() -> None:
    d = np.array([0, 3, 3, 7, 12]) * B
    w = np.array([1.0, 2.0, 1.0, 1.0, 3.0])
    plan = solve(d, w, 3, B)
    assert plan.positions == (3 * B, 7 * B, 12 * B) and plan.expected_recomputed_tokens == 0.0


def test_dp_edge_cases() -> None:
    assert solve(np.array([]), np.array([]), 4, B).positions == ()
    assert solve(np.array([5 * B]), np.array([1.0]), 0, B).positions == ()
    assert solve(np.array([0, 0]), np.array([1.0, 1.0]), 3, B).positions == ()
    with pytest.raises(ValueError):
        solve(np.array([B + 1]), np.array([1.0]), 1, B)


def test_dp_is_fast_for_ten_thousand_positions_and_64_checkpoints() -> None:
    rng = np.random.default_rng(3)
    d = np.arange(1, 10_001) * 128
    w = rng.random(10_000) ** 4
    t = time.perf_counter()
    plan = solve(d, w, 64, 128)
    elapsed = time.perf_counter() - t
    plan.check_integrity()
    assert len(plan.positions) == 64
    assert elapsed < 5.0  # measured ~0.2 s on this 2-core machine


# ---- baselines -------------------------------------------------------------------------------------


def test_baseline_positions() -> None:
    L = 16 * B
    assert baselines.none(L, 4, B).positions == ()
    assert baselines.block_dense(L, 4, B).positions == tuple(k * B for k in range(1, 17))
    assert baselines.uniform(L, 4, B).positions == (4 * B, 8 * B, 12 * B, 16 * B)
    assert baselines.uniform(L, 99, B, interval=5 * B).positions == (5 * B, 10 * B, 15 * B)
    assert baselines.sqrt(L, 8, B).positions == (4 * B, 8 * B, 12 * B, 16 * B)
    assert baselines.dyadic(L, 3, B).positions == (4 * B, 8 * B, 16 * B)
    assert baselines.dyadic(L, 9, B).positions == (B, 2 * B, 4 * B, 8 * B, 16 * B)  # budget over the powers: all of them
    d, w = np.array([2, 2, 2, 10]) * B, np.ones(4)
    assert baselines.balanced(L, 2, B, d, w).positions == (2 * B,)  # 3/4 of the mass at one depth


# ---- plan, histogram, depth tracker, policy --------------------------------------------------------


def test_plan_resume_and_integrity() -> None:
    p = CheckpointPlan("dp", (2 * B, 5 * B), 2, B)
    assert [p.resume_position(t) for t in (0, B, 2 * B, 4 * B, 9 * B)] == [0, 0, 2 * B, 2 * B, 5 * B]
    assert p.recomputed(4 * B) == 2 * B and p.next_after(2 * B) == 5 * B and p.next_after(5 * B) is None
    p.check_integrity()
    for bad in (CheckpointPlan("x", (B, B), 2, B), CheckpointPlan("x", (B + 1,), 2, B), CheckpointPlan("x", (B, 2 * B), 1, B)):
        with pytest.raises(AssertionError):
            bad.check_integrity()


def test_histogram_decays_with_the_injected_clock() -> None:
    h = DepthHistogram(B, half_life_s=10.0, freeze_min_weight=1e9)
    h.observe(3 * B + 5, now=0.0)  # floored to a block multiple
    h.observe(0, now=10.0)  # one half-life later
    assert h.weights[3 * B] == pytest.approx(0.5) and h.weights[0] == 1.0
    d, p = h.distribution()
    assert list(d) == [0, 3 * B] and p.sum() == pytest.approx(1.0)
    h.check_integrity()


def test_histogram_freezes_modes_against_decay() -> None:
    h = DepthHistogram(B, half_life_s=1.0, freeze_share=0.3, freeze_min_weight=3.0)
    for i in range(4):
        h.observe(8 * B, now=float(i) * 0.001)
    assert 8 * B in h.frozen
    for i in range(20):  # a long spell of other depths: the mode keeps its weight
        h.observe(2 * B, now=100.0 + i * 0.01)
    assert h.weights[8 * B] == pytest.approx(4.0, rel=1e-2)  # after 100 half-lives
    assert 2 * B in h.frozen  # the new depth became a mode too
    h.thaw()
    assert not h.frozen
    h.check_integrity()


def test_histogram_resolve_trigger() -> None:
    h = DepthHistogram(B, resolve_every=3)
    assert not h.resolve_due()  # no data
    h.observe(B, 0.0)
    assert h.resolve_due()  # first data, no plan yet
    h.mark_resolved()
    h.observe(B, 1.0)
    h.observe(B, 2.0)
    assert not h.resolve_due()
    h.observe(B, 3.0)
    assert h.resolve_due()


def test_depth_tracker_matches_chained_block_keys() -> None:
    t = PrefixDepthTracker(B, capacity=100)
    assert t.match_and_add(["a", "ab", "abc"], 3 * B + 1) == 0
    assert t.match_and_add(["a", "ab", "abd"], 3 * B + 1) == 2 * B
    assert t.match_and_add(["a", "ab", "abc"], 3 * B) == 2 * B  # capped below the last token
    t.check_integrity()


def test_policy_resolves_per_family_and_keeps_invariants() -> None:
    cfg = CheckpointConfig(strategy="dp", budget=1, resolve_every=1)
    pol = CheckpointPolicy(cfg, B)
    assert pol.observe(None, 5 * B, 10 * B, 0.0).positions == ()
    pol.observe("sys-a", 0, 10 * B, 0.0)
    assert pol.observe("sys-a", 6 * B, 10 * B, 1.0).positions == (6 * B,)
    assert pol.plan("sys-b").positions == ()
    pol.observe("sys-b", 3 * B, 4 * B, 1.0)
    assert pol.plan("sys-b").positions == (3 * B,) and pol.plan("sys-a").positions == (6 * B,)
    pol.record_hit(6 * B, 0)
    assert pol.counters.recomputed_tokens == 6 * B
    pol.check_integrity()
    dense = CheckpointPolicy(CheckpointConfig(strategy="block_dense"), B)
    dense.observe("f", 0, 4 * B + 1, 0.0)
    assert dense.plan("f").positions == (B, 2 * B, 3 * B, 4 * B)


def test_config_is_strict() -> None:
    with pytest.raises(ValidationError):
        CheckpointConfig(strategy="dp", bugdet=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        CheckpointConfig(strategy="dp", interval=128)
    assert plan_for(CheckpointConfig(strategy="none"), 8 * B, B, np.array([4 * B]), np.ones(1)).positions == ()


def test_fill_spare_stays_in_budget_and_never_costs_more() -> None:
    from baton.engine.checkpoints.policy import fill_spare

    rng = np.random.default_rng(4)
    for _ in range(100):
        d, w = random_hist(rng, max_blocks=40, n=int(rng.integers(1, 6)))
        budget = int(rng.integers(1, 12))
        dp = solve(d, w, budget, B)
        filled = fill_spare(dp, 40 * B, d, w)
        filled.check_integrity()
        assert set(dp.positions) <= set(filled.positions)
        assert filled.expected_recomputed_tokens <= dp.expected_recomputed_tokens + 1e-9
    full = fill_spare(solve(np.array([3 * B]), np.ones(1), 10, B), 6 * B + 5, np.array([3 * B]), np.ones(1))
    assert full.positions == tuple(k * B for k in range(1, 7))  # budget for every block: every block
