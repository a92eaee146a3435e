"""Config -> engine (baton/engine/args.py, kv_transfer/config.py) and config -> Serve options
(the pure helpers of deployments/app.py). No engine or Ray is started."""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from baton.engine.args import GIB, EngineSpec, build_engine_spec, resolve_model_path
from baton.engine.config import EngineConfig
from deployments.config import AppConfig, ConfigError, PoolConfig, load_app_config
from kv_transfer.config import PoolRole, kv_transfer_engine_arg, kv_transfer_plan
from router.policy import DISAGGREGATED

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.app import PROJECT_ROOT, build_app, pool_options, project_path, ray_actor_options
    from deployments.pool import EngineReplicaDeployment

MODEL_PATH = "/models/m"
CACHE_ROOT = "/cache-root"


def spec_of(cfg: EngineConfig | None = None, *, role: PoolRole = "decode", handoff: bool = False, on_gpu: bool = False) -> EngineSpec:
    return build_engine_spec(
        cfg or EngineConfig(model="m"), role=role, handoff=handoff, model_path=MODEL_PATH, on_gpu=on_gpu, cache_root=CACHE_ROOT
    )


# ---- kv_transfer_config by handoff and role ---------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("on_gpu", [False, True])
def test_engines_without_a_handoff_have_no_kv_connector(role: PoolRole, on_gpu: bool) -> None:
    assert "kv_transfer_config" not in spec_of(role=role, handoff=False, on_gpu=on_gpu).engine_kwargs
    assert kv_transfer_plan(role, handoff=False, on_gpu=on_gpu).connector is None


