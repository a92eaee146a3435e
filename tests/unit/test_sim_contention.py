"""baton/sim/contention.py: engines of one machine slow each other; the DES engine and the fleet
apply it only when they share a host."""

import pytest
import simpy

from baton.engine.simulated.timing import StepBatch, StepTime
from baton.sim.contention import SharedHost, slowdown
from baton.sim.engine import DesEngine, EngineShape
from baton.sim.fleet import Fleet, PoolSpec

SHAPE = EngineShape(gpu="fake", kv_capacity_tokens=4096, bytes_per_token=1000, link_gbps=8.0, inject_gbps=80.0, block_size=16,
                    max_num_seqs=4, max_num_batched_tokens=256, max_model_len=2048)


class FixedTimer:
    """Every step takes 10 ms, whatever its batch."""

    def step_time(self, batch: StepBatch) -> StepTime:
        return StepTime(0.010, "fixed")


def test_a_host_counts_only_other_engines_in_a_step():
    host = SharedHost(0.25)
    assert host.begin("a") == 1.0  # alone
    assert host.begin("b") == 1.25  # a is in a step
    assert host.begin("a") == 1.25  # a's own step does not slow a
    assert host.begin("c") == 1.5
    host.end("a")
    host.end("b")
    host.end("b")  # ending twice is harmless
    assert host.busy == {"c"}
    assert slowdown(0.0, 7) == 1.0


@pytest.mark.parametrize("bad", [-0.1, float("nan")])
def test_a_negative_or_nan_contention_is_refused(bad: float):
    with pytest.raises(ValueError, match=">= 0"):
        SharedHost(bad)


def _finish_time(host_a: SharedHost | None, host_b: SharedHost | None, both: bool) -> float:
    env = simpy.Environment()
    a = DesEngine(env, "a", "decode", SHAPE, FixedTimer(), host_a)
    b = DesEngine(env, "b", "decode", SHAPE, FixedTimer(), host_b)
    done = a.submit("r1", list(range(32)), 10)
    if both:
        b.submit("r2", list(range(32)), 10)
    env.run(until=done)
    return done.value.last_token_at


def test_engines_on_one_host_slow_each_other_only_while_both_step():
    alone = _finish_time(SharedHost(0.5), None, both=False)
    assert alone == pytest.approx(10 * 0.010)  # 1 prefill step that samples a token + 9 decode steps, nobody beside it
    host = SharedHost(0.5)
    shared = _finish_time(host, host, both=True)
    # a starts first at t=0 (b not yet busy: ×1), then every later step of a starts while b is in one: ×1.5
    assert shared == pytest.approx(0.010 + 9 * 0.015)
    assert _finish_time(SharedHost(0.5), SharedHost(0.5), both=True) == pytest.approx(alone)  # separate hosts: no slowdown


def test_a_fleet_shares_a_host_only_when_given_contention():
    pools = [PoolSpec("prefill", 1, SHAPE), PoolSpec("decode", 2, SHAPE)]
    gpu = Fleet(pools, "conversation", lambda _g: FixedTimer())
    assert all(e.host is None for e in gpu.engines.values())
    cpu = Fleet(pools, "conversation", lambda _g: FixedTimer(), host_contention=0.2)
    hosts = {id(e.host) for e in cpu.engines.values()}
    assert len(hosts) == 1 and next(iter(cpu.engines.values())).host.contention == 0.2
