"""Exact replay of the enforced policy over a request stream, without an engine.

Models what CheckpointScheduler + vLLM do, request by request (sequential, no eviction):
  1. match depth m = longest block prefix shared with any earlier prompt, capped at the replay
     boundary ⌊(L−1)/B⌋·B (PrefixDepthTracker, as the scheduler computes it);
  2. hit = deepest *stored* state on this prompt's own prefix at or below m (states are keyed by the
     chained block key, as vLLM keys them), 0 if none; recomputed = m − hit;
  3. the policy observes m (and may re-solve the family's plan);
  4. the prompt's prefill stores a state at every planned position p ≤ L.
The e2e test checks this model against the real engine request by request; the benchmark uses it
to count recomputed tokens and held states for every strategy and budget.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Hashable, Sequence

from engine.checkpoints.config import CheckpointConfig
from engine.checkpoints.depth import PrefixDepthTracker
from engine.checkpoints.policy import CheckpointPolicy


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


def simulate(cfg: CheckpointConfig, block_size: int, prompts: Sequence[Sequence[int]], times: Sequence[float] | None = None) -> SimResult:
    policy = CheckpointPolicy(cfg, block_size)
    tracker = PrefixDepthTracker(block_size, capacity=1 << 30)
    stored: set[Hashable] = set()
    out = []
    for i, tokens in enumerate(prompts):
        keys = block_keys(tokens, block_size)
        L = len(tokens)
        m = tracker.match_and_add(keys, L)
        hit = 0
        for k in range(m // block_size - 1, -1, -1):
            if keys[k] in stored:
                hit = (k + 1) * block_size
                break
        plan = policy.observe(keys[0] if keys else None, m, L, times[i] if times is not None else float(i))
        for p in plan.positions:
            if p <= L:
                stored.add(keys[p // block_size - 1])
        out.append(SimRequest(m, hit, L))
    policy.check_integrity()
    return SimResult(cfg.strategy, cfg.budget, tuple(out), len(stored), policy.held_positions())
