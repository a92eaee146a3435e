"""baton/bench/api.py without a cluster: its config is local_grpc.yaml's (valid, keyed, gRPC on),
and the per-protocol figures count every replay of a protocol and never drop an error."""
from __future__ import annotations

import pytest

from baton.bench import api
from deployments.config import load_app_config


def test_the_bench_runs_local_grpc_yaml_with_keys_and_fresh_state() -> None:
    args = api.bench_args()
    cfg = load_app_config(args)
    assert cfg.ingress.api_keys_env == "BATON_API_KEYS"
    assert "baton-api-bench-" in args["routing"]["ownership_db_path"] and "baton-api-bench-" in args["memory"]["db_path"]
    assert api.grpc_servicers() == ["deployments.grpc_gen.baton_pb2_grpc.add_BatonServicer_to_server"]
    assert api.ORDER == ("http", "grpc", "grpc", "http")  # ABBA


def row(i: int, protocol: str, ttfts: list[float], errors: int = 0, tokens: int = 100, seconds: float = 10.0) -> dict[str, object]:
    return {"replay": i, "protocol": protocol, "turns": len(ttfts) + errors, "errors": errors, "ttfts_s": ttfts,
            "completion_tokens": tokens, "duration_s": seconds}


def test_per_protocol_pools_each_protocols_replays() -> None:
    rows = [row(0, "http", [1.0, 3.0]), row(1, "grpc", [2.0]), row(2, "grpc", [4.0], errors=1, tokens=50, seconds=5.0),
            row(3, "http", [5.0])]
    got = api.per_protocol(rows)
    assert got["http"]["replays"] == 2 and got["http"]["ttft_p50_s"] == 3.0 and got["http"]["errors"] == 0
    assert got["grpc"]["ttft_p50_s"] == 3.0 and got["grpc"]["errors"] == 1 and got["grpc"]["turns"] == 3
    assert got["grpc"]["output_tokens_per_s"] == pytest.approx(150 / 15.0)
    assert api.per_protocol([row(0, "http", [])])["http"]["ttft_p50_s"] is None


def test_each_abba_round_has_its_own_ratios() -> None:
    rows = [row(0, "http", [1.0]), row(1, "grpc", [2.0]), row(2, "grpc", [2.0]), row(3, "http", [1.0]),
            row(4, "http", [2.0]), row(5, "grpc", [1.0], tokens=200), row(6, "grpc", [1.0], tokens=200), row(7, "http", [2.0])]
    rounds = api.per_round(rows)
    assert [r["round"] for r in rounds] == [0, 1]
    assert rounds[0]["ttft_ratio"] == 2.0 and rounds[1]["ttft_ratio"] == 0.5
    assert rounds[0]["tokens_per_s_ratio"] == 1.0 and rounds[1]["tokens_per_s_ratio"] == 2.0
    assert api.per_round(rows[:3]) == []  # an unfinished round has no ratio
