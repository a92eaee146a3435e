"""baton/sim/served_steps.py: the calibration's step model fitted on served engines' step traces."""

import json
import math
import random
from pathlib import Path

import pytest

from baton.sim import served_steps as ss
from baton.sim.calibrate import CpuStepModel, run_calibration

TRUE = CpuStepModel(prefill=(0.012, 3e-4, 2e-8), decode=(0.04, 6e-4, 2e-6))
HEADER = {"engine": {"role": "decode", "block_size": 16, "kv_capacity_tokens": 46592, "max_num_seqs": 256, "max_num_batched_tokens": 4096}}


def synthetic_steps(n: int, seed: int, t0: float = 1000.0) -> list[ss.Step]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        decodes = tuple(rng.randrange(100, 4000) for _ in range(rng.randrange(0, 9)))
        prefills = tuple((rng.randrange(2, 2048), rng.randrange(0, 3000)) for _ in range(rng.randrange(0, 2))) if i % 3 == 0 else ()
        if not decodes and not prefills:
            decodes = (rng.randrange(100, 4000),)
        s = ss.Step(t0 + i * 0.05, 0.0, prefills, decodes)
        out.append(ss.Step(s.t, ss.predict(TRUE, s), prefills, decodes))
    return out


def write_trace(path: Path, steps: list[ss.Step], gaps: list[float | None] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    gaps = gaps or [None] * len(steps)
    lines = [json.dumps(HEADER)] + [
        json.dumps({"t": s.t, "s": s.seconds, "g": g, "p": [list(c) for c in s.prefills], "d": list(s.decodes)}) for s, g in zip(steps, gaps, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")


def test_the_fit_recovers_the_model_the_steps_were_timed_by():
    fit = ss.fit(synthetic_steps(400, seed=1))
    for got, want in zip(fit.prefill + fit.decode, TRUE.prefill + TRUE.decode, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    held = synthetic_steps(100, seed=2)
    assert ss.summed_error(fit, held) == pytest.approx(0.0, abs=1e-9)


def test_the_fit_recovers_the_hosts_slowdown_with_the_model():
    rng = random.Random(11)
    truth = CpuStepModel(TRUE.prefill, TRUE.decode, contention=0.3)
    steps = [ss.Step(s.t, 0.0, s.prefills, s.decodes, rng.choice((0, 0, 1, 2))) for s in synthetic_steps(400, seed=10)]
    steps = [ss.Step(s.t, ss.predict(truth, s), s.prefills, s.decodes, s.neighbours) for s in steps]
    fit = ss.fit(steps)
    assert fit.contention == pytest.approx(0.3, rel=1e-5)
    for got, want in zip(fit.prefill + fit.decode, TRUE.prefill + TRUE.decode, strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-10)
    alone = [ss.Step(s.t, s.seconds, s.prefills, s.decodes) for s in synthetic_steps(100, seed=12)]
    assert ss.fit(alone).contention == 0.0  # nobody beside the engine: nothing to fit, κ stays 0
    # neighbours that do not slow anything: κ is 0, not negative
    noise = [ss.Step(s.t, s.seconds, s.prefills, s.decodes, rng.choice((0, 1))) for s in synthetic_steps(300, seed=13)]
    assert ss.fit(noise).contention == pytest.approx(0.0, abs=1e-9)


def test_neighbours_are_the_other_engines_of_the_same_app_in_a_step_at_its_start(tmp_path: Path):
    a = [ss.Step(0.0, 0.10, (), (100,)), ss.Step(0.10, 0.10, (), (101,)), ss.Step(0.50, 0.10, ((64, 0),), ())]
    b = [ss.Step(0.05, 0.10, (), (200,)), ss.Step(0.30, 0.10, (), (201,))]
    got = {(s.t, s.neighbours) for s in ss.with_neighbours([a, b])}
    assert got == {(0.0, 0), (0.10, 1), (0.50, 0), (0.05, 1), (0.30, 0)}
    # the same traces in two app runs (two directories): engines of different runs never overlap
    write_trace(tmp_path / "steps" / "r0-colocated" / "decode-1.jsonl", a)
    write_trace(tmp_path / "steps" / "r0-colocated" / "decode-2.jsonl", b)
    write_trace(tmp_path / "steps" / "r1-colocated" / "decode-3.jsonl", b)
    loaded = ss.load_served_steps(tmp_path)
    assert sorted(s.neighbours for s in loaded.steps) == [0, 0, 0, 0, 0, 1, 1]


def test_no_coefficient_goes_negative_and_the_form_matches_the_simulators_engine():
    from baton.engine.simulated.timing import PrefillChunk, StepBatch

    # decode steps whose time does not grow with context: a free fit would put d2 slightly below 0
    steps = [ss.Step(i, 0.03 + 0.001 * len(d) - 1e-9 * sum(d), (), d) for i, d in enumerate([(500,), (3000,), (500, 3000), (3500,) * 4])]
    steps.append(ss.Step(9, 0.2, ((512, 0),), ()))
    fit = ss.fit(steps)
    assert all(x >= 0 for x in fit.prefill + fit.decode)
    probe = ss.Step(0, 0, ((256, 100),), (800, 900))
    assert fit.step_time(StepBatch((PrefillChunk(256, 100),), (800, 900))).seconds == pytest.approx(ss.predict(fit, probe))


def test_a_fit_without_both_kinds_of_step_is_refused():
    decode_only = [s for s in synthetic_steps(60, seed=3) if not s.prefills]
    with pytest.raises(ValueError, match="prefill and decode-only"):
        ss.fit(decode_only)


def test_a_trace_counts_loop_gaps_as_cost_but_not_idle_waits_and_skips_a_cut_line(tmp_path: Path):
    steps = synthetic_steps(3, seed=4)
    f = tmp_path / "steps" / "r0-conversation" / "decode-1.jsonl"
    write_trace(f, steps, gaps=[None, 0.004, 2.5])
    with f.open("a") as fh:
        fh.write('{"t": 12')  # the engine was killed mid-line
    header, got = ss.read_trace(f)
    assert header["kv_capacity_tokens"] == 46592
    assert [g.seconds for g in got] == pytest.approx([steps[0].seconds, steps[1].seconds + 0.004, steps[2].seconds])


def test_loading_a_run_needs_traces_of_one_engine_shape(tmp_path: Path):
    with pytest.raises(ValueError, match="no step traces"):
        ss.load_served_steps(tmp_path)
    write_trace(tmp_path / "steps" / "r0-colocated" / "decode-1.jsonl", synthetic_steps(5, seed=5))
    (tmp_path / "steps" / "r0-colocated" / "decode-2.jsonl").write_text('{"t": 1, "s": 0.1}\n')
    with pytest.raises(ValueError, match="not a step trace"):
        ss.load_served_steps(tmp_path)
    other = {"engine": {**HEADER["engine"], "kv_capacity_tokens": 1000}}
    (tmp_path / "steps" / "r0-colocated" / "decode-2.jsonl").write_text(json.dumps(other) + "\n")
    with pytest.raises(ValueError, match="differ in shape"):
        ss.load_served_steps(tmp_path)


def test_the_scored_level_is_held_out_of_the_fit(tmp_path: Path):
    light = synthetic_steps(200, seed=6, t0=1000.0)
    heavy = [ss.Step(s.t, s.seconds * 1.5, s.prefills, s.decodes) for s in synthetic_steps(200, seed=7, t0=2000.0)]  # contention
    write_trace(tmp_path / "steps" / "r0-conversation" / "decode-1.jsonl", light + heavy)
    conserve = {"reps": [{"levels": [{"rate": 0.3, "clock": [999.0, 1100.0]}, {"rate": 1.2, "clock": [1999.0, 2100.0]}]}]}
    windows = ss.level_windows(conserve, 1.2)
    assert windows == [(1999.0, 2100.0)]
    model, engine, report = ss.served_step_model(tmp_path, windows)
    assert engine["kv_capacity_tokens"] == 46592 and engine["bytes_per_token"] == 23_040
    assert report["fit_on"]["steps"] == 200 and report["held_out"]["steps"] == 200
    assert report["fit_step_error"] == pytest.approx(0.0, abs=1e-9)
    assert report["held_out_error"] == pytest.approx(1 / 3, rel=1e-6)  # fitted on the light level, it misses the heavy one
    assert report["held_out_step_error"] == pytest.approx(1 / 3, rel=1e-6)  # every step 1/3 short: bias and per-step alike


def test_run_calibration_takes_exactly_one_step_source(tmp_path: Path):
    with pytest.raises(ValueError, match="exactly one"):
        run_calibration(tmp_path / "conserve.json")
    with pytest.raises(ValueError, match="exactly one"):
        run_calibration(tmp_path / "conserve.json", steps_json=tmp_path / "s.json", served_steps=tmp_path)
    assert math.isnan(ss.summed_error(TRUE, []))
    assert math.isnan(ss.step_error(TRUE, []))


def test_the_per_step_error_sees_what_the_bias_cancels():
    fast, slow = ss.Step(0, 0.02, (), (100,)), ss.Step(1, 0.06, (), (100,))  # same shape, one slow and one fast step
    model = ss.fit([fast, slow, ss.Step(2, 0.2, ((512, 0),), ())])
    assert ss.summed_error(model, [fast, slow]) == pytest.approx(0.0, abs=1e-9)
    assert ss.step_error(model, [fast, slow]) == pytest.approx(0.5)  # |0.04 − 0.02| + |0.04 − 0.06| over 0.08


@pytest.mark.parametrize(
    "given",
    [
        {"calibrate": Path("c.json")},
        {"cpu_steps": Path("s.json")},
        {"served_steps": Path("run")},
        {"calibrate": Path("c.json"), "cpu_steps": Path("s.json"), "served_steps": Path("run")},
    ],
)
def test_bench_scale_calibrates_with_exactly_one_step_source(given: dict):
    import argparse

    from baton.bench import commands

    args = argparse.Namespace(
        name="scale", quick=True, offline=False, out=Path("unused"), replicas_json=None, **{"calibrate": None, "cpu_steps": None, "served_steps": None, **given}
    )
    with pytest.raises(SystemExit, match="exactly one of --cpu-steps or --served-steps"):
        commands.run_bench(args)


def _conserve_json(path: Path, measured: dict[float, dict[str, float]], clocks: dict[float, list[float]]) -> Path:
    workload = {"reps": 1, "rates": [0.3, 1.2], "per_level": 4, "user_turns": 2, "max_system_chars": 9000, "max_tokens": 32, "think_s": None, "seed": 0}
    conserve = {
        "workload": workload,
        "headline": {"rate": 1.2},
        "summary": {"colocated": {str(r): {k: {"median": v} for k, v in figs.items()} for r, figs in measured.items()}},
        "reps": [{"levels": [{"rate": r, "clock": c} for r, c in clocks.items()]}],
    }
    path.write_text(json.dumps(conserve))
    return path


def test_run_calibration_scores_the_served_step_model_against_conserve(tmp_path: Path):
    light, heavy = synthetic_steps(200, seed=8, t0=1000.0), synthetic_steps(100, seed=9, t0=2000.0)
    write_trace(tmp_path / "steps" / "r0-colocated" / "decode-1.jsonl", light + heavy)
    clocks = {0.3: [999.0, 1300.0], 1.2: [1999.0, 2200.0]}
    unit = {r: {"ttfet_p50_s": 1.0, "ttfet_p95_s": 1.0} for r in clocks}
    first = run_calibration(_conserve_json(tmp_path / "conserve.json", unit, clocks), served_steps=tmp_path)
    src = first["step_source"]
    assert src["kind"] == "served_steps" and src["same_run_as_scored"] is True
    assert (src["fit_on"]["steps"], src["held_out"]["steps"]) == (200, 100)  # the headline level's steps are not fitted on
    assert src["held_out_error"] == pytest.approx(0.0, abs=1e-6)  # the synthetic steps all follow TRUE
    sim = first["simulated"]["colocated"]
    assert 0 < sim["ttfet_p50_s"] <= sim["ttfet_p95_s"] < 60
    # the simulation is deterministic: scored against its own figures the error is 0, against twice them 0.5
    as_simulated = {1.2: sim, 0.3: {"ttfet_p50_s": 1.0, "ttfet_p95_s": 1.0}}
    again = run_calibration(_conserve_json(tmp_path / "conserve.json", as_simulated, clocks), served_steps=tmp_path)
    assert again["calibration_error"] == pytest.approx(0.0, abs=1e-9)
    twice = {1.2: {k: 2 * v for k, v in sim.items()}, 0.3: as_simulated[0.3]}
    assert run_calibration(_conserve_json(tmp_path / "conserve.json", twice, clocks), served_steps=tmp_path)["calibration_error"] == pytest.approx(0.5)
    assert set(again["calibration_error_other_levels"]) == {0.3} and again["calibration_error_other_levels"][0.3] > 0
    assert again["ttfet_p95_ratios"] == {"measured": {}, "simulated": {}}  # one policy: nothing to compare it with
    assert set(again["ttfet_p95_ratios_projected"]) == {"2.4", "4.8"}


def test_ttfet_ratios_are_conversations_p95_over_each_other_policys():
    from baton.sim.calibrate import ttfet_ratios

    figs = {"conversation": {"ttfet_p95_s": 3.0}, "per_turn_pd": {"ttfet_p95_s": 6.0}, "colocated": {"ttfet_p95_s": 4.0},
            "conditional_pd": {}}
    assert ttfet_ratios(figs) == {"per_turn_pd": 0.5, "colocated": 0.75}
    assert ttfet_ratios({"colocated": {"ttfet_p95_s": 4.0}}) == {}


def test_a_faster_arrival_rate_never_shortens_the_simulated_ttfet(tmp_path: Path):
    from baton.bench.conserve import Workload, build_trace
    from baton.sim.calibrate import simulate_conserve

    clocks = {0.3: [999.0, 1300.0], 1.2: [1999.0, 2200.0]}
    unit = {r: {"ttfet_p50_s": 1.0, "ttfet_p95_s": 1.0} for r in clocks}
    conserve = json.loads(_conserve_json(tmp_path / "conserve.json", unit, clocks).read_text())
    trace = build_trace(Workload(**{**conserve["workload"], "rates": tuple(conserve["workload"]["rates"])}))
    engine = {**HEADER["engine"], "bytes_per_token": 23_040}
    model = CpuStepModel(TRUE.prefill, TRUE.decode, contention=0.2)
    count = lambda text: max(1, len(text) // 4)
    runs = [simulate_conserve(conserve, model, engine, count, trace, ["colocated"], arrival_rate=r)["colocated"] for r in (1.2, 4.8, 50.0)]
    assert runs[0] == simulate_conserve(conserve, model, engine, count, trace, ["colocated"])["colocated"]  # the default: the level's own rate
    assert runs[0]["ttfet_p95_s"] <= runs[1]["ttfet_p95_s"] <= runs[2]["ttfet_p95_s"]
    assert runs[0]["ttfet_p95_s"] < runs[2]["ttfet_p95_s"]  # every conversation at once on two engines queues