NIXL_PLANS = [
    ("prefill", False, {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}),
    ("decode", False, {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}),
    ("prefill", True, {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda"}),
    ("decode", True, {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda"}),
]


@pytest.mark.parametrize("role, on_gpu, expected", NIXL_PLANS)
def test_handoff_engines_plan_nixl_by_role(role: PoolRole, on_gpu: bool, expected: dict[str, str]) -> None:
    plan = kv_transfer_plan(role, handoff=True, on_gpu=on_gpu)
    assert {"kv_connector": plan.connector, "kv_role": plan.role, "kv_buffer_device": plan.buffer_device} == expected


def test_engines_without_a_handoff_need_no_nixl_module() -> None:
    # kv_transfer.nixl (vLLM/NIXL imports) is only imported when a connector is configured
    assert kv_transfer_engine_arg("decode", handoff=False, on_gpu=False) is None


@pytest.mark.parametrize("role, on_gpu, expected", NIXL_PLANS)
def test_handoff_engines_get_the_nixl_connector_in_their_kwargs(role: PoolRole, on_gpu: bool, expected: dict[str, str]) -> None:
    kv = spec_of(role=role, handoff=True, on_gpu=on_gpu).engine_kwargs["kv_transfer_config"]
    assert kv == kv_transfer_engine_arg(role, handoff=True, on_gpu=on_gpu)
    # Baton's counting subclass of vLLM's NIXL connector, with the role and device of the plan
    assert kv["kv_role"] == expected["kv_role"] and kv["kv_buffer_device"] == expected["kv_buffer_device"]
    assert "Nixl" in str(kv.get("kv_connector", "")) + str(kv.get("kv_connector_module_path", ""))
    assert kv.get("kv_load_failure_policy") == "recompute"  # a failed pull is recomputed, the request succeeds


@pytest.mark.parametrize("policy", ["conversation", "per_turn_pd", "conditional_pd", "colocated", "round_robin"])
def test_build_app_gives_engines_a_handoff_exactly_under_disaggregated_policies(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routing layer's DISAGGREGATED set, not the KV bridge, decides which engines hand KV off."""
    import deployments.app as app

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    calls: list[tuple[str, bool]] = []

    def recording(cfg: EngineConfig, **kw: Any) -> EngineSpec:
        calls.append((kw["role"], kw["handoff"]))
        return build_engine_spec(cfg, **{**kw, "handoff": False})  # no NIXL import needed here

    monkeypatch.setattr(app, "build_engine_spec", recording)
    prefill_replicas = 1 if policy in DISAGGREGATED else 0
    app.build_app({"model_cache": str(tmp_path), "routing": {"policy": policy},
                   "prefill": {"num_replicas": prefill_replicas, "engine": {"model": "m"}}, "decode": {"engine": {"model": "m"}}})
    handoff = policy in DISAGGREGATED
    assert calls == ([("decode", True), ("prefill", True)] if handoff else [("decode", False)])


# ---- engine kwargs -----------------------------------------------------------------------------


def test_engine_kwargs_come_from_the_config() -> None:
    cfg = EngineConfig(model="m", max_model_len=2048, dtype="float32", enforce_eager=False, enable_prefix_caching=False, max_num_seqs=7, seed=42)
    kw = spec_of(cfg).engine_kwargs
    assert kw["model"] == MODEL_PATH and kw["tokenizer"] == MODEL_PATH
    assert (kw["max_model_len"], kw["dtype"], kw["enforce_eager"], kw["enable_prefix_caching"], kw["max_num_seqs"], kw["seed"]) == (
        2048, "float32", False, False, 7, 42,
    )
    assert spec_of(cfg).model_path == MODEL_PATH


def test_explicit_tokenizer_wins_over_the_model_path() -> None:
    assert spec_of(EngineConfig(model="m", tokenizer="/tok")).engine_kwargs["tokenizer"] == "/tok"


@pytest.mark.parametrize("gib, expected", [(1.0, GIB), (1.5, 3 * (1 << 29)), (0.25, 1 << 28)])
def test_kv_cache_gib_becomes_kv_cache_memory_bytes(gib: float, expected: int) -> None:
    kw = spec_of(EngineConfig(model="m", kv_cache_gib=gib)).engine_kwargs
    assert kw["kv_cache_memory_bytes"] == expected and isinstance(kw["kv_cache_memory_bytes"], int)
    assert "kv_cache_gib" not in kw


def test_gpu_only_and_optional_fields_are_set_only_when_they_apply() -> None:
    cpu = spec_of(EngineConfig(model="m", gpu_memory_utilization=0.5)).engine_kwargs
    gpu = spec_of(EngineConfig(model="m", gpu_memory_utilization=0.5), on_gpu=True).engine_kwargs
    assert "gpu_memory_utilization" not in cpu and gpu["gpu_memory_utilization"] == 0.5
    assert "block_size" not in cpu and "max_num_batched_tokens" not in cpu
    kw = spec_of(EngineConfig(model="m", block_size=16, max_num_batched_tokens=512)).engine_kwargs
    assert kw["block_size"] == 16 and kw["max_num_batched_tokens"] == 512


def test_extra_engine_args_pass_through_unchanged() -> None:
    extra: dict[str, Any] = {"swap_space": 2, "limit_mm_per_prompt": {"image": 0}}
    cfg = EngineConfig(model="m", extra_engine_args=extra)
    kw = spec_of(cfg).engine_kwargs
    assert kw["swap_space"] == 2 and kw["limit_mm_per_prompt"] == {"image": 0}
    assert cfg.extra_engine_args == {"swap_space": 2, "limit_mm_per_prompt": {"image": 0}}  # input untouched


@pytest.mark.parametrize("key", ["max_model_len", "model", "kv_cache_memory_bytes", "disable_log_stats"])
def test_extra_engine_args_may_not_override_baton_fields(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        spec_of(EngineConfig(model="m", extra_engine_args={key: 1}))


def test_extra_kv_transfer_config_clashes_only_when_a_handoff_sets_one() -> None:
    own = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    cfg = EngineConfig(model="m", extra_engine_args={"kv_transfer_config": own})
    assert spec_of(cfg, handoff=False).engine_kwargs["kv_transfer_config"] == own
    with pytest.raises(ValueError, match="kv_transfer_config"):
        spec_of(cfg, handoff=True)


def test_build_engine_spec_is_pure() -> None:
    cfg = EngineConfig(model="m", extra_engine_args={"swap_space": 2})
    assert spec_of(cfg) == spec_of(cfg)
    before = dict(os.environ)
    spec_of(cfg)
    assert dict(os.environ) == before  # the environment is returned, never set


# ---- process environment ---------------------------------------------------------------------------


def test_cpu_engine_environment() -> None:
    env = spec_of(EngineConfig(model="m", cpu_threads=3, cpu_threads_bind="0-2")).env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CACHE_ROOT"] == os.path.join(CACHE_ROOT, "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(CACHE_ROOT, "inductor")
    assert all(isinstance(v, str) for v in env.values())


def test_gpu_engine_environment_has_no_cpu_threading() -> None:
    env = spec_of(EngineConfig(model="m", cpu_threads=3), on_gpu=True).env
    assert "OMP_NUM_THREADS" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert env["HF_HUB_OFFLINE"] == "1"


# ---- model resolution -------------------------------------------------------------------------------


def make_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_resolve_model_path_accepts_a_model_folder(tmp_path: Path) -> None:
    model = make_model(tmp_path / "models" / "tiny")
    assert resolve_model_path(str(model), str(tmp_path / "empty-cache")) == str(model)


def test_resolve_model_path_makes_relative_folders_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_model(tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model_path("models/tiny", "nowhere")
    assert os.path.isabs(resolved) and resolved == str(tmp_path / "models" / "tiny")


def test_resolve_model_path_finds_a_name_under_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = make_model(cache / "SmolLM2-135M-Instruct")
    assert resolve_model_path("SmolLM2-135M-Instruct", str(cache)) == str(model)


def test_a_folder_without_config_json_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "cache" / "half-provisioned").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("half-provisioned", str(tmp_path / "cache"))
    message = str(info.value)
    assert "'half-provisioned'" in message
    assert "setup" in message
    assert str(tmp_path / "cache") in message


# ---- Serve options (deployments/app.py helpers) -----------------------------------------------------


def pool(**fields: Any) -> PoolConfig:
    return PoolConfig.model_validate({"engine": {"model": "m"}, **fields})


def app_config(decode: dict[str, Any] | None = None, **top: Any) -> AppConfig:
    return load_app_config({"prefill": {"engine": {"model": "m"}}, "decode": {"engine": {"model": "m"}, **(decode or {})}, **top})


def test_ray_actor_options_for_a_cpu_pool() -> None:
    env = {"OMP_NUM_THREADS": "1"}
    opts = ray_actor_options(pool(resources={"num_cpus": 2, "custom": {"decode_slot": 1}}), env)
    assert opts == {"num_cpus": 2.0, "runtime_env": {"env_vars": env}, "resources": {"decode_slot": 1.0}}


def test_ray_actor_options_for_a_gpu_pool() -> None:
    opts = ray_actor_options(pool(resources={"num_cpus": 4, "num_gpus": 1, "accelerator_type": "H100", "memory_gib": 2}), {})
    assert opts["num_gpus"] == 1.0
    assert opts["accelerator_type"] == "H100"
    assert opts["memory"] == 2 * GIB and isinstance(opts["memory"], int)
    assert "resources" not in opts


def test_ray_actor_options_do_not_share_the_config_dicts() -> None:
    p = pool(resources={"custom": {"decode_slot": 1}})
    ray_actor_options(p, {})["resources"]["decode_slot"] = 99
    assert p.resources.custom == {"decode_slot": 1.0}


def test_pool_options_with_fixed_replicas() -> None:
    cfg = app_config(decode={"num_replicas": 3, "max_ongoing_requests": 12}, routing={"kv_weight": 2.0, "queue_weight": 0.5})
    spec = spec_of(cfg.decode.engine)
    opts = pool_options("decode", cfg.decode, spec, cfg)
    assert opts["name"] == "decode"
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["max_ongoing_requests"] == 12
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"] == spec.env
    router = opts["request_router_config"]
    assert router.request_router_kwargs == {"kv_weight": 2.0, "queue_weight": 0.5, "prefill_token_weight": cfg.routing.prefill_token_weight}
    assert router.request_router_class.endswith("TargetedLoadRouter")
    assert router.request_routing_stats_period_s == cfg.decode.routing_stats_period_s


def test_pool_options_with_autoscaling_replace_num_replicas() -> None:
    auto = {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2, "target_ongoing_requests": 3, "upscale_delay_s": 1, "downscale_delay_s": 5}
    cfg = app_config(decode={"num_replicas": 1, "autoscaling": auto})
    opts = pool_options("decode", cfg.decode, spec_of(cfg.decode.engine), cfg)
    assert "num_replicas" not in opts
    a = opts["autoscaling_config"]
    assert (a.min_replicas, a.max_replicas, a.initial_replicas, a.target_ongoing_requests, a.upscale_delay_s, a.downscale_delay_s) == (1, 4, 2, 3, 1, 5)


@pytest.mark.parametrize("decode", [{"num_replicas": 2}, {"autoscaling": {"min_replicas": 0, "max_replicas": 2}}])
def test_pool_options_are_accepted_by_serve(decode: dict[str, Any]) -> None:
    """Serve validates deployment options without a cluster; a key or type it rejects fails here."""
    cfg = app_config(decode={"resources": {"num_gpus": 1, "accelerator_type": "L4", "custom": {"decode_slot": 1}}, **decode})
    opts = pool_options("decode", cfg.decode, spec_of(cfg.decode.engine, on_gpu=True), cfg)
    deployment = EngineReplicaDeployment.options(**opts)
    assert deployment.name == "decode"
    assert deployment.ray_actor_options["resources"] == {"decode_slot": 1.0}


def test_project_path() -> None:
    assert project_path("/abs/models") == "/abs/models"
    assert project_path(".cache/models") == str(PROJECT_ROOT / ".cache" / "models")
    assert (PROJECT_ROOT / "deployments" / "app.py").is_file()


def test_build_app_reports_a_missing_model_as_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"decode\.engine\.model: .*'absent'.*setup"):
        build_app({"model_cache": str(tmp_path), "prefill": {"engine": {"model": "absent"}}, "decode": {"engine": {"model": "absent"}}})


def test_a_step_trace_is_off_unless_a_folder_is_named_and_then_knows_its_pool() -> None:
    assert spec_of().step_trace is None
    assert spec_of(EngineConfig(model="m", step_trace_dir="/tmp/steps"), role="prefill").step_trace == ("/tmp/steps", "prefill")
    assert "step_trace_dir" not in spec_of(EngineConfig(model="m", step_trace_dir="/tmp/steps")).engine_kwargs
    from deployments.app import PROJECT_ROOT, engine_paths

    relative = spec_of(engine_paths(EngineConfig(model="m", step_trace_dir="runs/steps"))).step_trace
    assert relative is not None and relative[0] == str(PROJECT_ROOT / "runs" / "steps")  # like every relative path: from the project root
    assert engine_paths(EngineConfig(model="m", step_trace_dir="/abs/steps")).step_trace_dir == "/abs/steps"


def test_dtype_auto_is_bf16_only_on_a_cpu_that_computes_it_natively() -> None:
    from baton.engine.args import engine_dtype

    assert engine_dtype("auto", on_gpu=False, cpu_bf16=True) == "bfloat16"
    assert engine_dtype("auto", on_gpu=False, cpu_bf16=False) == "float32"
    assert engine_dtype("auto", on_gpu=True, cpu_bf16=False) == "auto"  # vLLM takes the model's own on a GPU
    for explicit in ("bfloat16", "float16", "float32"):  # what the user wrote is kept
        assert engine_dtype(explicit, on_gpu=False, cpu_bf16=False) == explicit


def test_auto_dtype_is_resolved_where_the_engine_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from baton.engine import vllm_engine

    cpu = build_engine_spec(EngineConfig(model="m"), role="decode", handoff=False, model_path="/m", on_gpu=False, cache_root="/c")
    gpu = build_engine_spec(EngineConfig(model="m"), role="decode", handoff=False, model_path="/m", on_gpu=True, cache_root="/c")
    assert cpu.engine_kwargs["dtype"] == gpu.engine_kwargs["dtype"] == "auto"  # the app's builder does not decide
    assert not cpu.on_gpu and gpu.on_gpu
    for native, expected in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(vllm_engine, "native_cpu_bf16", lambda native=native: native)
        kw = vllm_engine.engine_kwargs_here(cpu)
        assert kw["dtype"] == expected and {k: v for k, v in kw.items() if k != "dtype"} == {
            k: v for k, v in cpu.engine_kwargs.items() if k != "dtype"}
        assert vllm_engine.engine_kwargs_here(gpu)["dtype"] == "auto"
    assert cpu.engine_kwargs["dtype"] == "auto"  # the spec itself is not changed
    explicit = build_engine_spec(EngineConfig(model="m", dtype="bfloat16"), role="decode", handoff=False, model_path="/m",
                                 on_gpu=False, cache_root="/c")
    assert vllm_engine.engine_kwargs_here(explicit)["dtype"] == "bfloat16"
