"""The figures of `baton bench memory` (pure parts): KL and top-1 scoring of the fidelity study,
the service path's summaries, and the RESULT line built from a report."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from baton.bench import memory, memory_async, memory_fidelity, memory_service
from baton.bench.memory_fidelity import Tally, kl_divergence


def _dist(probs: dict[int, float]) -> dict[int, float]:
    return {t: (math.log(p) if p > 0 else -math.inf) for t, p in probs.items()}


def test_kl_is_zero_for_the_same_distribution_and_positive_otherwise():
    p = _dist({0: 0.7, 1: 0.2, 2: 0.1})
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-12)
    q = _dist({0: 0.2, 1: 0.7, 2: 0.1})
    expected = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert kl_divergence(p, q) == pytest.approx(expected)
    assert kl_divergence(p, q) > 0


def test_kl_ignores_zero_mass_of_p_and_is_infinite_where_q_has_none():
    p = _dist({0: 1.0, 1: 0.0})
    assert kl_divergence(p, _dist({0: 0.5, 1: 0.5})) == pytest.approx(math.log(2))
    assert kl_divergence(_dist({0: 0.5, 1: 0.5}), _dist({0: 1.0, 1: 0.0})) == math.inf


def test_kl_refuses_distributions_over_different_vocabularies():
    with pytest.raises(ValueError, match="same vocabulary"):
        kl_divergence(_dist({0: 0.5, 1: 0.5}), _dist({0: 1.0}))


def test_a_tally_counts_agreement_accuracy_and_kl_per_position():
    a, b = _dist({0: 0.9, 1: 0.1}), _dist({0: 0.1, 1: 0.9})
    tally = Tally()
    tally.add({"prompt": [a, a, b], "kv": [a, b, b]}, refs=[0, 0, 0], f1s={"prompt": 1.0, "kv": 0.5})
    scores = tally.scores()
    assert scores["prompt"].top1_agreement_with_prompt == 1.0
    assert scores["prompt"].kl_to_prompt_mean == pytest.approx(0.0, abs=1e-12)
    kv = scores["kv"]
    assert kv.top1_agreement_with_prompt == pytest.approx(2 / 3)
    assert kv.top1_accuracy == pytest.approx(1 / 3)  # only the first position predicts the reference 0
    assert kv.kl_to_prompt_mean == pytest.approx(kl_divergence(a, b) / 3)
    assert kv.kl_to_prompt_p95 == pytest.approx(kl_divergence(a, b))
    assert kv.answer_f1 == 0.5 and kv.positions == 3


def test_a_tally_refuses_modes_scored_at_different_positions():
    a = _dist({0: 1.0})
    with pytest.raises(ValueError, match="positions"):
        Tally().add({"prompt": [a, a], "kv": [a]}, refs=[0, 0])


def test_a_tally_over_questions_scores_as_their_positions_together():
    a, b = _dist({0: 0.9, 1: 0.1}), _dist({0: 0.1, 1: 0.9})
    tally = Tally()
    tally.add({"prompt": [a, a], "kv": [a, b]}, refs=[0, 0], f1s={"prompt": 1.0, "kv": 0.0})
    tally.add({"prompt": [b], "kv": [b]}, refs=[0], f1s={"prompt": 0.5, "kv": 0.5})
    got = tally.scores()
    one = Tally()
    one.add({"prompt": [a, a, b], "kv": [a, b, b]}, refs=[0, 0, 0])
    whole = one.scores()
    for m in ("prompt", "kv"):
        assert (got[m].positions, got[m].top1_accuracy, got[m].top1_agreement_with_prompt) == (
            whole[m].positions, whole[m].top1_accuracy, whole[m].top1_agreement_with_prompt)
        assert got[m].kl_to_prompt_mean == pytest.approx(whole[m].kl_to_prompt_mean)
    assert got["kv"].answer_f1 == 0.25 and got["prompt"].answer_f1 == 0.75  # the mean over questions
    with pytest.raises(ValueError, match="differ from the earlier"):
        tally.add({"prompt": [a], "kv2": [a]}, refs=[0])


class _DistRunner:
    """Answers every request with one position's distribution: token 1 likelier when KV is injected."""

    def __init__(self):
        self.requests = []

    async def generate(self, req, injection=None):
        self.requests.append((req.prompt_token_ids, injection, req.cache_salt))
        favour = 1 if injection is not None else 0
        dist = _dist({favour: 0.8, 1 - favour: 0.2})
        yield SimpleNamespace(token_ids=(favour,), top_logprobs=[dist], finished=True)


