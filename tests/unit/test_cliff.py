"""Metronome cliff predictor (router/cliff.py): t_sat = at + (C − R) / min(offered, served), the
directory's use of it (plans carry the chosen decoder's eta), and the admission verdict. Pure."""
from __future__ import annotations

import math

import pytest
from directory_fixtures import MakeState, make_state, rep, up
from pydantic import ValidationError

from router.cliff import CliffAdmissionConfig, DecoderTokens, cliff_admission, forecast_cliff
from router.report import ReplicaReport

__all__ = ["make_state"]  # the fixture, used by name


def test_eta_is_free_tokens_over_growth() -> None:
    # 20 sessions x 5 tokens/s = 100 tokens/s into 6,000 free tokens: full 60 s after the forecast
    fc = forecast_cliff(DecoderTokens(capacity_tokens=7_000, retained_tokens=1_000, offered_tokens_per_s=100.0,
                                      served_tokens_per_s=120.0), at=40.0)
    assert fc.growth_tokens_per_s == 100.0 and not fc.capped
    assert fc.eta_s == pytest.approx(60.0) and fc.t_saturation == pytest.approx(100.0)
    assert fc.seconds_to(0.5) == pytest.approx(25.0)  # 3,500 − 1,000 tokens at 100/s
    assert fc.eta_at(70.0) == pytest.approx(30.0) and fc.eta_at(200.0) == 0.0


def test_growth_is_capped_at_what_the_engine_serves() -> None:
    # the sessions offer 100 tokens/s but the engine only gets through 40/s of their ticks
    fc = forecast_cliff(DecoderTokens(7_000, 1_000, 100.0, 40.0), at=0.0)
    assert fc.capped and fc.growth_tokens_per_s == 40.0
    assert fc.eta_s == pytest.approx(150.0)


@pytest.mark.parametrize("state", [
    DecoderTokens(7_000, 1_000, 0.0, 0.0),  # no growing session (bounded sessions, or idle ones)
    DecoderTokens(0, 1_000, 100.0, 100.0),  # capacity unknown
], ids=["not filling", "unknown capacity"])
def test_no_cliff_ahead(state: DecoderTokens) -> None:
    fc = forecast_cliff(state, at=5.0)
    assert fc.eta_s is None and fc.t_saturation is None and fc.eta_at(6.0) is None


def test_a_pool_already_full_has_eta_zero_even_without_growth() -> None:
    assert forecast_cliff(DecoderTokens(1_000, 1_200, 0.0, 0.0), at=3.0).eta_s == 0.0
    assert forecast_cliff(DecoderTokens(1_000, 1_000, 10.0, 10.0), at=3.0).eta_s == 0.0


@pytest.mark.parametrize("figures", [(-1, 0, 0.0, 0.0), (10, -5, 0.0, 0.0), (10, 0, math.nan, 0.0), (10, 0, 1.0, math.inf)])
def test_token_figures_are_checked(figures: tuple) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        DecoderTokens(*figures)


def test_seconds_to_needs_a_fraction_of_the_pool() -> None:
    fc = forecast_cliff(DecoderTokens(1_000, 0, 10.0, 10.0), at=0.0)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            fc.seconds_to(bad)


# ---- the replica's report and the directory ------------------------------------------------------------


def test_a_report_refuses_negative_or_nan_rates() -> None:
    for bad in ({"offered_growth_tokens_per_s": -1.0}, {"served_growth_tokens_per_s": math.nan}, {"retained_tokens": -1},
                {"offered_growth_tokens_per_s": math.inf}):
        with pytest.raises(ValueError, match="negative"):
            ReplicaReport("d0", "decode", **bad)  # type: ignore[arg-type]
    figures = ReplicaReport("d0", "decode", retained_tokens=5, offered_growth_tokens_per_s=1.0).figures()
    assert figures["retained_tokens"] == 5 and figures["offered_growth_tokens_per_s"] == 1.0


def test_the_directory_forecasts_each_decoder_and_puts_the_eta_in_the_plan(make_state: MakeState) -> None:
    state = make_state(policy="colocated")
    state.report(rep("d0", "decode", cap=10_000, retained_tokens=4_000, offered_growth_tokens_per_s=100.0,
                     served_growth_tokens_per_s=100.0), 100.0)
    fc = state.cliff_forecast("d0")
    assert fc is not None and fc.at == 100.0 and fc.eta_s == pytest.approx(60.0)
    plan = state.route("rt-1", None, 20, now=110.0, owned=False)
    assert plan.decode_replica == "d0" and plan.cliff_eta_s == pytest.approx(50.0)  # 10 s after the report
    assert state.cliff_forecast("nobody") is None
    shown = state.snapshot(130.0)["replicas"]["d0"]
    assert shown["cliff_eta_s"] == pytest.approx(30.0) and shown["retained_tokens"] == 4_000


