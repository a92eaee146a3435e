"""The simulated scheduler (baton/engine/simulated/scheduler.py) step for step against vLLM's own v1
Scheduler, built on CPU without a model (tests/unit/vllm_scheduler_twin.py), for the same request
mixes: per step the same tokens scheduled per request, the same prefix hits at admission, the same
preemptions, the same free blocks, the same requests finished. The simulated pool's integrity is
checked after every step, and at the end every block is free again (vLLM's own tests' invariant).

vLLM's scheduler takes ~0.3 s to build (after the vLLM import the unit suite pays anyway), so each
scenario builds one; the simulated side runs in milliseconds.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest

from baton.engine.simulated.blocks import BlockPool, block_hashes
from baton.engine.simulated.kv_cache import KVCacheManager
from baton.engine.simulated.request import SimRequest
from baton.engine.simulated.scheduler import Scheduler, SchedulerLimits
from tests.unit.vllm_scheduler_twin import MODEL_DIR, Setup, SimTwin, StepView, VllmTwin

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="needs .cache/models/SmolLM2 (make setup)")

Arrivals = dict[int, list[tuple[str, list[int], int, str | None]]]  # step -> (id, prompt, max_tokens, salt)

SYSTEM = list(range(100, 148))  # 48 tokens: three full blocks of 16 shared by every conversation


def run_both(setup: Setup, arrivals: Arrivals, max_steps: int = 400) -> list[tuple[StepView, StepView]]:
    vllm, sim = VllmTwin(setup), SimTwin(setup)
    steps: list[tuple[StepView, StepView]] = []
    for i in range(max_steps):
        for rid, prompt, max_tokens, salt in arrivals.get(i, []):
            vllm.add(rid, prompt, max_tokens, salt)
            sim.add(rid, prompt, max_tokens, salt)
        if not vllm.busy() and not sim.busy() and i > max(arrivals):
            break
        a, b = vllm.step(), sim.step()
        steps.append((a, b))
        assert b.scheduled == a.scheduled, f"step {i}: scheduled tokens differ"
        assert b.admitted_hits == a.admitted_hits, f"step {i}: prefix hits at admission differ"
        assert b.preempted == a.preempted, f"step {i}: preemptions differ"
        assert b.free_blocks == a.free_blocks, f"step {i}: free blocks differ"
        assert b.finished == a.finished, f"step {i}: finished requests differ"
    assert not vllm.busy() and not sim.busy(), "requests left after max_steps"
    assert sim.sched.kv_cache_manager.block_pool.get_num_free_blocks() == setup.num_blocks - 1  # all back, but the null block
    return steps


def conversation(i: int, unique: int) -> list[int]:
    return SYSTEM + [1000 + i] * unique


def test_shared_prefixes_under_chunked_prefill_match_vllm() -> None:
    arrivals: Arrivals = {
        0: [("a", conversation(0, 30), 6, None), ("b", conversation(1, 45), 4, None)],
        3: [("c", conversation(2, 20), 8, None), ("d", conversation(3, 70), 3, None)],
        7: [("e", conversation(4, 10), 5, None), ("f", conversation(0, 30), 2, None)],  # f repeats a's prompt
    }
    steps = run_both(Setup(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64), arrivals)
    hits = {rid: n for _, sim in steps for rid, n in sim.admitted_hits.items()}
    assert hits["b"] == 48 and hits["f"] >= 64  # the system prompt, and a's whole prompt (its blocks were cached)
    assert max(sum(s.scheduled.values()) for _, s in steps) == 64  # the budget binds: prefills were chunked


def test_preemption_and_eviction_under_block_pressure_match_vllm() -> None:
    arrivals: Arrivals = {0: [(f"r{i}", conversation(i, 40), 40, None) for i in range(5)], 12: [("late", conversation(9, 60), 10, None)]}
    steps = run_both(Setup(num_blocks=24, max_num_seqs=5, max_num_batched_tokens=96), arrivals)
    assert any(sim.preempted for _, sim in steps), "the scenario must preempt"


def test_a_repeated_prompt_hits_the_freed_cache_and_lru_eviction_matches_vllm() -> None:
    arrivals: Arrivals = {0: [("first", conversation(0, 64), 4, None)], 10: [("filler", conversation(5, 150), 4, None)],
                          25: [("again", conversation(0, 64), 4, None)]}
    run_both(Setup(num_blocks=20, max_num_seqs=2, max_num_batched_tokens=128), arrivals)


def test_a_waiting_prompt_is_admitted_only_when_all_of_it_fits_as_in_vllm() -> None:
    """vLLM's scheduler_reserve_full_isl: the first chunk alone would fit, the whole prompt does not yet."""
    arrivals: Arrivals = {0: [("holder", conversation(0, 42), 30, None)], 3: [("long", list(range(5000, 5108)), 2, None)]}
    steps = run_both(Setup(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=32), arrivals)
    admitted_at = next(i for i, (_, sim) in enumerate(steps) if "long" in sim.admitted_hits)
    assert admitted_at > 4, "the long prompt must wait for the holder's blocks"


