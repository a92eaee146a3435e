"""baton/sim/engine.py: the DES engine steps exactly as baton/engine/simulated's engine does
(same scheduler, same batches, same step times), only in simulated time."""
from types import SimpleNamespace

import pytest
import simpy

from baton.engine.simulated.blocks import BlockPool
from baton.engine.simulated.engine import SimulatedEngine
from baton.engine.simulated.kv_cache import KVCacheManager
from baton.engine.simulated.scheduler import Scheduler, SchedulerLimits
from baton.engine.simulated.timing import StepBatch, StepTime
from baton.sim.engine import INJECT, DesEngine, EngineShape

SHAPE = EngineShape(gpu="fake", kv_capacity_tokens=4096, bytes_per_token=1000, link_gbps=8.0, inject_gbps=80.0, block_size=16,
                    max_num_seqs=4, max_num_batched_tokens=256, max_model_len=2048)
REQUESTS = [("a", list(range(100, 400)), 5), ("b", list(range(100, 260)), 7), ("c", list(range(900, 1500)), 3),
            ("d", list(range(2000, 2050)), 9), ("e", list(range(100, 420)), 4)]


class FakeTimer:
    def __init__(self):
        self.batches = []

    def step_time(self, batch: StepBatch) -> StepTime:
        self.batches.append(batch)
        tokens = sum(c.new_tokens for c in batch.prefills) + len(batch.decode_contexts)
        return StepTime(1e-3 + 1e-5 * tokens + 1e-7 * sum(batch.decode_contexts), "fake")


def reference_run():
    now = [0.0]
    sched = Scheduler(SchedulerLimits(4, 256, 2048), KVCacheManager(BlockPool(4096 // 16 + 1, 16), 2048), clock=lambda: now[0])
    timer = FakeTimer()
    engine = SimulatedEngine(sched, timer, sleep=lambda s: now.__setitem__(0, now[0] + s))
    for rid, tokens, n in REQUESTS:
        engine.add_request(rid, {"prompt_token_ids": tokens}, SimpleNamespace(max_tokens=n, extra_args=None, logprobs=None))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = now[0]
    return finished, timer.batches, engine.busy_seconds


def test_the_des_engine_runs_the_same_steps_as_the_simulated_engine():
    want_finish, want_batches, want_busy = reference_run()
    env = simpy.Environment()
    timer = FakeTimer()
    engine = DesEngine(env, "d0", "decode", SHAPE, timer)
    done = {rid: engine.submit(rid, tokens, n) for rid, tokens, n in REQUESTS}
    env.run(until=env.all_of(list(done.values())))
    assert timer.batches == want_batches
    assert engine.busy_s == pytest.approx(want_busy)
    for rid, event in done.items():
        out = event.value
        assert out.last_token_at == pytest.approx(want_finish[rid])
        assert out.tokens == dict((r, n) for r, _, n in REQUESTS)[rid]
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.block_pool.get_usage() == 0.0


def test_kv_coming_in_is_timed_by_its_link_and_counted_by_kind():
    env = simpy.Environment()
    engine = DesEngine(env, "d0", "decode", SHAPE, FakeTimer())
    pd = engine.submit("pd", list(range(320)), 2, {"do_remote_prefill": True, "remote_engine_id": "p0"})
    env.run(until=pd)
    blocks = 320 // 16
    transfer = blocks * 16 * 1000 * 8 / 8e9
    assert engine.handoff.bytes_in == {"pd": blocks * 16 * 1000, INJECT: 0} and engine.handoff.transfers_in == 1
    assert pd.value.first_token_at >= transfer
    inj = engine.submit("inj", list(range(5000, 5320)), 2, {"do_remote_prefill": True, "transfer_mode": INJECT})
    env.run(until=inj)
    assert engine.handoff.bytes_in[INJECT] == blocks * 16 * 1000 and engine.handoff.transfers_in == 1
    engine.scheduler.check_integrity()


def test_the_report_shows_queued_prefill_and_capacity():
    env = simpy.Environment()
    engine = DesEngine(env, "d0", "decode", SHAPE, FakeTimer())
    engine.submit("a", list(range(300)), 4)
    r = engine.report()
    assert (r.pool, r.in_flight, r.num_waiting, r.pending_prefill_tokens, r.kv_capacity_tokens) == ("decode", 1, 1, 300, 4096)


def test_the_report_lists_the_conversations_whose_turns_arrived_since_the_last_one():
    env = simpy.Environment()
    engine = DesEngine(env, "d0", "decode", SHAPE, FakeTimer())
    engine.submit("a1", list(range(30)), 2, session_id="a")
    engine.submit("x", list(range(30)), 2)  # no conversation: nothing to list
    assert [sid for sid, _ in engine.report().conversations] == ["a"]
    engine.submit("b1", list(range(30)), 2, session_id="b")
    assert [sid for sid, _ in engine.report().conversations] == ["b"]
    assert engine.report().conversations == ()
