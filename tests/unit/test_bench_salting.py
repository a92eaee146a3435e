"""`baton bench salting`'s pure parts (baton/bench/salting.py): how the bundled trace is spread
over users, and the figures of one scope's replay. The bench itself needs a cluster (not run here)."""
from __future__ import annotations

import pytest

from baton.bench import commands, salting
from baton.traces.format import load_trace
from baton.traces.records import ConversationRecord, ReplayResult, TurnRecord


def test_the_bench_is_registered() -> None:
    assert commands.BENCHMARKS["salting"] == "baton.bench.salting"


@pytest.mark.parametrize("scope", ["tenant", "shared"])
def test_each_scope_runs_a_valid_app_config(scope: str) -> None:
    from deployments.config import load_app_config

    cfg = load_app_config(salting.scope_args(scope))
    assert cfg.isolation.prefix_cache == scope and cfg.routing.policy == "conversation"
    assert cfg.prefill is not None and cfg.prefill.num_replicas == 1 and cfg.decode.num_replicas == 1


def test_the_trace_is_spread_over_users_with_its_turns_capped() -> None:
    trace = load_trace(salting.TRACE)
    w = salting.Workload(users=3, max_turns=2, max_tokens=16, concurrency=3)
    convs = salting.spread_over_users(trace, w)
    assert [c.conversation_id for c in convs] == [c.conversation_id for c in trace]
    assert [c.user for c in convs] == [f"tenant-{i % 3}" for i in range(len(trace))]
    assert all(len(c.turns) == 2 and all(t.max_tokens <= 16 for t in c.turns) for c in convs)
    assert all(c.system == t.system and c.turns[0].content == t.turns[0].content for c, t in zip(convs, trace, strict=True))
    # the scopes differ only if users share system prompts: some user pairs send the same one
    systems = {(c.user, c.system) for c in convs}
    assert len({s for _, s in systems}) < len(systems)
    full = salting.spread_over_users(trace, salting.FULL)
    assert [len(c.turns) for c in full] == [len(c.turns) for c in trace]


def turn(index: int, prompt: int, cached: int, ttft: float, error: str | None = None) -> TurnRecord:
    return TurnRecord(conversation_id="c", turn_index=index, role="user", effective=True, send_time_s=0.0, ttft_s=ttft, e2e_s=1.0,
                      prompt_tokens=prompt, completion_tokens=4, cached_tokens=cached, status=200, error=error)


def test_scope_figures_split_first_turns_and_skip_failed_ones() -> None:
    result = ReplayResult(url="u", model="m", concurrency=1, started_at="t", duration_s=10.0,
                          conversations=[ConversationRecord("c", "tenant-0", "s", 3, 3, 0.0, 0.4)],
                          turns=[turn(0, 100, 0, 0.4), turn(0, 100, 96, 0.2), turn(1, 200, 192, 0.1), turn(1, 50, 50, 9.0, "boom")])
    f = salting.scope_figures(result)
    assert (f["turns"], f["errors"], f["prompt_tokens"], f["cached_tokens"]) == (4, 1, 400, 288)
    assert f["cached_fraction"] == pytest.approx(0.72) and f["first_turn_cached_fraction"] == pytest.approx(0.48)
    assert f["ttft_p50_s"] == pytest.approx(0.2) and f["first_turn_ttft_p50_s"] == pytest.approx(0.3)
    assert f["ttfet_p50_s"] == pytest.approx(0.4)
