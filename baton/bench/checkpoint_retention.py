"""What each compared strategy keeps of a hybrid model's recurrent state, request by request (pure).

A retention rule sees one request when it is scheduled (an `Arrival`: its attention match depth,
the deepest kept state at or below it, its lengths, its family, the clock) and answers the token
positions whose state that request's computation keeps. The replay (checkpoint_sim.replay) stores
only those the computation passes — hit < p ≤ computed length, p a positive block multiple — and
keys each state by the chained block key, as vLLM does. Attention KV is dense in every rule.

Rules, and where each one's facts come from:

vllm_default   vLLM 0.32's default hybrid prefix cache (`mamba_cache_mode="align"`,
               `prefix_cache_retention_interval=0` — config/cache.py: "0 retains only semantic
               checkpoints, including the latest replay boundary and shared-prefix junctions").
               Read in vllm/v1/core/single_type_kv_cache_manager.py `MambaManager.cache_blocks` /
               `reachable_block_mask` (retention 0 → keep only the `reachable_boundaries` states) and
               vllm/v1/core/kv_cache_coordinator.py `replay_boundaries` (without EAGLE:
               (num_prompt_tokens − 1,), floored to the block) and
               `HybridKVCacheCoordinator.find_longest_cache_hit` + kv_cache_manager.py
               `get_computed_blocks` (junction = the attention hit when it is longer than the Mamba
               hit: `shared_prefix_boundary = hit + num_uncached`). `Scheduler._mamba_block_aligned_split`
               (v1/core/sched/scheduler.py) ends a prefill chunk at both (`last_cache_position` =
               v1/kv_cache_interface.py `get_mamba_prefill_checkpoint_position`, and `junction_stop`),
               so both states exist. Per request: the state at ⌊(L−1)/B⌋·B, and the
               state at the match depth m when m > hit. `enable_mamba_shared_prefix_checkpoint` (off
               by default) only moves the junction for EAGLE groups, so it plays no part here.
vllm_interval  the same with `prefix_cache_retention_interval=N`: `reachable_block_mask` also keeps
               every block ending on a multiple of N (N ≤ B: every block), but a state exists only
               where a chunk ends — prefill chunks end every `chunk` tokens (floored to the block),
               at the replay boundary and at the junction; decode ends one at every block boundary.
               So "as vLLM runs it" keeps k·N only where a chunk ends there. `chunk` defaults to 8192,
               vLLM's OpenAI-server `max_num_batched_tokens` on H100/H200 (engine/arg_utils.py
               `get_batch_defaults`); a request alone in the engine gets the whole budget.
branch_points  SGLang's MambaRadixCache (sgl-project/sglang python/sglang/srt/mem_cache/
               mamba_radix_cache.py, read through the code index): `cache_finished_req` inserts a
               finished request's state at the end of its committed tokens (prompt + output, the
               tree's leaf), and `MatchResult.mamba_branching_seqlen` — "the longest page-aligned
               position that could've been cache hit if there exists a mamba state" — makes the
               prefill keep the state where the request leaves the cached path (m > hit): the tree's
               branch point. Per request: the leaf ⌊computed/B⌋·B and the branch point m when m > hit.
planned        Baton's CheckpointPolicy (dp, none, block_dense, uniform, balanced, sqrt, dyadic): the
               positions of the family's plan after observing this request's depth, per family, with
               the family keyed by the first block (as the engine does) or by the conversation
               (system prompt + first user message, `StreamRequest.family`).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.policy import CheckpointPolicy

VLLM_H100_CHUNK = 8192  # vLLM's max_num_batched_tokens for the OpenAI server on H100/H200
FamilyKeying = Literal["first_block", "conversation"]


@dataclass(frozen=True)
class Arrival:
    """One request as a retention rule sees it when it is scheduled (positions in tokens)."""

    keys: Sequence[Hashable]  # chained block keys of its computed tokens (prompt + output)
    prompt_len: int
    computed_len: int  # tokens whose KV and state get computed: prompt + output − 1
    match: int  # attention prefix match, block multiple, ≤ the replay boundary
    hit: int  # deepest kept state ≤ match: where its prefill resumes
    conversation: Hashable | None  # its conversation family key (None: not known)
    now: float
    reached_tail: int | None = None  # deepest earlier prompt's replay boundary on its matched chain


class Retention(Protocol):
    name: str

    def keep(self, a: Arrival) -> Iterable[int]:
        """Positions whose state this request's computation keeps (the replay filters them)."""
        ...


