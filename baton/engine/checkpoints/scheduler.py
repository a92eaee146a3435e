"""The one vLLM seam for sparse recurrent checkpoints (vLLM 0.32, `mamba_cache_mode="align"`).

Configured, not patched: `SchedulerConfig.scheduler_cls = "baton.engine.checkpoints.scheduler.CheckpointScheduler"`
and the CheckpointConfig under `additional_config["baton_checkpoints"]` (baton/engine/args.py sets both).
A recurrent state exists only where a prefill chunk ends, and is kept only where the Mamba
manager's mask says so, hence the hooks — all of them named in HOOKED (tests/unit/test_checkpoint_seam.py
fails loudly when an upgrade moves one):

  what is observed  Scheduler._get_local_prefix_cache_hit → the request's match depth (from its
                    chained block hashes, independent of what is kept) feeds the family histogram;
                    vLLM's shared-prefix junction is dropped (the plan decides every kept state),
                    and the hit is never reported divergent, so with a KV connector (NIXL) vLLM's
                    `hit_diverged` fallback never re-runs get_computed_blocks to restore it.
  what is computed  Scheduler._mamba_block_aligned_split → chunks also end at planned positions.
  what is kept      MambaManager.reachable_block_mask (still a classmethod: connectors call it on
                    the class) keeps a state block iff the plan of the request being cached holds
                    its end position; MambaManager._cache_partial_tail_block (which registers the
                    prompt-tail state without consulting the mask) is gated by the same plan.

The managers are switched to PlannedMambaManager by class assignment in __init__ (registering a
second manager for MambaSpec fails with "Conflicting registration"). Everything else — allocation,
eviction, attention KV — is vLLM's. A request resumes from the deepest kept state ≤ its match and
recomputes the rest, so outputs are vLLM's own prefix-cache-exact outputs.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.core.kv_cache_utils import get_group_id
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.depth import PrefixDepthTracker
from baton.engine.checkpoints.plan import CheckpointPlan
from baton.engine.checkpoints.policy import CheckpointPolicy

CONFIG_KEY = "baton_checkpoints"
SCHEDULER_CLS = "baton.engine.checkpoints.scheduler.CheckpointScheduler"

# (class, method) pairs this module overrides, and the parameters it relies on.
HOOKED: dict[tuple[type, str], tuple[str, ...]] = {
    (Scheduler, "_get_local_prefix_cache_hit"): ("self", "request"),
    (Scheduler, "_mamba_block_aligned_split"): ("self", "request", "num_new_tokens", "num_new_local_computed_tokens", "num_external_computed_tokens"),
    (MambaManager, "reachable_block_mask"): ("start_block", "end_block", "alignment_tokens", "kv_cache_spec", "use_eagle", "retention_interval",
                                             "reachable_boundaries", "dcp_world_size", "final_segment_end_block"),
    (MambaManager, "cache_blocks"): ("self", "request", "num_tokens", "retention_interval", "replay_boundaries"),
    (MambaManager, "_cache_partial_tail_block"): ("self", "request", "num_tokens", "retention_interval"),
}


@dataclass(frozen=True)
class CheckpointMetrics:
    """What an engine reports about its recurrent checkpoints (cumulative counters + current holdings)."""

    strategy: str
    requests: int
    families: int
    planned_positions: int  # Σ over families of the plan size
    checkpoints_held: int  # recurrent-state blocks currently in the prefix cache
    state_bytes: int  # checkpoints_held × bytes of one state block (all Mamba groups)
    match_tokens: int  # Σ match depth (what could be reused with every state kept)
    hit_tokens: int  # Σ hit depth (what was reused)
    recomputed_tokens: int  # match − hit
    last_hit_depths: tuple[int, ...]


class PlannedMambaManager(MambaManager):
    """MambaManager whose kept states are the plan's positions. Subclassed per engine (`owner`)."""

    owner: ClassVar[Any] = None
    _active_plan: ClassVar[CheckpointPlan | None] = None  # plan of the request inside cache_blocks

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None, *, replay_boundaries: Sequence[int]) -> None:
        cls = type(self)
        cls._active_plan = cls.owner.plan_for(request)
        try:
            super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)
        finally:
            cls._active_plan = None

    @classmethod
    def reachable_block_mask(  # type: ignore[override]
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: Any,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Block i (state after (i+1)·B tokens) is kept iff the active plan holds (i+1)·B."""
        plan = cls._active_plan
        if plan is None:  # called outside a planned cache_blocks (e.g. by a connector): vLLM's rule
            return super().reachable_block_mask(
                start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
                retention_interval=retention_interval, reachable_boundaries=reachable_boundaries,
                dcp_world_size=dcp_world_size, final_segment_end_block=final_segment_end_block,
            )
        bs = kv_cache_spec.block_size
        return [plan.holds((b + 1) * bs) for b in range(start_block, end_block)]

    def _cache_partial_tail_block(self, request: Any, num_tokens: int, retention_interval: int | None) -> Any:
        plan = type(self).owner.plan_for(request)
        checkpoint = self._checkpoints.get(request.request_id)
        position = checkpoint[0] if checkpoint is not None else num_tokens
        if plan.holds(position):
            return super()._cache_partial_tail_block(request, num_tokens, retention_interval)
        if checkpoint is not None:  # as vLLM does for a transient checkpoint: not reusable
            self.block_pool._maybe_evict_cached_block(self.req_to_blocks[request.request_id][checkpoint[1]])
        return None


class CheckpointScheduler(Scheduler):
    """vLLM's Scheduler with recurrent states kept (and chunks ended) only at planned positions."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        cfg = CheckpointConfig.model_validate((vllm_config.additional_config or {}).get(CONFIG_KEY, {}))
        self.ckpt_block = self.cache_config.block_size
        self.checkpoint_policy = CheckpointPolicy(cfg, self.ckpt_block)
        self._depths = PrefixDepthTracker(self.ckpt_block)
        self._observed: OrderedDict[str, int] = OrderedDict()
        self._clock = time.monotonic
        manager_cls = type("PlannedMambaManager", (PlannedMambaManager,), {"owner": self})
        self._mamba_groups: list[int] = []
        self._state_block_bytes = 0
        for gid, manager in enumerate(self.kv_cache_manager.coordinator.single_type_managers):
            if type(manager) is MambaManager:
                manager.__class__ = manager_cls
                self._mamba_groups.append(gid)
                self._state_block_bytes += manager.kv_cache_spec.page_size_bytes
        if not self._mamba_groups:
            raise ValueError("checkpoints need a hybrid model (no Mamba/conv state group in this engine)")

    # ---- what is observed
    def _block_keys(self, request: Any) -> list[Hashable]:
        """Chained hashes at checkpoint-block granularity: key k names tokens [0, (k+1)·B)."""
        hashes = request.block_hashes
        r = max(self.ckpt_block // self.hash_block_size, 1)
        return [hashes[(k + 1) * r - 1] for k in range(len(hashes) // r)]

    def family_of(self, request: Any) -> Hashable | None:
        keys = self._block_keys(request)
        return keys[0] if keys else None

    def plan_for(self, request: Any) -> CheckpointPlan:
        return self.checkpoint_policy.plan(self.family_of(request))

    def _get_local_prefix_cache_hit(self, request: Any) -> Any:
        """The local hit every KV cache group agrees on, never a divergent one.

        With a connector that restores lagging recurrent state (NIXL: supports_divergent_local_hybrid_hits),
        vLLM's own version reports the full-attention hit even where no kept state backs it, and
        when the connector then finds nothing to load it re-runs get_computed_blocks, which sets
        the shared-prefix junction again — a state the plan did not choose. Taking the agreed
        boundary here (what vLLM does for every other connector) means that path never runs: the
        connector sees the shallower hit and loads from there (a remote prefill moves a little
        more), and every kept state stays the plan's."""
        blocks, num_local, _junction = self.kv_cache_manager.get_computed_blocks(request)
        if request.request_id not in self._observed:
            keys = self._block_keys(request)
            match = self._depths.observe(keys, request.num_prompt_tokens)
            depth = match.depth
            self.checkpoint_policy.observe(keys[0] if keys else None, depth, request.num_prompt_tokens, self._clock(), match.reached_tail)
            self.checkpoint_policy.record_hit(depth, num_local)
            self._observed[request.request_id] = depth
            while len(self._observed) > 4096:
                self._observed.popitem(last=False)
        # the plan decides every kept state: no extra state at vLLM's shared-prefix junction
        return blocks, num_local, 0, False

    # ---- what is computed
    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        n = super()._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        stop = self.plan_for(request).next_after(start)
        if stop is not None and start < stop < start + n and stop < request.num_prompt_tokens:
            return stop - start
        return n

    # ---- metrics
    def checkpoint_metrics(self) -> CheckpointMetrics:
        groups = set(self._mamba_groups)
        pool = self.kv_cache_manager.coordinator.block_pool
        held = 0
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            if get_group_id(key) in groups:
                held += 1 if not isinstance(blocks, dict) else len(blocks)
        held //= max(len(groups), 1)
        c = self.checkpoint_policy.counters
        return CheckpointMetrics(
            strategy=self.checkpoint_policy.cfg.strategy,
            requests=c.requests,
            families=len(self.checkpoint_policy.families),
            planned_positions=self.checkpoint_policy.held_positions(),
            checkpoints_held=held,
            state_bytes=held * self._state_block_bytes,
            match_tokens=c.match_tokens,
            hit_tokens=c.hit_tokens,
            recomputed_tokens=c.recomputed_tokens,
            last_hit_depths=tuple(c.hit_depths[-64:]),
        )


