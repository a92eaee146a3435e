"""baton/engine/simulated/step_table*.py: the step-time table against AicStepTimer, and its cache.

Accuracy (h200_sxm, Llama-3.1-8B, tp 1; 2,000 random batches per case, seed 1, measured when
written, relative error of the table's step time against AicStepTimer's on the same batch):

    limits (seqs, tokens, len)   decode-only p95 / max     mixed p95 / max
    64, 8192, 8192               0.015 % / 0.024 %         0.010 % / 0.070 %
    256, 16384, 32768            0.023 % / 1.2 %           0.025 % / 1.0 %
    1024, 65536, 131072          0.007 % / 0.63 %          0.017 % / 0.69 %

The bounds asserted (p95 ≤ 0.2 %, max ≤ 2 %) leave room for other draws: what remains is where
AIConfigurator's curves bend between two log-spaced points of context (16 an octave) or of a
prefill's new tokens and prefix (8 an octave); the token-count axes whose kernels step (shared
GEMMs, decode batch sizes) are sampled on both sides of every step, so they are exact. 2 % of a
step is well inside what AIConfigurator itself claims against real GPUs.

The cache tests use a tiny table and a fake builder (no AIConfigurator); the accuracy tests use
the repo's cached table (.cache/baton/step-tables, built here on first use, ~15 s of CPU).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from baton.engine.simulated.step_table import ARRAYS, AXES, SHAPES, Axis, StepTable, TableKey, TableStepTimer, main
from baton.engine.simulated.step_table_cache import load_or_build, save_table, table_dir, table_key
from baton.engine.simulated.timing import AicStepTimer, PrefillChunk, StepBatch
from baton.paths import REPO_ROOT

GPU, MODEL = "h200_sxm", "meta-llama/Meta-Llama-3.1-8B"
LIMITS = [(64, 8192, 8192), (256, 16384, 32768), (1024, 65536, 131072)]
DRAWS = 2000


@pytest.fixture(scope="module")
def table() -> StepTable:
    return load_or_build(table_dir(str(REPO_ROOT / ".cache")), GPU, MODEL, 1)


@pytest.fixture(scope="module")
def aic() -> AicStepTimer:
    return AicStepTimer(GPU, MODEL, 1)


def _context(rng: random.Random, limit: int) -> int:
    return max(0, min(limit - 1, int(np.exp(rng.uniform(0, np.log(limit))))))


def random_batch(rng: random.Random, seqs: int, budget: int, max_len: int, mixed: bool) -> StepBatch:
    """A batch the engine could schedule: at most `seqs` sequences and `budget` tokens, contexts
    log-uniform below max_len; mixed: 1-8 heterogeneous chunks, half of them after a cached prefix."""
    n_dec = rng.randint(0 if mixed else 1, seqs - (1 if mixed else 0))
    decodes = tuple(_context(rng, max_len) for _ in range(n_dec))
    if not mixed:
        return StepBatch((), decodes)
    left = budget - n_dec
    k = rng.randint(1, min(seqs - n_dec, 8, left))
    chunks: list[PrefillChunk] = []
    for i in range(k):
        new = max(1, min(left - (k - i - 1), int(np.exp(rng.uniform(0, np.log(max(2, left)))))))
        left -= new
        chunks.append(PrefillChunk(new, rng.choice([0, _context(rng, max_len - new)]) if max_len - new > 1 else 0))
        if left <= k - i - 1:
            break
    return StepBatch(tuple(chunks), decodes)


@pytest.mark.parametrize("limits", LIMITS, ids=lambda lim: "x".join(map(str, lim)))
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_the_table_times_random_batches_as_aiconfigurator_does(table: StepTable, aic: AicStepTimer,
                                                               limits: tuple[int, int, int], mixed: bool) -> None:
    rng, timer = random.Random(1), TableStepTimer(table)
    errors = []
    for _ in range(DRAWS):
        batch = random_batch(rng, *limits, mixed)
        want, got = aic.step_time(batch), timer.step_time(batch)
        assert got.kind == want.kind
        errors.append(abs(got.seconds - want.seconds) / want.seconds)
    p95, worst = float(np.percentile(errors, 95)), max(errors)
    print(f"\n{limits} {'mixed' if mixed else 'decode'}: p95 {100 * p95:.3f} %, max {100 * worst:.3f} %")
    assert p95 <= 0.002 and worst <= 0.02


def test_on_grid_points_the_table_is_aiconfigurator(table: StepTable, aic: AicStepTimer) -> None:
    h = aic.handle
    assert table.decode_ms(48, 1024) == pytest.approx(h.predict_decode_latency(48, 1024, 2), rel=1e-5)
    assert table.shared_ms(257) == pytest.approx(h.mixed_step_breakdown(257, 0, 257, 1, 0)[1], rel=1e-5)  # past a GEMM step
    assert table.ctx_attn_ms(4, 256, 0) == pytest.approx(h.mixed_step_breakdown(1024, 0, 256, 1, 0)[2], rel=1e-5)
    assert table.dec_attn_ms(64, 2048) == pytest.approx(h.mixed_step_breakdown(0, 64, 2048, 1, 0)[3], rel=1e-5)


def test_an_empty_batch_takes_no_time_and_a_table_step_is_microseconds_of_cpu(table: StepTable) -> None:
    timer = TableStepTimer(table)
    assert timer.step_time(StepBatch()).seconds == 0.0
    rng = random.Random(2)
    batches = [random_batch(rng, 64, 8192, 8192, i % 2 == 0) for i in range(1000)]
    t0 = time.process_time()
    for b in batches:
        timer.step_time(b)
    per_call = (time.process_time() - t0) / len(batches)
    print(f"\nTableStepTimer.step_time: {per_call * 1e6:.1f} us of CPU a call")
    assert per_call < 200e-6


def tiny_table(key: TableKey, scale: float = 1.0) -> StepTable:
    """Two points an axis; every grid is log(scale × x) along its first axis."""
    axes = {n: np.array([0, 1] if n == "prefix" else [1, 2], dtype=np.int64) for n in AXES}
    arrays = {n: np.log(scale * np.broadcast_to(np.array([1.0, 2.0]).reshape((2,) + (1,) * (len(d) - 1)), (2,) * len(d)))
              .astype(np.float32) for n, d in SHAPES.items()}
    return StepTable(key, axes, arrays, build_seconds=0.25)


def test_an_axis_clamps_below_and_extrapolates_above() -> None:
    ax = Axis(np.array([1, 4, 16]), 0.0)
    assert ax.locate(1) == (0, 0.0) and ax.locate(0.5) == (0, 0.0)
    assert ax.locate(2) == (0, pytest.approx(0.5)) and ax.locate(4) == (1, 0.0)
    assert ax.locate(64) == (1, pytest.approx(2.0))  # the last interval's power law, two intervals on
    t = tiny_table(table_key(GPU, MODEL, 1))
    assert t.shared_ms(4) == pytest.approx(4.0) and t.shared_ms(1) == pytest.approx(1.0)  # 1 ms x tokens: extrapolated exactly


def test_limits_past_the_grid_are_named() -> None:
    t = tiny_table(table_key(GPU, MODEL, 1))
    assert t.uncovered(2, 2, 1) == []
    assert [s.split(" ")[0] for s in t.uncovered(3, 2, 4)] == ["seqs", "chunks", "ctx", "prefix"]


def test_a_table_that_breaks_its_invariants_is_refused() -> None:
    good = tiny_table(table_key(GPU, MODEL, 1))
    with pytest.raises(ValueError, match="seqs"):
        StepTable(good.key, {**good.axes, "seqs": np.array([2, 1])}, good.arrays)
    with pytest.raises(ValueError, match="shared"):
        StepTable(good.key, good.axes, {**good.arrays, "shared": np.array([0.0, np.nan], dtype=np.float32)})


def _build_slowly(key: TableKey) -> StepTable:  # module level: a forked process calls it
    with open(os.environ["STEP_TABLE_BUILDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    return tiny_table(key)


def _load(folder: str) -> float:
    return load_or_build(folder, GPU, MODEL, 1, build=_build_slowly).shared_ms(2)


def test_replicas_starting_at_once_build_one_table_between_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEP_TABLE_BUILDS", str(tmp_path / "builds.log"))
    folder = str(tmp_path / "tables")
    with multiprocessing.get_context("fork").Pool(6) as pool:
        got = pool.map(_load, [folder] * 6)
    assert got == [pytest.approx(2.0)] * 6
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert os.listdir(folder) == [table_key(GPU, MODEL, 1).filename] or sorted(os.listdir(folder)) == sorted(
        [table_key(GPU, MODEL, 1).filename, table_key(GPU, MODEL, 1).filename + ".lock"])  # no temporary file left


def test_a_saved_table_loads_as_it_was(tmp_path: Path) -> None:
    key = table_key(GPU, MODEL, 1)
    save_table(tiny_table(key, scale=3.0), str(tmp_path / key.filename))
    back = load_or_build(str(tmp_path), GPU, MODEL, 1, build=lambda k: pytest.fail("it must load, not build"))
    assert back.key == key and back.build_seconds == 0.25 and back.shared_ms(2) == pytest.approx(6.0)
    assert all(np.array_equal(back.arrays[n], tiny_table(key, 3.0).arrays[n]) for n in ARRAYS)


def test_a_corrupt_or_foreign_file_is_rebuilt(tmp_path: Path) -> None:
    key = table_key(GPU, MODEL, 1)
    (tmp_path / key.filename).write_bytes(b"not a table")
    assert load_or_build(str(tmp_path), GPU, MODEL, 1, build=tiny_table).shared_ms(2) == pytest.approx(2.0)
    other = TableKey(GPU, "Qwen/Qwen3-8B", 1, key.aic_version, key.grid_version)
    save_table(tiny_table(other, scale=5.0), str(tmp_path / key.filename))
    assert load_or_build(str(tmp_path), GPU, MODEL, 1, build=tiny_table).shared_ms(2) == pytest.approx(2.0)


def test_a_folder_that_cannot_be_written_builds_in_memory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert load_or_build(str(tmp_path / "file" / "tables"), GPU, MODEL, 1, build=tiny_table).shared_ms(2) == pytest.approx(2.0)


def test_the_key_names_gpu_model_tp_and_both_versions() -> None:
    key = TableKey("h200_sxm", "meta-llama/Meta-Llama-3.1-8B", 2, "0.12.0", 1)
    assert key.filename == "h200_sxm--meta-llama--Meta-Llama-3.1-8B--tp2--aic0.12.0--v1.npz"


SUBPROCESS = """
import json, sys, time
t0 = time.process_time()
from baton.engine.args import build_engine_spec
from baton.engine.config import EngineConfig
from baton.engine.simulated.engine import build_simulated_engine
from baton.engine.simulated.timing import PrefillChunk, StepBatch
sim = {"gpu": "h200_sxm", "model": "meta-llama/Meta-Llama-3.1-8B", "kv_cache_gib": 40, "timer": sys.argv[1]}
cfg = EngineConfig(model="m", kind="simulated", simulated=sim, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=8192)
spec = build_engine_spec(cfg, role="decode", handoff=False, model_path="/m", on_gpu=False, cache_root=sys.argv[2])
engine = build_simulated_engine(spec)
for n in (1, 16, 64):
    for ctx in (100, 1000, 8000):
        engine.timer.step_time(StepBatch((PrefillChunk(512, ctx),), (ctx,) * n))
        engine.timer.step_time(StepBatch((), (ctx,) * n))
