"""Per-family checkpoint plans kept up to date from observed match depths (pure; clock injected).

One `CheckpointPolicy` per engine. A prefix family is named by its caller: the engine uses the key
of a prompt's first full block (prompts shorter than one block have no family and no checkpoints),
the benchmark also a conversation's key (system prompt + first user message). For each family it
owns a DepthHistogram and the CheckpointPlan in force; the engine-side seam (scheduler.py) and the
benchmark's simulator both drive this same class, so what the benchmark counts is what the engine
enforces.

Continuation (cfg.continuation): the histogram says which depths recur; a conversation's next turn
instead matches a depth never seen before — the end of the turn just seen (its prompt and reply),
and a sibling question the end of the document it shares. So the distribution the plan is made for
is the mixture (1 − ρ)·histogram + ρ·Σ_δ q(δ)·[tail + δ]: tail = the replay boundary of the
family's latest request; ρ = the share of requests so far whose match reached an earlier prompt's
tail (PrefixDepthTracker.observe; shrunk by one pseudo-request so ρ < 1); q(δ) = how far past that
tail those matches went (block multiples: a reply crossing a block boundary or not). A position
past the prompt is kept during decode, when the reply reaches it.

Invariants (check_integrity): every family's plan passes CheckpointPlan.check_integrity, holds
at most `budget` positions (block_dense: at most the family's block count), and never holds a
position deeper than the family's longest replay boundary seen plus the largest continuation
offset observed.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from baton.engine.checkpoints import baselines
from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.histogram import DepthHistogram
from baton.engine.checkpoints.plan import CheckpointPlan, expected_recomputed
from baton.engine.checkpoints.planner import solve


@dataclass
class FamilyState:
    histogram: DepthHistogram
    plan: CheckpointPlan
    length: int = 0  # deepest replay boundary seen in the family (tokens, block multiple)
    tail: int = 0  # replay boundary of the family's latest request


@dataclass
class PolicyCounters:
    """Cumulative figures for metrics (match depth = what could be reused; hit = what was)."""

    requests: int = 0
    match_tokens: int = 0
    hit_tokens: int = 0
    resolves: int = 0
    hit_depths: list[int] = field(default_factory=list)

    @property
    def recomputed_tokens(self) -> int:
        return self.match_tokens - self.hit_tokens


class CheckpointPolicy:
    def __init__(self, cfg: CheckpointConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.families: OrderedDict[Hashable, FamilyState] = OrderedDict()
        self.counters = PolicyCounters()
        self.followed = 0  # requests observed
        self.continued = 0  # ... whose match reached an earlier prompt's replay boundary (its tail)
        self.offsets: dict[int, int] = {}  # how far past that tail (tokens, block multiple) → count

    def continuation_rate(self) -> float:
        return self.continued / (self.followed + 1)

    def empty_plan(self) -> CheckpointPlan:
        return CheckpointPlan(self.cfg.strategy, (), self.cfg.budget, self.block_size, 0.0)

    def plan(self, family: Hashable | None) -> CheckpointPlan:
        """The plan in force for a family (empty for unknown families)."""
        if family is None or family not in self.families:
            return self.empty_plan()
        return self.families[family].plan

    def observe(self, family: Hashable | None, depth: int, prompt_len: int, now: float, reached_tail: int | None = None) -> CheckpointPlan:
        """Record one request's match depth (and the earlier tail it reached, PrefixDepthTracker.observe);
        re-solve the family's plan when due; return it."""
        if family is None:
            return self.empty_plan()
        st = self.families.get(family)
        if st is None:
            st = FamilyState(self._histogram(), self.empty_plan())
            self.families[family] = st
            while len(self.families) > self.cfg.max_families:
                self.families.popitem(last=False)
        self.families.move_to_end(family)
        st.histogram.observe(depth, now)
        replay = max(prompt_len - 1, 0) // self.block_size * self.block_size
        grew = replay > st.length
        st.length = max(st.length, replay)
        self.followed += 1
        if reached_tail is not None and 0 < reached_tail <= depth:
            self.continued += 1
            delta = (depth - reached_tail) // self.block_size * self.block_size
            self.offsets[delta] = self.offsets.get(delta, 0) + 1
        st.tail = replay
        if st.histogram.resolve_due() or (grew and self.cfg.strategy != "dp"):
            st.plan = self._solve(st)
            st.histogram.mark_resolved()
            self.counters.resolves += 1
        return st.plan

    def record_hit(self, match_depth: int, hit_depth: int) -> None:
        self.counters.requests += 1
        self.counters.match_tokens += match_depth
        self.counters.hit_tokens += min(hit_depth, match_depth)
        self.counters.hit_depths.append(hit_depth)
        if len(self.counters.hit_depths) > 4096:
            del self.counters.hit_depths[:2048]

    def _histogram(self) -> DepthHistogram:
        c = self.cfg
        return DepthHistogram(self.block_size, c.half_life_s, c.freeze_share, c.freeze_min_weight, c.resolve_every)

    def _solve(self, st: FamilyState) -> CheckpointPlan:
        depths, probs = st.histogram.distribution()
        mask = depths <= st.length
        depths, probs = depths[mask], probs[mask]
        rho = self.continuation_rate() if self.cfg.continuation and st.tail else 0.0
        if rho > 0:
            total = sum(self.offsets.values())
            depths = np.concatenate((depths, [st.tail + d for d in self.offsets])).astype(np.int64)
            probs = np.concatenate((probs * (1 - rho), [rho * c / total for c in self.offsets.values()]))
        return plan_for(self.cfg, st.length, self.block_size, depths, probs)

    def held_positions(self) -> int:
        return sum(len(st.plan.positions) for st in self.families.values())

    def check_integrity(self) -> None:
        for st in self.families.values():
            st.histogram.check_integrity()
            st.plan.check_integrity()
            horizon = st.length + max(self.offsets, default=0)  # continuation may plan into the reply
            if st.plan.positions and st.plan.positions[-1] > horizon:
                raise AssertionError(f"plan position {st.plan.positions[-1]} past the family's horizon {horizon}")


