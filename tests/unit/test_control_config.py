"""baton/bench/control_config.py and its registration: the app args the bench hands `serve run`
validate (deployments.config.load_app_config, the builder's own check), at every fleet size of
both sweeps in every variant, the variants alternate their order from size to size, and
`baton bench control` reaches baton.bench.control.run."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from baton.bench import commands
from baton.bench.control_config import (
    CONFIG,
    MAX_TOKENS,
    NO_PIN_CACHE,
    PIN_CACHE,
    REPLICA_CPUS,
    SHARDED_DIRECTORY,
    SLOT,
    THROUGHPUT_OPTIMIZED,
    TIME_SCALE,
    VARIANTS,
    Variant,
    app_args,
    pick_variants,
    served_model,
    start_timeout_s,
    sweep,
    variant_order,
)
from deployments.config import ConfigError, RoutingConfig, load_app_config


@pytest.mark.parametrize("variant", (*VARIANTS, SHARDED_DIRECTORY), ids=lambda v: v.name)
@pytest.mark.parametrize("quick", [True, False])
def test_every_size_of_the_sweep_is_a_valid_config(quick: bool, variant: Variant, tmp_path: Path) -> None:
    sw = sweep(quick)
    for n in sw.replicas:
        cfg = load_app_config(app_args(n, tmp_path, max_concurrency=max(sw.concurrencies), pin_cache_sync_s=variant.pin_cache_sync_s,
                                       directory_shards=variant.directory_shards))
        assert cfg.routing.pin_cache_sync_s == variant.pin_cache_sync_s
        assert cfg.routing.directory_shards == variant.directory_shards
        assert cfg.decode.num_replicas == n and cfg.routing.policy == "colocated"
        assert cfg.prefill is not None and cfg.prefill.num_replicas == 0
        assert cfg.decode.engine.kind == "simulated" and cfg.decode.engine.simulated is not None
        assert cfg.decode.engine.simulated.time_scale == TIME_SCALE
        assert cfg.decode.resources.num_cpus == REPLICA_CPUS and cfg.decode.resources.custom == {SLOT: 1.0}
        assert n * REPLICA_CPUS <= 2  # the 2-CPU head holds them all
        assert cfg.ingress.default_max_tokens == MAX_TOKENS and cfg.ingress.max_inflight_requests >= max(sw.concurrencies)
        assert cfg.routing.ownership_db_path == str(tmp_path / "conversations.sqlite3")


def test_sweeps() -> None:
    quick, full = sweep(True), sweep(False)
    assert quick.replicas == (8, 32) and quick.concurrencies == (8, 32) and quick.duration_s == 20
    assert full.replicas == (8, 32, 64, 128) and full.concurrencies == (8, 32, 128) and full.duration_s == 45
    for sw in (quick, full):
        assert list(sw.replicas) == sorted(sw.replicas) and list(sw.concurrencies) == sorted(sw.concurrencies)
    assert start_timeout_s(128) > start_timeout_s(8)


def test_the_variants_are_the_pin_cache_off_at_its_default_and_under_serves_throughput_mode() -> None:
    assert [v.name for v in VARIANTS] == ["no_pin_cache", "pin_cache", "throughput_optimized"]
    assert len({v.name for v in VARIANTS}) == len(VARIANTS)
    assert NO_PIN_CACHE.pin_cache_sync_s == 0.0
    assert PIN_CACHE.pin_cache_sync_s == RoutingConfig.model_fields["pin_cache_sync_s"].default == 0.5  # the default config
    assert THROUGHPUT_OPTIMIZED.pin_cache_sync_s == PIN_CACHE.pin_cache_sync_s  # only the Serve mode differs
    for v in (NO_PIN_CACHE, PIN_CACHE):  # Serve's defaults, through the proxy
        assert v.env(28800) == {} and v.load_port(28800) == 28800
    env = THROUGHPUT_OPTIMIZED.env(28800)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "28801" == str(THROUGHPUT_OPTIMIZED.load_port(28800))


def test_the_variant_order_alternates_from_size_to_size() -> None:
    assert variant_order(0) == (NO_PIN_CACHE, PIN_CACHE, THROUGHPUT_OPTIMIZED)  # the first size: as declared
    assert variant_order(1) == (THROUGHPUT_OPTIMIZED, PIN_CACHE, NO_PIN_CACHE)  # the second: reversed
    assert variant_order(2) == variant_order(0) and variant_order(3) == variant_order(1)
    firsts = [variant_order(i)[0].name for i in range(len(sweep(False).replicas))]
    assert firsts.count("throughput_optimized") == firsts.count("no_pin_cache") == 2
    assert all(set(variant_order(i)) == set(VARIANTS) and len(variant_order(i)) == len(VARIANTS) for i in range(4))  # every variant, once, at every size
    with pytest.raises(ValueError):
        variant_order(-1)


def test_args_are_a_copy_of_local_simulated_yaml(tmp_path: Path) -> None:
    before = CONFIG.read_text()
    args = app_args(8, tmp_path, max_concurrency=8, pin_cache_sync_s=0.5)
    original = yaml.safe_load(before)["applications"][0]["args"]
    assert args["decode"]["engine"]["simulated"]["gpu"] == original["decode"]["engine"]["simulated"]["gpu"]
    assert original["decode"]["engine"]["simulated"]["time_scale"] == 1.0 and CONFIG.read_text() == before
    assert served_model(args) == original["ingress"]["served_model_name"]


def test_a_broken_override_fails_validation(tmp_path: Path) -> None:
    args = app_args(8, tmp_path, max_concurrency=8, pin_cache_sync_s=0.0)
    args["decode"]["resources"]["typo"] = 1  # extra="forbid"
    with pytest.raises(ConfigError, match="typo"):
        load_app_config(args)
    with pytest.raises(ValueError):
        app_args(0, tmp_path, max_concurrency=8, pin_cache_sync_s=0.0)
    with pytest.raises(ConfigError, match="pin_cache_sync_s"):
        load_app_config(app_args(8, tmp_path, max_concurrency=8, pin_cache_sync_s=-1.0))


def test_bench_control_is_registered() -> None:
    assert commands.BENCHMARKS["control"] == "baton.bench.control"
    module = importlib.import_module(commands.BENCHMARKS["control"])
    assert callable(module.run) and module.HTTP_PORT != module.RAY_PORT


def test_its_ports_are_no_other_benchs() -> None:
    from baton.bench import control

    others = [p for p in Path(commands.__file__).parent.glob("*.py") if p.name != "control.py"]
    for port in (control.HTTP_PORT, control.RAY_PORT):
        assert not [p.name for p in others if str(port) in p.read_text()]


def test_the_sharded_directory_variant_is_the_throughput_mode_with_two_shards_and_runs_on_request() -> None:
    assert SHARDED_DIRECTORY not in VARIANTS and pick_variants(None) == VARIANTS
    assert SHARDED_DIRECTORY.directory_shards == 2 and all(v.directory_shards == 1 for v in VARIANTS)
    assert SHARDED_DIRECTORY.env(28800) == THROUGHPUT_OPTIMIZED.env(28800) and SHARDED_DIRECTORY.load_port(28800) == 28801
    assert SHARDED_DIRECTORY.pin_cache_sync_s == THROUGHPUT_OPTIMIZED.pin_cache_sync_s  # only the shards differ
    assert pick_variants("sharded_directory, throughput_optimized") == (THROUGHPUT_OPTIMIZED, SHARDED_DIRECTORY)  # declared order
    for bad in ("", "sharded", "pin_cache,nope"):
        with pytest.raises(ValueError, match="choose from"):
            pick_variants(bad)