def test_measure_question_scores_every_mode_at_the_reference_positions():
    runner = _DistRunner()
    renderer = SimpleNamespace(text_tokens=lambda text: [0, 0, 1], decode=lambda ids: "")
    case = SimpleNamespace(prompt=SimpleNamespace(token_ids=(5, 6)), prepared_kv=None, answer="ref")
    kv = SimpleNamespace(prompt=SimpleNamespace(token_ids=(5, 6)), prepared_kv="kv", answer="ref")
    tally = memory_fidelity.Tally()
    asyncio.run(memory_fidelity.measure_question(runner, renderer, {"prompt": case, "kv": kv}, tally, with_f1=False))
    scores = tally.scores()
    assert scores["kv"].positions == 3 and scores["kv"].top1_agreement_with_prompt == 0.0
    assert scores["kv"].top1_accuracy == pytest.approx(1 / 3) and scores["prompt"].top1_accuracy == pytest.approx(2 / 3)
    # teacher forcing: each position's prompt is the prompt plus the reference so far, one salt per mode
    assert [ids for ids, _, _ in runner.requests[:3]] == [(5, 6), (5, 6, 0), (5, 6, 0, 0)]
    assert {salt for _, _, salt in runner.requests[:3]} != {salt for _, _, salt in runner.requests[3:]}
    assert [inj for _, inj, _ in runner.requests] == [None] * 3 + ["kv"] * 3


def test_f1_of_answers():
    assert memory_fidelity.f1("Biscuit the dog", "biscuit") == pytest.approx(0.5)
    assert memory_fidelity.f1("", "biscuit") == 0.0


def test_service_summary_reports_stages_and_rate():
    rows = [memory_service.Timed(0.1 * i, 0.01, 0.001, 0.02 * i, 0.004, 0.05, 100) for i in range(1, 11)]
    s = memory_service.summarize(rows, wall_s=2.0)
    assert s["n"] == 10 and s["requests_per_s"] == 5.0
    assert s["p50_s"] <= s["p95_s"]
    assert s["recall_p50_s"] == pytest.approx(0.01) and s["mean_injected_tokens"] == 100
    assert s["prepare_p50_s"] == pytest.approx(0.004) and s["engine_p50_s"] == pytest.approx(0.05)


def _report(kv50: float = 0.2, hit50: float = 0.1) -> tuple[dict, dict, dict]:
    def ttft(prompt: float, kv: float, hit: float) -> dict:
        return {"ttft": {"prompt": {"p50_s": prompt}, "kv": {"p50_s": kv}, "hit": {"p50_s": hit}}}

    by_k = {"5": ttft(0.2, 0.1, 0.05), "50": ttft(2.0, kv50, hit50)}

    def modes(agree: float, kl: float, acc: float) -> dict:
        return {"prompt": {"top1_accuracy": 0.5, "top1_agreement_with_prompt": 1.0, "kl_to_prompt_mean": 0.0},
                f"kv_w{memory.DEFAULT_WINDOW}": {"top1_accuracy": acc, "top1_agreement_with_prompt": agree, "kl_to_prompt_mean": kl},
                "kv_w0": {"top1_accuracy": acc / 2, "top1_agreement_with_prompt": agree / 2, "kl_to_prompt_mean": 2 * kl}}

    fidelity = {"10": modes(0.95, 0.05, 0.45), "50": modes(0.9, 0.1, 0.4)}
    service = {k: {"concurrency_1": {"pull": {"p50_s": v}, "pull_ray": {"p50_s": 3 * v}}} for k, v in (("5", 0.3), ("50", 0.9))}
    return by_k, fidelity, service