def plan_for(cfg: CheckpointConfig, length: int, block_size: int, depths: np.ndarray, probs: np.ndarray) -> CheckpointPlan:
    """Pure: the plan of `cfg.strategy` for a family of this length and depth distribution."""
    if cfg.strategy == "dp":
        plan = solve(depths, probs, cfg.budget, block_size)
        return fill_spare(plan, length, depths, probs) if cfg.fill_spare else plan
    if cfg.strategy == "uniform":
        return baselines.uniform(length, cfg.budget, block_size, depths, probs, interval=cfg.interval)
    return baselines.STRATEGIES[cfg.strategy](length, cfg.budget, block_size, depths, probs)


def fill_spare(plan: CheckpointPlan, length: int, depths: np.ndarray, probs: np.ndarray) -> CheckpointPlan:
    """Spend budget the DP left unused (fewer observed depths than M) on the widest gaps of
    [0, length]: each split at its block-aligned middle (with budget for every block, every block). Adding a checkpoint never raises any
    t − s(t), so the plan stays optimal for the histogram; online it covers depths not seen yet
    (a new mode's first request then resumes near it instead of from the last mode below)."""
    B = plan.block_size
    pos = set(plan.positions)
    while len(pos) < plan.budget:
        # a virtual edge one block past the family's deepest position, so that block is fillable too
        edges = [0, *sorted(pos), length // B * B + B]
        gap, lo = max((b - a, a) for a, b in pairwise(edges))
        if gap < 2 * B:
            break
        pos.add(lo + gap // 2 // B * B)
    positions = tuple(sorted(pos))
    total = float(np.sum(probs))
    cost = expected_recomputed(positions, depths, np.asarray(probs) / total) if total > 0 else 0.0
    return CheckpointPlan(plan.strategy, positions, plan.budget, B, cost)
