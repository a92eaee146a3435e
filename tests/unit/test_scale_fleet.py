"""A tiny fleet run end to end (fake step times, no AIConfigurator): Baton's directory places the
turns; conversation-level disaggregation moves KV once per conversation, per-turn P/D every turn,
colocated never; nothing is dropped. Plus the bench's RESULT line."""
from baton.bench.scale import result_line
from baton.engine.simulated.timing import StepBatch, StepTime
from baton.sim import hardware, workloads
from baton.sim.fleet import Fleet
from baton.sim.slo import run_figures

SMALL = workloads.Shape(tool_doc_tokens=(600, 900), tool_result_tokens=(100, 300), answer_tokens=(10, 20), tool_call_tokens=(5, 10),
                        agent_think_mean_s=0.5, questions=(3, 3), sink_tokens=128, window_tokens=256, ticks=(4, 4), tick_s=0.2)


class FakeTimer:
    def step_time(self, batch: StepBatch) -> StepTime:
        tokens = sum(c.new_tokens for c in batch.prefills) + len(batch.decode_contexts)
        return StepTime(2e-3 + 2e-6 * tokens, "fake")


def run(policy, name="agentic", rate=3.0):
    convs = workloads.build(name, rate, 3.0, 4, seed=2, s=SMALL)
    fleet = Fleet(hardware.pools(4, "homo", policy != "colocated"), policy, lambda _gpu: FakeTimer())
    result = fleet.run(convs, until_s=120.0)
    for e in fleet.engines.values():
        e.scheduler.check_integrity()
    return convs, result


def test_conversation_moves_less_kv_than_per_turn_pd_and_colocated_none():
    convs, conv = run("conversation")
    _, per_turn = run("per_turn_pd")
    _, colocated = run("colocated")
    assert len(convs) >= 4
    for r in (conv, per_turn, colocated):
        figs = run_figures(r.runs)
        assert figs.conversations == len(convs) == figs.completed  # nothing dropped, everything finished
    assert colocated.kv_bytes_pd == 0 and colocated.handoffs == 0
    assert 0 < conv.kv_bytes_pd < per_turn.kv_bytes_pd
    assert conv.handoffs <= len(convs)  # at most once per conversation
    assert per_turn.directory_totals["planned_handoffs"] >= sum(len(c.turns) for c in convs) * 0.9


def test_realtime_sessions_reinject_their_window_and_meet_light_deadlines():
    convs, r = run("colocated", name="realtime", rate=2.0)
    figs = run_figures(r.runs)
    assert figs.completed == len(convs) and r.kv_bytes_injected > 0 and r.kv_bytes_pd == 0
    assert figs.good == len(convs)


def test_result_line_reads_the_512_cells_and_says_nan_without_data():
    cell = lambda p, t, ttfet, e: {"workload": "agentic", "gpus": 512, "policy": p, "tiers": t,
                                   "figures": {"ttfet_p95_s": ttfet}, "energy_per_conversation_j": e}
    cells = [cell("conversation", "homo", 1.0, 100.0), cell("per_turn_pd", "homo", 2.0, 120.0), cell("conversation", "hetero", 1.5, 80.0)]
    line = result_line(cells, float("nan"), None)
    assert line == ("RESULT calibration_error=nan p95_ttfet_ratio_vs_per_turn_pd_at_512=0.500 "
                    "energy_per_conversation_ratio_hetero_vs_homo=0.800 max_replicas_on_this_machine=nan")
    assert "max_replicas_on_this_machine=12" in result_line(cells, 0.1, 12)
    assert "p95_ttfet_ratio_vs_per_turn_pd_at_512=nan" in result_line(cells[:1], 0.1, 12)
