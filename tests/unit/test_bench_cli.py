"""`baton bench` resolves its output path once, at the CLI, so a bench started outside the
checkout hands `serve run` (which runs in the checkout) an absolute path."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from baton.bench import commands
from baton.cli import build_parser


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    seen: list[Path] = []
    fake = types.ModuleType("fake_bench")
    fake.run = lambda quick, out_dir: seen.append(out_dir)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setitem(commands.BENCHMARKS, "fake", "fake_bench")
    return seen


@pytest.mark.parametrize("out", [None, "rel/out"])
def test_out_dir_is_absolute_and_relative_to_the_caller(recorded: list[Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, out: str | None) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "fake"] + (["--out", out] if out else [])
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    (got,) = recorded
    assert got.is_absolute()
    assert got.is_relative_to(tmp_path)
    if out:
        assert got == tmp_path / out
    else:
        assert got.parent == tmp_path / "runs" and got.name.startswith("bench-fake-")


def _fake_bench(monkeypatch: pytest.MonkeyPatch, name: str) -> list[dict]:
    """Bench `name` replaced by a module that records the extra keyword arguments of each run."""
    calls: list[dict] = []
    fake = types.ModuleType(f"fake_{name}")
    fake.run = lambda quick, out_dir, **kw: calls.append(kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"fake_{name}", fake)
    monkeypatch.setitem(commands.BENCHMARKS, name, f"fake_{name}")
    return calls


def test_offline_reaches_only_the_checkpoints_bench(recorded: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_bench(monkeypatch, "checkpoints")
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["bench", "checkpoints", "--quick", "--offline"])
    assert args.func(args) == 0 and calls == [{"offline": True}]
    args = build_parser().parse_args(["bench", "fake", "--offline"])
    with pytest.raises(SystemExit):
        args.func(args)
    assert not recorded


@pytest.mark.parametrize("bench", ["memory", "window-quality"])
def test_dtype_reaches_only_the_memory_and_window_quality_benches(recorded: list[Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, bench: str) -> None:
    calls = _fake_bench(monkeypatch, bench)
    monkeypatch.chdir(tmp_path)
    for argv, expected in ((["bench", bench, "--quick", "--dtype", "float32"], {"dtype": "float32"}),
                           (["bench", bench, "--quick"], {})):
        args = build_parser().parse_args(argv)
        assert args.func(args) == 0 and calls[-1] == expected
    args = build_parser().parse_args(["bench", "fake", "--dtype", "float32"])
    with pytest.raises(SystemExit):
        args.func(args)
    assert not recorded
    with pytest.raises(SystemExit):  # not a dtype the bench takes
        build_parser().parse_args(["bench", "memory", "--dtype", "int8"])


def test_fidelity_only_reaches_only_the_memory_bench(recorded: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_bench(monkeypatch, "memory")
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["bench", "memory", "--fidelity-only", "--dtype", "float32"])
    assert args.func(args) == 0 and calls == [{"dtype": "float32", "fidelity_only": True}]
    args = build_parser().parse_args(["bench", "fake", "--fidelity-only"])
    with pytest.raises(SystemExit, match="only for `baton bench memory`"):
        args.func(args)
    assert not recorded


def test_rates_and_ttft_slo_reach_only_the_conserve_bench(recorded: list[Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_bench(monkeypatch, "conserve")
    monkeypatch.chdir(tmp_path)
    for argv, expected in ((["--rates", "0.05,0.15"], {"rates": (0.05, 0.15)}),
                           (["--rates", "0.1", "--ttft-slo", "9"], {"rates": (0.1,), "ttft_slo_s": 9.0}),
                           ([], {})):
        args = build_parser().parse_args(["bench", "conserve", "--quick", *argv])
        assert args.func(args) == 0 and calls[-1] == expected
    args = build_parser().parse_args(["bench", "fake", "--rates", "0.1"])
    with pytest.raises(SystemExit, match="only for `baton bench conserve`"):
        args.func(args)
    assert not recorded
    for bad in (["--rates", "0.2,0.1"], ["--rates", "0.1,0.1"], ["--rates", "0,0.1"], ["--rates", "fast"], ["--rates", "inf"],
                ["--ttft-slo", "-1"], ["--ttft-slo", "nan"]):
        with pytest.raises(SystemExit):  # argparse refuses it with a message
            build_parser().parse_args(["bench", "conserve", *bad])


def test_variants_reach_only_the_control_bench_and_unknown_ones_are_refused(recorded: list[Path], tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_bench(monkeypatch, "control")
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["bench", "control", "--quick", "--variants", "throughput_optimized,sharded_directory"])
    assert args.func(args) == 0 and calls[-1] == {"variants": "throughput_optimized,sharded_directory"}
    args = build_parser().parse_args(["bench", "control", "--variants", "fastest"])
    with pytest.raises(SystemExit, match="--variants: unknown variants"):
        args.func(args)
    args = build_parser().parse_args(["bench", "fake", "--variants", "pin_cache"])
    with pytest.raises(SystemExit, match="only for `baton bench control`"):
        args.func(args)
    assert len(calls) == 1