def replay_boundary(prompt_len: int, block_size: int) -> int:
    """⌊(L−1)/B⌋·B: the deepest position a resend of this prompt can resume at."""
    return max(prompt_len - 1, 0) // block_size * block_size


@dataclass
class VllmDefault:
    block_size: int
    name: str = "vllm_default"

    def keep(self, a: Arrival) -> list[int]:
        out = [replay_boundary(a.prompt_len, self.block_size)]
        if a.match > a.hit:  # the shared-prefix junction (Marconi-style), block-floored
            out.append(a.match // self.block_size * self.block_size)
        return out


@dataclass
class VllmInterval:
    block_size: int
    interval: int
    chunk: int = VLLM_H100_CHUNK
    name: str = "vllm_interval"

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.interval % self.block_size:  # as vLLM validates it
            raise ValueError(f"interval {self.interval} must be a positive multiple of the block size {self.block_size}")

    def chunk_ends(self, a: Arrival) -> list[int]:
        """Where the prefill's chunks end, from the hit to the prompt's end (vLLM's split)."""
        B = self.block_size
        stops = sorted({p for p in (replay_boundary(a.prompt_len, B), a.match if a.match > a.hit else 0) if a.hit < p < a.prompt_len})
        ends, s = [], a.hit
        while s < a.prompt_len:
            e = s + self.chunk
            if e < a.prompt_len and e // B * B > s:
                e = e // B * B
            nxt = next((p for p in stops if p > s), None)
            e = min(e, a.prompt_len, nxt if nxt is not None else a.prompt_len)
            ends.append(e)
            s = e
        return ends

    def keep(self, a: Arrival) -> list[int]:
        B = self.block_size
        out = VllmDefault(B).keep(a)
        states = [e for e in self.chunk_ends(a) if e % B == 0]  # prefill states exist at chunk ends
        states += range((a.prompt_len // B + 1) * B, a.computed_len + 1, B)  # decode: every block end
        step = self.interval if self.interval > B else B
        out += [p for p in states if p % step == 0]
        return out


@dataclass
class BranchPoints:
    block_size: int
    name: str = "branch_points"

    def keep(self, a: Arrival) -> list[int]:
        out = [a.computed_len // self.block_size * self.block_size]  # the leaf: end of committed tokens
        if a.match > a.hit:  # the branch point: where it leaves the cached path without a state
            out.append(a.match // self.block_size * self.block_size)
        return out


class Planned:
    """Baton's per-family plans (the engine's CheckpointPolicy) as a retention rule."""

    def __init__(self, cfg: CheckpointConfig, block_size: int, family: FamilyKeying = "first_block", name: str | None = None) -> None:
        self.cfg = cfg
        self.family = family
        self.policy = CheckpointPolicy(cfg, block_size)
        self.name = name or cfg.strategy

    def family_of(self, a: Arrival) -> Hashable | None:
        if not a.keys:
            return None  # shorter than one block: no family, no checkpoints (as the engine)
        return a.conversation if self.family == "conversation" and a.conversation is not None else a.keys[0]

    def keep(self, a: Arrival) -> tuple[int, ...]:
        return self.policy.observe(self.family_of(a), a.match, a.prompt_len, a.now, a.reached_tail).positions

    def frozen_modes(self) -> int:
        return sum(len(st.histogram.frozen) for st in self.policy.families.values())
