"""`baton bench realtime`'s analysis without an engine: the cliff score the RESULT line reports
(baton/bench/realtime.py `cliff`) on a synthetic pool series, and the AIMD phase (`_aimd`) over a
fake engine that falls behind when crowded, so the decrease count comes from real decisions."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from baton.bench import realtime
from baton.bench.collapse import TickOutcome
from baton.engine.types import EngineStats, GenerationDelta, GenerationRequest

CAPACITY = 10_000


def pool_series(rate: float, until: float, live_from: float = 1.0) -> list[dict[str, Any]]:
    """Samples every 0.5 s: retained tokens grow `rate`/s from live_from; blocks track them."""
    out = []
    for i in range(int(until / 0.5)):
        t = 0.5 * i
        retained = max(0.0, (t - live_from) * rate)
        eta = max(0.0, (realtime.SAT_RHO * CAPACITY - retained) / rate) if t >= live_from else None
        out.append({"t": t, "live": 20 if t >= live_from else 0, "rho": min(1.0, retained / CAPACITY), "eta_sat_s": eta,
                    "growth_capped": False, "growing_sessions": 20, "retained_tokens": int(retained), "offered_tokens_per_s": rate,
                    "served_tokens_per_s": rate, "growth_tokens_per_s": rate})
    return out


def test_the_cliff_score_of_an_exact_forecast_is_zero_and_the_onset_is_scored_too() -> None:
    pool = pool_series(rate=100.0, until=120.0)  # ρ reaches 0.97 at 1 + 97 = 98 s
    late_from = 80.0  # every tick sent from 80 s on is late: the engine collapsed before the pool was full
    outcomes = [TickOutcome(q, 2.0 * q, 2.0 * q + 2.0, 2.0 * q + (5.0 if 2.0 * q >= late_from else 0.5), 5) for q in range(60)]
    c = realtime.cliff(pool, outcomes, first_collapse=None)
    assert c["measured_saturation_s"] == pytest.approx(98.0) and c["start_s"] == 1.0
    assert c["onset_s"] == pytest.approx(82.0)
    assert c["error"] == pytest.approx(0.0, abs=1e-9)
    assert [p["fraction"] for p in c["points"]] == [0.25, 0.5, 0.75]
    assert c["points"][1]["at_fit"]["retained_tokens"] == int((c["points"][1]["t_fit"] - 1.0) * 100)
    # against the onset at 82 s, each fit predicted 98 s: 16 / (82 − t_fit)
    assert c["error_vs_onset"] == pytest.approx(sorted(16 / (82 - p["t_fit"]) for p in c["points"])[1])


def test_the_ablations_are_scored_beside_the_predictor_on_the_same_saturation() -> None:
    pool = pool_series(rate=100.0, until=120.0)
    for sample in pool:  # completed ticks only comes 20 s late, whole histories 10 s early, at every sample
        eta = sample["eta_sat_s"]
        sample["eta_sat_completed_s"] = None if eta is None else eta + 20.0
        sample["eta_sat_history_s"] = None if eta is None else max(0.0, eta - 10.0)
    c = realtime.cliff(pool, [], first_collapse=None)
    assert c["error"] == pytest.approx(0.0, abs=1e-9)
    for key, off in (("completed_ticks", 20.0), ("whole_history", 10.0)):
        h = c[key]
        assert [p["horizon_error"] for p in h["points"]] == pytest.approx([off / (98 - p["t_fit"]) for p in c["points"]])
        assert h["error"] == pytest.approx(off / (98 - c["points"][1]["t_fit"]))


def test_no_saturation_means_no_cliff_figure() -> None:
    c = realtime.cliff(pool_series(rate=10.0, until=60.0), [], first_collapse=None)
    assert c["measured_saturation_s"] is None and c["error"] is None and c["points"] == []


class CrowdedRunner:
    """Each request takes `per_request_s` × the requests running at once: fine while the ticks of
    a few sessions do not overlap, a pile-up once too many do (latency feeds on itself)."""

    def __init__(self, per_request_s: float):
        self.per_request_s = per_request_s
        self.active = 0
        self.stats = EngineStats(kv_usage=0.0, kv_capacity_tokens=CAPACITY)

    async def generate(self, req: GenerationRequest, injection: Any = None, capture: Any = ()) -> Any:
        self.active += 1
        try:
            await asyncio.sleep(self.per_request_s * self.active)
            yield GenerationDelta(text="ok", token_ids=(7,), prompt_tokens=len(req.prompt_token_ids), cached_tokens=0,
                                  finished=True, finish_reason="length")
        finally:
            self.active -= 1


def synthetic_mode(pool: list[dict[str, Any]], outcomes: list[TickOutcome]) -> dict[str, Any]:
    """A mode report with the keys the bench prints (what mode_report builds from a run)."""
    return {"sessions": 20, "collapsed": 1, "ticks": len(outcomes), "first_collapse_s": None, "p50_s": 0.5, "p99_s": 1.0,
            "truth": {"misses": 0, "late": 0, "empty": 0, "missing": 0, "on_time": len(outcomes)},
            "naive": {"ticks_served": len(outcomes), "errors": 0, "deadline_misses": 0}, "peak_rho": 1.0,
            "latency_by_live": [{"live_lo": 1, "live_hi": 4, "p99_s": 0.3, "miss_share": 0.0, "ticks": 10}],
            "cpu": {"cores_used": 0.5, "loadavg_1m_mean": 1.0, "loadavg_1m_max": 2.0},
            "occupancy": pool, "cliff": realtime.cliff(pool, outcomes, None)}


def test_the_aimd_phase_counts_the_decreases_the_controller_made(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(realtime, "SAMPLE_S", 0.05)
    wl = dataclasses.replace(realtime.QUICK, period_s=0.1, deadline_s=0.1, sink_tokens=2, window_tokens=8, max_tokens=1,
                             grace_s=0.1, target_p99_ms=80.0, aimd_s=3.0, aimd_ticks=4, aimd_period_s=0.1, aimd_low=4,
                             aimd_high=8)
    chunks = [[(10 + i, 11, 12)] * 12 for i in range(8)]
    # 4 sessions at a 0.1 s period and 20 ms per overlapping request keep time; 8 pile up
    aimd = asyncio.run(realtime._aimd(CrowdedRunner(0.02), wl, (1, 2, 3, 4), chunks, n_sust=3))
    actions = [c["action"] for c in aimd["caps"]]
    assert aimd["decreases"] == actions.count("decrease") >= 1
    assert aimd["increases"] == actions.count("increase")
    assert aimd["schedule"] == [{"start_s": 0.0, "sessions": 4}, {"start_s": pytest.approx(0.9), "sessions": 8},
                                {"start_s": pytest.approx(2.1), "sessions": 4}]
    assert aimd["session_ticks"] >= aimd["ticks_to_fill_window"] + 2
    assert aimd["config"]["initial_cap"] == 4  # the low step: the cap starts there and climbs
    assert aimd["sustainable_sessions"] == 3 and aimd["period_s"] == 0.1  # the ramp's N is reported, the phase's P used
    # overload shed: each cut below the live sessions closed the newest; every one of them ended shed, none collapsed
    assert aimd["config"]["overload"] == "shed"
    assert aimd["shed_sessions"] == sum(c["shed"] for c in aimd["caps"]) >= 1
    assert aimd["shed_decisions"] == sum(c["shed"] > 0 for c in aimd["caps"]) >= 1
    assert all(c["action"] == "decrease" and c["live"] > c["cap"] for c in aimd["caps"] if c["shed"])
    assert aimd["sessions"] + aimd["shed_sessions"] == aimd["admitted_sessions"]  # collapse counts the others
    # the summary the bench prints reads every field it needs from these reports
    mode = synthetic_mode(pool_series(100.0, 120.0), [TickOutcome(q, 2.0 * q, 2.0 * q + 2.0, 2.0 * q + 0.5, 5) for q in range(60)])
    realtime._print_summary({"unbounded": mode, "bounded": mode}, aimd, wl)
    realtime._print_mode("unbounded", mode)
    out = capsys.readouterr().out
    assert "fit 50%: at 49.5s predicted 98.0s -> e=0.000" in out and f"{aimd['decreases']} decreases" in out
    assert f"{aimd['shed_sessions']} sessions shed" in out


def test_a_client_reads_a_1013_after_shed_overload_as_shed() -> None:
    from deployments.realtime_sessions import ShedNotice

    assert realtime.session_ending(ShedNotice(cap=3, live_sessions=5, retry_after_s=2.0).frame(), 1013) == "shed"
    assert realtime.session_ending({"type": "error", "code": "session_limit", "message": "full"}, 1013) == "refused"
    assert realtime.session_ending(None, 1000) == "ended"
    assert realtime.session_ending({"type": "error", "code": "shed_overload"}, 1011) == "failed"  # the close decides
    assert realtime.session_ending({"type": "error", "code": "engine_unavailable"}, 1011) == "failed"


def test_the_result_line_ends_with_the_shed_sessions() -> None:
    modes = {"bounded": {"collapsed": 0}, "unbounded": {"collapsed": 3, "cliff": {"error": 0.2654}}}
    aimd = {"p99_over_target": None, "decreases": 2, "shed_sessions": 7}
    assert realtime.result_line(realtime.run_result(modes, aimd)) == (
        "RESULT bounded_collapsed=0 unbounded_collapsed=3 cliff_prediction_error=0.265 aimd_p99_over_target=nan aimd_decreases=2 "
        "aimd_shed=7")


@pytest.mark.parametrize(("bf16", "dtype_bytes"), [(True, 2), (False, 4)])
def test_the_pool_is_sized_in_tokens_whatever_the_dtype(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, bf16: bool,
                                                        dtype_bytes: int) -> None:
    import json

    from baton.engine import vllm_engine

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576}))
    monkeypatch.setattr(vllm_engine, "native_cpu_bf16", lambda: bf16)
    per_token = 2 * 30 * 3 * 64 * dtype_bytes  # K and V, layers, KV heads, head dim
    gib = realtime._pool_gib(str(tmp_path), 6912)
    assert int(gib * (1 << 30)) // (per_token * 128) == 6912 // 128  # whole 128-token blocks: exactly the tokens asked