def test_result_line_from_a_report():
    r = memory.run_result(*_report())
    assert list(r)[:9] == ["kv_ttft_growth_k50_over_k5", "hit_ttft_growth_k50_over_k5", "kv_over_hit_growth",
                           "prompt_ttft_growth_k50_over_k5", "ttft_speedup_k50", "top1_agreement_k50", "kl_k50",
                           "fidelity_ratio", "service_ttft_growth_k50_over_k5"]
    assert r["kv_ttft_growth_k50_over_k5"] == pytest.approx(2.0)
    assert r["hit_ttft_growth_k50_over_k5"] == pytest.approx(2.0)
    assert r["kv_over_hit_growth"] == pytest.approx(1.0)
    assert r["ttft_speedup_k50"] == pytest.approx(10.0)
    assert r["top1_agreement_k50"] == 0.9 and r["kl_k50"] == 0.1 and r["kl_k50_w0"] == 0.2
    assert r["fidelity_ratio"] == pytest.approx(0.9)  # at k = 10: 0.45 / 0.5
    assert r["service_ttft_growth_k50_over_k5"] == pytest.approx(3.0)
    assert r["service_ray_ttft_growth_k50_over_k5"] == pytest.approx(3.0)


def test_result_line_carries_every_compared_window_and_only_those():
    by_k, fidelity, service = _report()
    assert [k for k in memory.run_result(by_k, fidelity, service) if k.startswith("top1_agreement_k50_w")] == ["top1_agreement_k50_w0"]
    for k, agree in (("10", 0.7), ("50", 0.6)):
        fidelity[k]["kv_w7"] = {"top1_accuracy": 0.25, "top1_agreement_with_prompt": agree, "kl_to_prompt_mean": 0.3}
    fidelity["50"][f"kv_w{memory.DEFAULT_WINDOW}_tail512"] = {"top1_agreement_with_prompt": 1.0, "kl_to_prompt_mean": 0.0}  # not a window
    r = memory.run_result(by_k, fidelity, service)
    assert [k for k in r if k.startswith("top1_agreement_k50_w")] == ["top1_agreement_k50_w0", "top1_agreement_k50_w7"]
    assert r["top1_agreement_k50_w7"] == 0.6 and r["kl_k50_w7"] == 0.3
    assert r["fidelity_ratio_w7"] == pytest.approx(0.5)  # at k = 10: 0.25 / 0.5
    assert r["top1_agreement_k50"] == 0.9  # the default window's figure is the headline
    assert memory.DEFAULT_WINDOW not in memory.COMPARED_WINDOWS and 0 in memory.COMPARED_WINDOWS


def test_result_fails_when_injection_grows_faster_than_a_cache_hit():
    r = memory.run_result(*_report(kv50=0.4, hit50=0.1))
    assert r["kv_over_hit_growth"] == pytest.approx(2.0)  # 4x against 2x


def test_a_pull_tier_that_read_nothing_over_nixl_fails_the_bench():
    ok = memory_service.Timed(0.1, 0.01, 0.001, 0.02, 0.004, 0.05, 100, pulled_segments=6)
    memory_service._check_pulled([ok, ok])
    with pytest.raises(RuntimeError, match="1 of 2 pull-tier requests"):
        memory_service._check_pulled([ok, memory_service.Timed(0.1, 0.01, 0.001, 0.02, 0.004, 0.05, 100)])


def _stall(sync_p95: float, async_p95: float) -> dict:
    def mode(p95: float, ttft: float) -> dict:
        return {"stream_gap_during": {"p95_ms": p95}, "case_ttft": {"p50_ms": ttft}}

    return {"sync": mode(sync_p95, 100.0), "async": mode(async_p95, 110.0)}


def test_result_line_carries_the_load_stall_ratios():
    r = memory.run_result(*_report(), _stall(40.0, 20.0))
    assert r["load_stall_gap_p95_ratio_async_over_sync"] == pytest.approx(0.5)
    assert r["load_stall_case_ttft_ratio_async_over_sync"] == pytest.approx(1.1)
    assert list(r)[-2:] == ["load_stall_gap_p95_ratio_async_over_sync", "load_stall_case_ttft_ratio_async_over_sync"]
    # a background load that stalls the stream more than the engine-thread one shows as > 1
    assert memory.run_result(*_report(), _stall(20.0, 30.0))["load_stall_gap_p95_ratio_async_over_sync"] == pytest.approx(1.5)


