"""baton/sim/workloads.py: seeded open-loop arrivals and the three conversation shapes."""
import random

import pytest

from baton.sim import workloads


def test_poisson_arrivals_are_seeded_inside_the_horizon_and_at_the_rate():
    a = workloads.poisson_times(50.0, 20.0, random.Random(1))
    assert a == workloads.poisson_times(50.0, 20.0, random.Random(1))
    assert all(0 <= t < 20.0 for t in a) and a == sorted(a)
    assert 900 < len(a) < 1100  # 1000 expected; sd ~32
    with pytest.raises(ValueError):
        workloads.poisson_times(0.0, 1.0, random.Random(0))


def test_arrivals_scale_with_the_rate_given_for_the_fleet():
    small = workloads.build("agentic", 8 * 1.0, 30.0, 8, seed=3)
    big = workloads.build("agentic", 64 * 1.0, 30.0, 64, seed=3)
    assert 5 < len(big) / len(small) < 11


def test_agentic_turns_pair_a_tool_call_with_an_effective_answer_and_share_tool_docs():
    convs = workloads.build("agentic", 20.0, 10.0, 8, seed=0)
    for c in convs:
        assert [t.effective for t in c.turns] == [False, True] * (len(c.turns) // 2)
        assert c.turns[0].think_s == 0.0
    by_doc = {}
    for c in convs:
        by_doc.setdefault(c.prefix_key, set()).add(c.prefix_tokens)
    assert len(by_doc) <= workloads.Shape().tool_docs and all(len(v) == 1 for v in by_doc.values())


def test_memory_prefix_is_the_users_and_realtime_ticks_have_deadlines():
    mem = workloads.build("memory", 20.0, 10.0, 8, seed=0)
    per_user = {}
    for c in mem:
        per_user.setdefault(c.user, set()).add((c.prefix_key, c.prefix_tokens))
    assert all(len(v) == 1 for v in per_user.values()) and all(c.turns and all(t.effective for t in c.turns) for c in mem)
    rt = workloads.build("realtime", 5.0, 4.0, 8, seed=0)
    s = workloads.Shape()
    assert rt and all(c.window_tokens == s.window_tokens and all(t.deadline_s == s.tick_s for t in c.turns) for c in rt)
