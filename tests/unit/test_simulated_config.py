"""`engine.kind: simulated` in the YAML (baton/engine/config.py, baton/engine/simulated/config.py):
what validates, what fails and how the error names it, and the spec a pool's config becomes."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from baton.engine.args import build_engine_spec
from baton.engine.config import EngineConfig
from baton.engine.simulated.config import AIC_PACKAGE, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, SimulatedEngineConfig
from baton.engine.simulated.geometry import kv_geometry
from deployments.config import ConfigError, load_app_config

SIM = {"gpu": "h200_sxm", "model": "meta-llama/Meta-Llama-3.1-8B", "kv_capacity_tokens": 65536}
LOCAL_SIMULATED = Path(__file__).resolve().parents[2] / "cluster_configs" / "local_simulated.yaml"


def engine(**kw: Any) -> EngineConfig:
    return EngineConfig(model="m", **kw)


def error_of(**kw: Any) -> str:
    with pytest.raises(pydantic.ValidationError) as info:
        engine(**kw)
    return str(info.value)


def test_a_simulated_engine_validates() -> None:
    cfg = engine(kind="simulated", simulated=SIM, max_num_seqs=64, block_size=32)
    assert cfg.kind == "simulated" and cfg.simulated is not None and cfg.simulated.tp == 1 and cfg.simulated.time_scale == 1.0


def test_kind_defaults_to_vllm_and_a_vllm_engine_takes_no_simulated_section() -> None:
    assert engine().kind == "vllm"
    assert "for kind: simulated" in error_of(simulated=SIM)


def test_kind_simulated_needs_its_section() -> None:
    assert "needs engine.simulated" in error_of(kind="simulated")


@pytest.mark.parametrize("field", [{"kv_cache_gib": 2.0}, {"cpu_threads": 2}, {"extra_engine_args": {"swap_space": 1}},
                                   {"enforce_eager": False}, {"gpu_memory_utilization": 0.8}])
def test_vllm_only_fields_written_with_kind_simulated_are_refused_by_name(field: dict[str, Any]) -> None:
    (name,) = field
    message = error_of(kind="simulated", simulated=SIM, **field)
    assert name in message and "vLLM-only" in message


@pytest.mark.parametrize("capacity", [{}, {"kv_capacity_tokens": 4096, "kv_cache_gib": 1.0}])
def test_exactly_one_kv_pool_size(capacity: dict[str, Any]) -> None:
    sim = {"gpu": "h200_sxm", "model": "meta-llama/Meta-Llama-3.1-8B", **capacity}
    assert "exactly one of kv_capacity_tokens and kv_cache_gib" in error_of(kind="simulated", simulated=sim)


def test_an_unknown_gpu_model_or_field_fails_by_name() -> None:
    assert "h200_sxm" in error_of(kind="simulated", simulated={**SIM, "gpu": "h300"})  # the literal lists the known ones
    message = error_of(kind="simulated", simulated={**SIM, "model": "acme/NoSuchModel-1B"})
    assert "acme/NoSuchModel-1B" in message and "meta-llama/Meta-Llama-3.1-8B" in message
    assert "link_gpbs" in error_of(kind="simulated", simulated={**SIM, "link_gpbs": 100})
    assert "timer" in error_of(kind="simulated", simulated={**SIM, "timer": "roofline"})


def test_without_aiconfigurator_the_config_fails_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiconfigurator_core" else real(name, *a))
    with pytest.raises(pydantic.ValidationError, match=AIC_PACKAGE):
        SimulatedEngineConfig(**SIM)


def test_a_simulated_spec_carries_the_shared_scheduler_limits_and_no_vllm_arguments() -> None:
    cfg = engine(kind="simulated", simulated=SIM, max_num_seqs=48, max_model_len=8192)
    spec = build_engine_spec(cfg, role="prefill", handoff=True, model_path="/m", on_gpu=True, cache_root="/c")
    assert spec.engine_kwargs == {} and spec.env == {} and spec.model_path == "/m"
    s = spec.simulated
    assert s is not None and (s.max_num_seqs, s.max_model_len, s.role, s.handoff) == (48, 8192, "prefill", True)
    assert (s.block_size, s.max_num_batched_tokens) == (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    assert s.step_table_dir == "/c/baton/step-tables" and s.sim.timer == "table"  # the cached table unless told otherwise


def test_kv_gib_becomes_tokens_by_the_models_kv_bytes() -> None:
    llama = kv_geometry("meta-llama/Meta-Llama-3.1-8B")
    assert llama.bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert llama.tokens_in(1.0, tp=1) == (1 << 30) // 131072
    assert llama.tokens_in(1.0, tp=2) == 2 * llama.tokens_in(1.0, tp=1)  # KV heads split over the GPUs


def simulated_app(**top: Any) -> dict[str, Any]:
    eng = {"model": "m", "kind": "simulated", "simulated": SIM}
    return {"prefill": {"engine": dict(eng)}, "decode": {"engine": dict(eng)}, **top}


def test_local_simulated_yaml_validates_with_simulated_pools() -> None:
    cfg = load_app_config(yaml.safe_load(LOCAL_SIMULATED.read_text())["applications"][0]["args"])
    assert cfg.prefill is not None and cfg.routing.disaggregated
    for pool in (cfg.prefill, cfg.decode):
        assert pool.engine.kind == "simulated" and pool.engine.simulated is not None
        assert pool.engine.simulated.gpu == "h200_sxm"


@pytest.mark.parametrize(("extra", "named"), [({"memory": {}}, "memory"), ({"realtime": {}}, "realtime")])
def test_memory_and_realtime_need_a_kv_connector_a_simulated_engine_lacks(extra: dict[str, Any], named: str) -> None:
    assert load_app_config(simulated_app()).decode.engine.kind == "simulated"
    with pytest.raises(ConfigError, match=named):
        load_app_config(simulated_app(**extra))


def test_a_handoff_between_a_simulated_and_a_vllm_pool_is_refused() -> None:
    args = simulated_app()
    args["prefill"]["engine"] = {"model": "m"}
    with pytest.raises(ConfigError, match="both be simulated"):
        load_app_config(args)


def test_build_app_gives_every_pool_of_local_simulated_a_simulated_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder turns each simulated pool into a spec the replica's factory choice builds a SimulatedEngine from."""
    import deployments.app as app
    from baton.engine.simulated.engine import build_simulated_engine
    from baton.engine.vllm_engine import engine_factory_for

    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    (tmp_path / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    args = yaml.safe_load(LOCAL_SIMULATED.read_text())["applications"][0]["args"]
    args["model_cache"] = str(tmp_path)
    args["routing"]["ownership_db_path"] = str(tmp_path / "owners.sqlite3")
    specs: list[Any] = []

    def recording(cfg: EngineConfig, **kw: Any) -> Any:
        specs.append(build_engine_spec(cfg, **kw))
        return specs[-1]

    monkeypatch.setattr(app, "build_engine_spec", recording)
    app.build_app(args)
    assert [(s.simulated.role, s.simulated.handoff) for s in specs] == [("decode", True), ("prefill", True)]
    assert all(engine_factory_for(s) is build_simulated_engine and "kv_transfer_config" not in s.engine_kwargs for s in specs)


@pytest.mark.parametrize("shards", [1, 3])
def test_build_app_makes_one_directory_deployment_per_shard_shared_by_the_ingress_and_the_pools(shards: int, tmp_path: Path) -> None:
    import deployments.app as app
    from deployments.directory_client import DirectoryShards

    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    (tmp_path / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    args = yaml.safe_load(LOCAL_SIMULATED.read_text())["applications"][0]["args"]
    args["model_cache"] = str(tmp_path)
    args["routing"] = {**args["routing"], "ownership_db_path": str(tmp_path / "owners.sqlite3"), "directory_shards": shards}
    ingress = app.build_app(args)._bound_deployment
    decode, _prefill, directory = ingress.init_args[:3]
    assert isinstance(directory, DirectoryShards) and directory.count == shards
    bound = [h._bound_deployment for h in directory.shards()]
    names = ["directory"] if shards == 1 else [f"directory-{i}" for i in range(shards)]
    assert [b.name for b in bound] == names
    assert [(b.init_args[0].shard, b.init_args[0].shards) for b in bound] == [(i, shards) for i in range(shards)]
    assert {b.init_args[1] for b in bound} == {str(tmp_path / "owners.sqlite3")}  # one ownership file for every shard
    assert decode._bound_deployment.init_args[2] is directory  # the engines report to the same shards