class _StallRunner:
    """A runner whose stream yields a token every `tick` s, slower (`slow`) while a case runs in sync mode."""

    def __init__(self, tick: float, slow: float):
        from test_segment_connector import vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kv_transfer.segment_connector import SegmentConnector

        self.connector = SegmentConnector(vllm_config(), KVConnectorRole.SCHEDULER)
        self.scheduler = SimpleNamespace(connector=self.connector)
        self.tick, self.slow, self.busy = tick, slow, False
        self.modes_seen: list[bool] = []

    async def generate(self, req, injection=None):
        for _ in range(req.sampling.max_tokens):
            stalled = self.busy and self.connector.scheduler_side.async_min_tokens is None
            await asyncio.sleep(self.slow if stalled else self.tick)
            yield SimpleNamespace(token_ids=(1,), finished=False)


async def _case_request(runner, ids, kv, max_tokens):
    runner.busy = True
    runner.modes_seen.append(runner.connector.scheduler_side.async_min_tokens == 0)
    await asyncio.sleep(0.02)
    runner.busy = False
    return 0.02, [1], 0


def test_the_stall_phase_times_the_running_stream_in_both_modes():
    runner = _StallRunner(tick=0.002, slow=0.01)
    cases = [SimpleNamespace(prompt=SimpleNamespace(token_ids=(1, 2, 3)), prepared_kv=None) for _ in range(3)]
    report = asyncio.run(memory_async.measure(runner, cases, [1, 2, 3], _case_request, trials=2))
    assert runner.modes_seen == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3  # interleaved trials
    assert runner.connector.scheduler_side.async_min_tokens is None  # put back as configured
    assert report["sync"]["stream_gap_during"]["p95_ms"] >= 8 and report["async"]["stream_gap_during"]["p95_ms"] < 8
    assert report["sync"]["stream_gap_before"]["n"] >= memory_async.WARM_TOKENS - 1
    assert memory_async.stall_ratio(report) < 1
    with pytest.raises(RuntimeError, match="no segment connector"):
        asyncio.run(memory_async.measure(SimpleNamespace(scheduler=None), cases, [1], _case_request, trials=1))


def test_result_line_carries_the_recompute_tail_when_measured():
    by_k, fidelity, service = _report()
    assert "top1_agreement_k50_tail512" not in memory.run_result(by_k, fidelity, service)  # not measured: not claimed
    by_k["5"]["ttft"]["kv_tail512"] = {"p50_s": 0.2}
    by_k["50"]["ttft"]["kv_tail512"] = {"p50_s": 0.6}  # grows 3x, against a hit's 2x
    fidelity["50"][f"kv_w{memory.DEFAULT_WINDOW}_tail512"] = {"top1_accuracy": 0.45, "top1_agreement_with_prompt": 0.95, "kl_to_prompt_mean": 0.03}
    r = memory.run_result(by_k, fidelity, service)
    assert r["top1_agreement_k50_tail512"] == 0.95 and r["kl_k50_tail512"] == 0.03
    assert r["tail512_over_hit_growth"] == pytest.approx(1.5)
    assert r["tail512_ttft_k50_over_kv"] == pytest.approx(3.0)  # 0.6 s against plain KV's 0.2 s
    assert r["top1_agreement_k50"] == 0.9  # the plain injection's figure is still the headline's


def test_fidelity_only_result_is_the_full_results_fidelity_figures():
    by_k, fidelity, service = _report()
    fidelity["50"][f"kv_w{memory.DEFAULT_WINDOW}_tail512"] = {"top1_agreement_with_prompt": 0.95, "kl_to_prompt_mean": 0.03}
    fid = memory.fidelity_result(fidelity)
    assert list(fid) == ["top1_agreement_k50", "kl_k50", "fidelity_ratio", "top1_agreement_k50_w0", "kl_k50_w0",
                         "fidelity_ratio_w0", "top1_agreement_k50_tail512", "kl_k50_tail512"]
    full = memory.run_result(by_k, fidelity, service)  # no tail TTFT measured: the full line leaves the tail out
    assert {k: v for k, v in fid.items() if "tail" not in k} == {k: full[k] for k in fid if "tail" not in k}
    assert fid["top1_agreement_k50_w0"] == pytest.approx(0.45) and fid["fidelity_ratio"] == pytest.approx(0.9)