def test_cache_salts_separate_prefixes_as_in_vllm() -> None:
    arrivals: Arrivals = {0: [("alice", conversation(0, 20), 2, "alice")], 4: [("bob", conversation(0, 20), 2, "bob"),
                                                                               ("alice2", conversation(0, 20), 2, "alice")]}
    steps = run_both(Setup(), arrivals)
    hits = {rid: n for _, sim in steps for rid, n in sim.admitted_hits.items()}
    assert hits["bob"] == 0 and hits["alice2"] == 64


def test_decode_blocks_enter_the_cache_as_they_fill() -> None:
    arrivals: Arrivals = {0: [("long", conversation(0, 8), 40, None)], 60: [("reuse", conversation(0, 8) + [0] * 40, 1, None)]}
    run_both(Setup(max_num_batched_tokens=256), arrivals)


# ---- the simulated side alone: integrity and no-room as values ---------------------------------------------------


def small_scheduler(num_blocks: int = 8, max_model_len: int = 256) -> Scheduler:
    return Scheduler(SchedulerLimits(4, 64, max_model_len), KVCacheManager(BlockPool(num_blocks, 16), max_model_len))


def drive(sched: Scheduler, check: Callable[[], None], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not sched.has_requests():
            return
        step = sched.schedule()
        check()
        sched.update_from_output(step, lambda r: 7)
        check()
    raise AssertionError("did not drain")


def test_block_pool_integrity_holds_through_hits_preemption_and_aborts() -> None:
    sched = small_scheduler(num_blocks=10)
    for i in range(4):
        sched.add_request(SimRequest(f"r{i}", conversation(i % 2, 24), 30, 16))
    sched.schedule()
    sched.check_integrity()
    sched.finish_requests("r1")  # abort mid-flight
    sched.check_integrity()
    drive(sched, sched.check_integrity)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and pool.get_usage() == 0.0
    assert pool.cached_block_hash_to_block  # freed blocks stay cached for the next hit


def test_check_integrity_catches_a_leaked_reference() -> None:
    sched = small_scheduler()
    sched.add_request(SimRequest("r", conversation(0, 8), 2, 16))
    sched.schedule()
    sched.kv_cache_manager.req_to_blocks["r"][0].ref_cnt += 1
    with pytest.raises(AssertionError):
        sched.check_integrity()


def test_allocation_that_does_not_fit_is_none_and_changes_nothing() -> None:
    kv = KVCacheManager(BlockPool(4, 16), 1024)  # 3 usable blocks
    req = SimRequest("big", list(range(100)), 1, 16)
    assert kv.allocate_slots(req, 100) is None
    assert kv.block_pool.get_num_free_blocks() == 3 and "big" not in kv.req_to_blocks
    kv.block_pool.check_integrity()


def test_chained_hashes_make_a_block_hit_mean_its_whole_prefix_matches() -> None:
    a = block_hashes([1] * 32 + [2] * 16, 16)
    b = block_hashes([3] * 16 + [1] * 16 + [2] * 16, 16)
    assert a[2] != b[2]  # same last block, different prefix
    assert block_hashes([1] * 16, 16, salt="x") != block_hashes([1] * 16, 16)


def test_a_request_at_max_model_len_finishes_with_length() -> None:
    sched = small_scheduler(num_blocks=20, max_model_len=40)
    sched.add_request(SimRequest("r", list(range(30)), 1000, 16))
    reasons = []
    while sched.has_requests():
        step = sched.schedule()
        reasons += [e.finish_reason for e in sched.update_from_output(step, lambda r: 7) if e.finish_reason]
    assert reasons == ["length"]