def test_the_replica_report_carries_its_sessions_token_growth() -> None:
    from baton.engine.realtime.growth import TokenGrowth
    from baton.engine.types import EngineStats
    from deployments.replica_report import replica_report
    from kv_transfer.ledger import TransferTotals

    growth = TokenGrowth(sessions=3, growing_sessions=2, retained_tokens=900, offered_tokens_per_s=10.0, served_tokens_per_s=8.0)
    r = replica_report("d0", "decode", EngineStats(kv_capacity_tokens=5_000), TransferTotals(), growth=growth)
    assert (r.retained_tokens, r.offered_growth_tokens_per_s, r.served_growth_tokens_per_s) == (900, 10.0, 8.0)
    assert replica_report("d0", "decode", EngineStats(), TransferTotals()).retained_tokens == 0


def test_a_new_real_time_session_avoids_a_decoder_near_its_cliff_while_another_is_live(make_state: MakeState) -> None:
    state = make_state(policy="colocated")
    near = {"retained_tokens": 9_000, "offered_growth_tokens_per_s": 100.0, "served_growth_tokens_per_s": 100.0}  # 10 s
    state.report(rep("d0", "decode", **near), 0.0)  # d0 is the less loaded one, but 10 s from full
    state.report(rep("d1", "decode", kv=0.5), 0.0)
    assert state.route("rt-1", None, 20, now=1.0, owned=False).decode_replica == "d0"  # without a horizon: by load
    plan = state.route("rt-2", None, 20, now=1.0, owned=False, cliff_horizon_s=30.0)
    assert plan.decode_replica == "d1" and plan.cliff_eta_s is None
    assert state.route("rt-1", None, 20, now=2.0, owned=False, cliff_horizon_s=30.0).decode_replica == "d0"  # a pin stays
    state.report(rep("d1", "decode", kv=0.5, **near), 2.0)  # both near the cliff: by load again, and the plan says how near
    plan = state.route("rt-3", None, 20, now=2.0, owned=False, cliff_horizon_s=30.0)
    assert plan.decode_replica == "d0" and plan.cliff_eta_s == pytest.approx(8.0)


def test_a_decoder_without_real_time_growth_has_no_cliff_in_its_plans(make_state: MakeState) -> None:
    state = make_state(policy="colocated")
    up(state, 0.0, "d0", prefill=())
    assert state.route("c-1", None, 20, now=1.0).cliff_eta_s is None


# ---- admission --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("action, eta, expected", [
    ("refuse", 10.0, "refuse"), ("refuse", 45.0, "admit"), ("refuse", None, "admit"),
    ("warn", 0.0, "warn"), ("warn", 30.0, "admit"),  # exactly at the horizon: not closer than it
    ("off", 0.0, "admit"),
])
def test_cliff_admission(action: str, eta: float | None, expected: str) -> None:
    verdict = cliff_admission(eta, CliffAdmissionConfig(action=action, horizon_s=30.0))  # type: ignore[arg-type]
    assert verdict.action == expected and verdict.horizon_s == 30.0
    assert ("forecast full" in verdict.describe()) == (eta is not None)


def test_cliff_config_forbids_unknown_fields_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="horizon"):
        CliffAdmissionConfig(horizon=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        CliffAdmissionConfig(horizon_s=0)
    with pytest.raises(ValidationError):
        CliffAdmissionConfig(action="block")  # type: ignore[arg-type]


def test_the_realtime_yaml_takes_the_cliff_settings_by_name() -> None:
    from deployments.config import RealtimeConfig

    cfg = RealtimeConfig.model_validate({"cliff": {"action": "refuse", "horizon_s": 12}, "max_clock_skew_s": 0.5})
    assert cfg.cliff.action == "refuse" and cfg.cliff.horizon_s == 12.0 and cfg.max_clock_skew_s == 0.5
    assert RealtimeConfig().cliff.action == "warn"
    with pytest.raises(ValidationError, match="cliff.horizon"):
        RealtimeConfig.model_validate({"cliff": {"horizon": 12}})
    with pytest.raises(ValidationError, match="max_clock_skew_s"):
        RealtimeConfig.model_validate({"max_clock_skew_s": -1})
