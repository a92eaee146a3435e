"""vLLM's own v1 Scheduler on CPU, without a model, next to the simulated engine's (tests/unit/test_simulated_scheduler.py).

Built as vLLM's tests build it (tests/v1/core/utils.py create_scheduler): a VllmConfig over the
local SmolLM2 folder (only its config.json is read), one full-attention KV cache group of
`num_blocks` blocks, no KV connector. Both schedulers are then driven the same way: schedule, and
every request whose computed tokens reached its length samples the same placeholder token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from baton.engine.simulated.blocks import BlockPool
from baton.engine.simulated.kv_cache import KVCacheManager
from baton.engine.simulated.outputs import placeholder_token
from baton.engine.simulated.request import SimRequest
from baton.engine.simulated.scheduler import Scheduler, SchedulerLimits

MODEL_DIR = Path(__file__).resolve().parents[2] / ".cache" / "models" / "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Setup:
    num_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    max_model_len: int = 1024


@dataclass
class StepView:
    """What one step did, as both schedulers can report it."""

    scheduled: dict[str, int]
    admitted_hits: dict[str, int]  # newly admitted request -> its computed (prefix-hit) tokens
    preempted: set[str]
    free_blocks: int
    finished: set[str] = field(default_factory=set)


class VllmTwin:
    def __init__(self, s: Setup):
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        sc = SchedulerConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                             max_model_len=s.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False)
        mc = ModelConfig(model=str(MODEL_DIR), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=s.max_model_len)
        cc = CacheConfig(block_size=s.block_size, enable_prefix_caching=True)
        vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc)
        spec = FullAttentionSpec(block_size=s.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kcc = KVCacheConfig(num_blocks=s.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        cc.num_gpu_blocks = s.num_blocks
        self.sched = VllmScheduler(vllm_config=vc, kv_cache_config=kcc, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(vc), block_size=s.block_size)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(s.block_size, hash_fn)

    def add(self, rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sched.add_request(Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
                                       block_hasher=self._hasher, cache_salt=salt))

    def step(self) -> StepView:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            req = self.sched.requests[rid]
            sampled.append([placeholder_token(len(req.output_token_ids))] if req.num_computed_tokens >= req.num_tokens else [])
        view = StepView(dict(out.num_scheduled_tokens), {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs},
                        set(out.preempted_req_ids or ()), 0)
        cached = out.scheduled_cached_reqs  # the v1 runner lists resumed (preempted) requests here
        view.admitted_hits.update({rid: n for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
                                   if rid in cached.resumed_req_ids})
        result = self.sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                                      sampled_token_ids=sampled))
        view.finished = {o.request_id for v in result.values() for o in v.outputs if o.finish_reason is not None}
        view.free_blocks = self.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        return view

    def busy(self) -> bool:
        return self.sched.has_requests()


class SimTwin:
    def __init__(self, s: Setup):
        pool = BlockPool(s.num_blocks, s.block_size)
        limits = SchedulerLimits(s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len)
        self.sched = Scheduler(limits, KVCacheManager(pool, s.max_model_len))
        self.block_size = s.block_size

    def add(self, rid: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> None:
        self.sched.add_request(SimRequest(rid, list(prompt), max_tokens, self.block_size, cache_salt=salt))

    def step(self) -> StepView:
        step = self.sched.schedule()
        admitted = {rid: step.computed_before[rid] for rid in step.admitted}
        events = self.sched.update_from_output(step, lambda r: placeholder_token(len(r.output_token_ids)))
        self.sched.check_integrity()
        return StepView(dict(step.num_scheduled_tokens), admitted, set(step.preempted),
                        self.sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                        {e.request.request_id for e in events if e.finish_reason is not None})

    def busy(self) -> bool:
        return self.sched.has_requests()