mem = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM"))}
print(json.dumps({"aic": "aiconfigurator_core" in sys.modules, "rss_mib": mem["VmRSS"], "peak_rss_mib": mem["VmHWM"],
                  "cpu_s": time.process_time() - t0}))
"""


def engine_process(timer: str) -> dict[str, float]:
    """A fresh python that builds a SimulatedEngine (local_simulated.yaml's limits) and times 18 steps."""
    out = subprocess.run([sys.executable, "-c", SUBPROCESS, timer, str(REPO_ROOT / ".cache")], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_replica_on_the_table_never_imports_aiconfigurator(table: StepTable) -> None:
    """`table` builds the cached file first; the subprocess then only loads it. RSS (from /proc: a
    forked child's ru_maxrss is its parent's) and CPU of both timers in the same fresh process are
    printed (README "Simulated engines" quotes them)."""
    on_table = engine_process("table")
    assert on_table["aic"] is False
    direct = engine_process("aiconfigurator")
    assert direct["aic"] is True
    print(f"\ntable: {on_table}\naiconfigurator: {direct}")
    assert on_table["rss_mib"] < direct["rss_mib"]


def test_the_command_line_prints_the_table_it_finds(table: StepTable, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--gpu", GPU, "--model", MODEL, "--tp", "1", "--dir", table_dir(str(REPO_ROOT / ".cache"))])
    out = capsys.readouterr().out
    assert table.key.filename in out and "loaded" in out and "KiB" in out
