"""The overhead bench's `vllm serve` baseline gets the engine arguments the other phases get,
as flags vLLM's own server parser accepts (no engine is built)."""
from __future__ import annotations

import pytest

from baton.bench.overhead import _engine_config, vllm_serve_argv
from baton.engine.args import build_engine_spec


def test_vllm_serve_gets_the_same_engine_arguments(tmp_path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = build_engine_spec(_engine_config(8192), role="decode", handoff=False, model_path=str(tmp_path), on_gpu=False,
                             cache_root=str(tmp_path))
    argv = vllm_serve_argv(spec, 28100)
    assert argv[:3] == ["vllm", "serve", str(tmp_path)]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    args = AsyncEngineArgs.from_cli_args(ns)
    from baton.engine.vllm_engine import engine_kwargs_here

    kw = engine_kwargs_here(spec)
    assert kw["dtype"] in ("bfloat16", "float32")  # `auto` resolved for this CPU, as the other phases' engines
    for field in ("max_model_len", "dtype", "enforce_eager", "enable_prefix_caching", "max_num_seqs", "seed", "kv_cache_memory_bytes"):
        assert getattr(args, field) == kw[field], field
    assert ns.port == 28100


def test_hop_breakdown_medians_and_own_time():
    from baton.bench.overhead import hop_breakdown

    rows = [{"total": 0.100, "engine": 0.080, "outside": 0.005, "parse": 0.001},
            {"total": 0.110, "engine": 0.085, "outside": 0.004},
            {"total": 0.130, "engine": 0.090, "outside": 0.006},
            {"parse": 0.002}]  # a request without the engine hop counts for parse only
    out = hop_breakdown(rows)
    assert out["parse"] == pytest.approx(0.0015)
    assert out["engine"] == pytest.approx(0.085)
    # own = TTFT − engine = total − engine + outside per request: 0.025, 0.029, 0.046 → median 0.029
    assert out["own"] == pytest.approx(0.029)
    assert "own" not in hop_breakdown([{"parse": 0.001}])


def _phase(c1: float, closed: float, open_p50: float, open_p95: float, own: float | None = None, paired: float | None = None) -> dict:
    def summary(p50: float, p95: float) -> dict:
        return {"name": "x", "requests": 12, "wall_s": 10.0, "ttft_p50_s": p50, "ttft_p95_s": p95, "e2e_p50_s": 2 * p50,
                "output_tok_per_s": 1 / p50}
    phase = {"summary": summary(closed, 4.0), "single": summary(c1, c1), "open": summary(open_p50, open_p95),
             "open_rate_per_s": 0.36, "start_s": 25.0, "rss_bytes": 1 << 30}
    if own is not None:
        phase["hops_single"] = {"own": own}
    if paired is not None:  # the bare engine's c1 pass right after this phase
        phase["bare_c1_paired"] = summary(paired, paired)
    return phase


def test_ratios_and_result_line_from_phase_reports():
    from baton.bench.overhead_result import overhead_ratios, result_line

    bare = _phase(c1=0.080, closed=0.160, open_p50=0.100, open_p95=0.150)
    served = _phase(c1=0.090, closed=0.400, open_p50=0.110, open_p95=0.170, paired=0.082)
    baton = _phase(c1=0.104, closed=0.380, open_p50=0.130, open_p95=0.210, own=0.024, paired=0.080)
    direct = _phase(c1=0.096, closed=0.390, open_p50=0.120, open_p95=0.180, own=0.016, paired=0.088)
    fast = _phase(c1=0.092, closed=0.400, open_p50=0.108, open_p95=0.165, own=0.012, paired=0.100)  # the host slowed
    prepare = {"ratio_p50": 0.1, "whole_ms_p50": 5.0, "incremental_ms_p50": 0.5}
    r = overhead_ratios(bare, served, baton, direct, fast, prepare)
    assert r["ttft_p50_ratio"] == pytest.approx(0.380 / 0.160)  # the closed loop at concurrency > 1
    assert r["ttft_p50_ratio_c1"] == pytest.approx(1.3)
    assert r["ttft_p50_ratio_open"] == pytest.approx(1.3)
    assert r["ttft_p95_ratio_open"] == pytest.approx(1.4)
    assert r["ttft_p50_ratio_open_vllm_serve"] == pytest.approx(1.1)
    assert r["ttft_p50_ratio_open_vs_vllm_serve"] == pytest.approx(0.130 / 0.110)
    assert r["ttft_p50_ratio_open_throughput_optimized"] == pytest.approx(1.08)
    assert r["ttft_p50_ratio_c1_engine_normalized"] == pytest.approx((0.080 + 0.024) / 0.080)
    assert r["ttft_p50_ratio_c1_engine_normalized_throughput_optimized"] == pytest.approx(1.15)
    # paired: each phase over the bare pass right after it; the drift across phases does not enter
    assert r["ttft_p50_ratio_c1_paired_throughput_optimized"] == pytest.approx(0.92)
    assert r["ttft_p50_ratio_c1_throughput_optimized"] == pytest.approx(1.15)
    assert r["ttft_p50_ratio_c1_paired"] == pytest.approx(1.3)
    assert r["ttft_p50_ratio_c1_paired_vllm_serve"] == pytest.approx(0.090 / 0.082)
    assert r["ttft_p50_ratio_c1_paired_direct_ingress"] == pytest.approx(0.096 / 0.088)
    assert r["bare_c1_spread"] == pytest.approx(0.100 / 0.080)
    line = result_line(r, bare, baton, fast, prepare)
    fields = dict(f.split("=", 1) for f in line.removeprefix("RESULT ").split())
    assert line.startswith("RESULT ") and len(fields) == len(line.split()) - 1  # every field is key=value, no repeats
    assert fields["ttft_p50_ratio_open_throughput_optimized"] == "1.080"
    assert fields["own_ms_c1_throughput_optimized"] == "12.0"
    assert fields["open_loop_rate_per_s"] == "0.36"
    assert fields["ttft_p50_ratio_c1_engine_normalized_throughput_optimized"] == "1.150"
    assert fields["ttft_p50_ratio_c1_paired_throughput_optimized"] == "0.920" and fields["bare_c1_spread"] == "1.250"


def _fake_bare(first: int, commands, out) -> None:  # a stand-in for _bare_phase, in the child process
    if first < 0:
        raise SystemExit(3)  # dies before its first result
    out.put({"first": first})
    passes = 0
    while commands.get() == "c1":
        passes += 1
        out.put({"pass": passes})


def test_the_kept_bare_process_answers_one_pass_per_c1_and_stops():
    from baton.bench.overhead import _BareChild

    child = _BareChild(_fake_bare, 7)
    try:
        assert child.first == {"first": 7}
        assert child.c1() == {"pass": 1} and child.c1() == {"pass": 2}
    finally:
        child.close()
    assert not child._proc.is_alive() and child._proc.exitcode == 0


def test_a_bare_process_that_dies_is_an_error_not_a_hang():
    from baton.bench.overhead import _BareChild

    with pytest.raises(RuntimeError, match="exited with 3"):
        _BareChild(_fake_bare, -1)
