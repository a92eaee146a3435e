"""Exact replay of the enforced policy over a request stream, without an engine.

Models what CheckpointScheduler + vLLM do, request by request (sequential, no eviction):
  1. match depth m = longest block prefix shared with any earlier prompt, capped at the replay
     boundary ⌊(L−1)/B⌋·B (PrefixDepthTracker, as the scheduler computes it);
  2. hit = deepest *stored* state on this prompt's own prefix at or below m (states are keyed by the
     chained block key, as vLLM keys them), 0 if none; recomputed = m − hit;
  3. the policy observes m (and may re-solve the family's plan);
  4. the prompt's prefill (from the hit on) stores a state at every planned position hit < p ≤ L.
The e2e test checks this model against the real engine request by request.

`replay` is the same model for any retention rule (baton/bench/checkpoint_retention.py: vLLM's
default and interval policies, SGLang's branch points, Baton's plans) over a stream that carries
each request's output (its attention KV is cached too, as vLLM caches decode blocks), its family
and its clock; requests before `score_from` warm the cache and the plans but are not scored, so a
plan is always judged on requests it has not seen.
"""
from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from baton.bench.checkpoint_retention import Arrival, Retention
from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.depth import PrefixDepthTracker
from baton.engine.checkpoints.policy import CheckpointPolicy


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained keys: key k names tokens [0, (k+1)·B) (full blocks only)."""
    keys: list[bytes] = []
    h = b""
    for k in range(len(tokens) // block_size):
        h = hashlib.blake2b(h + repr(tuple(tokens[k * block_size:(k + 1) * block_size])).encode(), digest_size=16).digest()
        keys.append(h)
    return keys


@dataclass(frozen=True)
class SimRequest:
    match: int
    hit: int
    prompt_len: int

    @property
    def recomputed(self) -> int:
        return self.match - self.hit


@dataclass(frozen=True)
class SimResult:
    strategy: str
    budget: int
    requests: tuple[SimRequest, ...]
    states_held: int  # states stored at the end (no eviction): what the engine's pool would hold
    planned_positions: int  # Σ over families of the final plan size

    @property
    def recomputed_tokens(self) -> int:
        return sum(r.recomputed for r in self.requests)

    @property
    def match_tokens(self) -> int:
        return sum(r.match for r in self.requests)


def simulate(cfg: CheckpointConfig, block_size: int, prompts: Sequence[Sequence[int]], times: Sequence[float] | None = None,
             output_len: int = 0) -> SimResult:
    return simulate_keyed(cfg, block_size, [(block_keys(t, block_size), len(t)) for t in prompts], times, output_len)


def simulate_keyed(cfg: CheckpointConfig, block_size: int, keyed: Sequence[tuple[list[bytes], int]], times: Sequence[float] | None = None,
                   output_len: int = 0) -> SimResult:
    """simulate() on prompts given as (block keys, prompt length). With `output_len` (tokens each
    request generates), a planned position the decode reaches (L < p ≤ L + output_len − 1) is held
    too — the engine keeps it — under a key of its own: no later prompt contains those outputs."""
    policy = CheckpointPolicy(cfg, block_size)
    tracker = PrefixDepthTracker(block_size, capacity=1 << 30)
    stored: set[Hashable] = set()
    out = []
    for i, (keys, L) in enumerate(keyed):
        match = tracker.observe(keys, L)
        m = match.depth
        hit = 0
        for k in range(m // block_size - 1, -1, -1):
            if keys[k] in stored:
                hit = (k + 1) * block_size
                break
        plan = policy.observe(keys[0] if keys else None, m, L, times[i] if times is not None else float(i), match.reached_tail)
        for p in plan.positions:
            if hit < p <= L:  # the prefill runs from the hit: only states past it are computed
                stored.add(keys[p // block_size - 1])
            elif max(hit, L) < p <= L + output_len - 1:
                stored.add(("decode", i, p))
        out.append(SimRequest(m, hit, L))
    policy.check_integrity()
    return SimResult(cfg.strategy, cfg.budget, tuple(out), len(stored), policy.held_positions())


def match_depths(block_size: int, keyed: Sequence[tuple[list[bytes], int]]) -> list[tuple[Hashable | None, int, int]]:
    """(family, match depth, prompt length) per request — the strategy-independent stream."""
    tracker = PrefixDepthTracker(block_size, capacity=1 << 30)
    return [(keys[0] if keys else None, tracker.match_and_add(keys, L), L) for keys, L in keyed]


def steady_state(cfg: CheckpointConfig, block_size: int, stream: Sequence[tuple[Hashable | None, int, int]]) -> tuple[int, int]:
    """(recomputed tokens, planned checkpoints) when each family's plan is made once from the
    whole stream's histogram and every planned state exists: Σ_requests (m − s(m)) — the paper's
    objective Σ_t p(t)·(t − s(t)) times the request count, evaluated exactly."""
    import numpy as np

    from baton.engine.checkpoints.policy import plan_for

    fams: dict[Hashable, list[tuple[int, int]]] = {}
    for fam, m, L in stream:
        if fam is not None:
            fams.setdefault(fam, []).append((m, L))
    recomputed, planned = 0, 0
    for rows in fams.values():
        length = max((L - 1) // block_size * block_size for _, L in rows)
        depths = np.array([m for m, _ in rows], dtype=np.int64)
        plan = plan_for(cfg, length, block_size, depths, np.ones(len(rows)))
        plan.check_integrity()
        recomputed += sum(plan.recomputed(m) for m, _ in rows)
        planned += len(plan.positions)
    return recomputed, planned


@dataclass(frozen=True)
class StreamRequest:
    """One request of a replayed stream: its computed tokens as chained block keys."""

    keys: tuple[bytes, ...]  # block_keys(prompt + output[:-1]): the full blocks whose KV is computed
    prompt_len: int
    output_len: int = 0
    family: Hashable | None = None  # conversation family (system prompt + first user message)
    now: float = 0.0

    @property
    def computed_len(self) -> int:
        return self.prompt_len + max(self.output_len - 1, 0)


@dataclass
class ReplayResult:
    """A rule replayed over a stream: hits of every request, scored on requests[score_from:]."""

    name: str
    requests: list[SimRequest] = field(default_factory=list)
    states_held: int = 0  # states stored at the end (no eviction)
    score_from: int = 0

    @property
    def scored(self) -> list[SimRequest]:
        return self.requests[self.score_from:]

    @property
    def recomputed_tokens(self) -> int:
        return sum(r.recomputed for r in self.scored)

    @property
    def match_tokens(self) -> int:
        return sum(r.match for r in self.scored)


def replay(rule: Retention, block_size: int, stream: Sequence[StreamRequest], score_from: int = 0) -> ReplayResult:
    """Request by request: match m (attention, dense), hit = deepest stored state ≤ m, then the
    rule's positions that this request's computation passes (hit < p ≤ computed) are stored."""
    tracker = PrefixDepthTracker(block_size, capacity=1 << 30)
    stored: set[Hashable] = set()
    out = ReplayResult(rule.name, score_from=score_from)
    for req in stream:
        keys = req.keys
        match = tracker.observe(keys, req.prompt_len)
        m = match.depth
        hit = 0
        for k in range(m // block_size - 1, -1, -1):
            if keys[k] in stored:
                hit = (k + 1) * block_size
                break
        a = Arrival(keys, req.prompt_len, req.computed_len, m, hit, req.family, req.now, match.reached_tail)
        for p in rule.keep(a):
            if p > 0 and p % block_size == 0 and hit < p <= min(req.computed_len, len(keys) * block_size):
                stored.add(keys[p // block_size - 1])
        out.requests.append(SimRequest(m, hit, req.prompt_len))
    out.states_held = len(stored)
    return out
