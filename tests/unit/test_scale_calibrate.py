"""baton/sim/calibrate.py: the fitted CPU step model, reading conserve.json, the calibration error."""
import math

import pytest

from baton.engine.simulated.timing import PrefillChunk, StepBatch
from baton.sim.calibrate import CpuStepModel, calibration_error, fit_step_model, measured_ttfets
from baton.sim.cpu_steps import fits

TRUE = CpuStepModel(prefill=(0.01, 2e-4, 1e-8), decode=(0.02, 1e-3, 2e-7))


def steps_json():
    pre = [{"tokens": n, "context": c, "seconds": TRUE.step_time(StepBatch((PrefillChunk(n, c),))).seconds}
           for n in (128, 512, 2048) for c in (0, 1024, 3072)]
    dec = [{"batch": b, "context": c, "seconds": TRUE.step_time(StepBatch((), (c,) * b)).seconds}
           for b in (1, 4, 16) for c in (256, 2048)]
    return {"prefill": pre, "decode": dec, "engine": {}}


def test_the_fit_recovers_the_step_model_it_was_measured_from():
    fit = fit_step_model(steps_json())
    for got, want in zip(fit.prefill + fit.decode, TRUE.prefill + TRUE.decode, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    mixed = StepBatch((PrefillChunk(256, 0),), (1000, 1000))
    alone = fit.step_time(StepBatch((PrefillChunk(256, 0),))).seconds
    assert fit.step_time(mixed).seconds == pytest.approx(alone + 2 * (1e-3 + 2e-7 * 1000))  # one fixed cost per step


def test_a_step_time_that_is_not_positive_is_refused_not_fitted():
    broken = steps_json()
    broken["decode"][-1]["seconds"] = 0.0  # e.g. a decode point whose batch the KV pool could not hold
    with pytest.raises(ValueError, match="not positive"):
        fit_step_model(broken)


def test_cpu_steps_times_only_decode_batches_the_pool_holds_at_once():
    assert fits(16, 2048, 46_000) and not fits(32, 2048, 46_000)
    assert fits(1, 4096, 46_000) and not fits(16, 4096, 46_000)


def test_calibration_error_is_the_worst_relative_gap_and_nan_without_data():
    measured = {"conversation": {"ttfet_p50_s": 1.0, "ttfet_p95_s": 2.0}, "colocated": {"ttfet_p95_s": 4.0}}
    sim = {"conversation": {"ttfet_p50_s": 1.1, "ttfet_p95_s": 2.0}, "colocated": {"ttfet_p95_s": 3.0}}
    assert calibration_error(sim, measured) == pytest.approx(0.25)
    assert math.isnan(calibration_error({}, measured))
    assert math.isnan(calibration_error(sim, {"colocated": {"ttfet_p95_s": float("inf")}}))


def test_measured_ttfets_read_conserve_json_at_its_headline_rate():
    spread = lambda m: {"median": m, "min": m, "max": m, "n": 3}
    conserve = {"headline": {"rate": 1.2}, "summary": {
        "conversation": {"0.3": {"ttfet_p50_s": spread(0.5), "ttfet_p95_s": spread(0.9)},
                         "1.2": {"ttfet_p50_s": spread(1.5), "ttfet_p95_s": spread(3.0)}},
        "colocated": {"0.3": {"ttfet_p50_s": spread(0.4), "ttfet_p95_s": spread(0.8)},
                      "1.2": {"ttfet_p50_s": spread(2.0), "ttfet_p95_s": spread("inf")}}}}
    rate, m = measured_ttfets(conserve)
    assert rate == 1.2
    assert m["conversation"] == {"ttfet_p50_s": 1.5, "ttfet_p95_s": 3.0}
    assert m["colocated"]["ttfet_p50_s"] == 2.0 and math.isinf(m["colocated"]["ttfet_p95_s"])
