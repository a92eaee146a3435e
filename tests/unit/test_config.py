"""User config (deployments/config.py): every shipped YAML validates; a typo anywhere fails with
the dotted path of the field; cross-field rules say what is wrong; defaults are servable on CPU."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from deployments.config import AppConfig, ConfigError, load_app_config

CLUSTER_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "cluster_configs").glob("*.yaml"))


def minimal_args(**top: Any) -> dict[str, Any]:
    """The smallest valid args; fresh dicts every call, so a test may mutate any level."""
    args: dict[str, Any] = {
        "prefill": {"engine": {"model": "m"}},
        "decode": {"engine": {"model": "m"}},
    }
    args.update(top)
    return args


def config_error(args: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_app_config(args)
    return str(info.value)


# ---- shipped cluster configs -------------------------------------------------------------------


def test_there_are_cluster_configs() -> None:
    assert CLUSTER_CONFIGS, "cluster_configs/*.yaml is empty"


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_every_cluster_config_validates(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    apps = doc["applications"]
    assert apps, f"{path.name} declares no application"
    for app in apps:
        assert app["import_path"] == "deployments.app:build_app"
        cfg = load_app_config(app["args"])
        assert isinstance(cfg, AppConfig)
        assert cfg.prefill.engine.model == cfg.decode.engine.model
        decode_runs = cfg.decode.num_replicas > 0 or (cfg.decode.autoscaling is not None and cfg.decode.autoscaling.max_replicas > 0)
        assert decode_runs


def test_local_config_matches_its_comment() -> None:
    """local.yaml's header tells users which custom resources to give `ray start`; the pools must ask for those."""
    doc = yaml.safe_load((CLUSTER_CONFIGS[0].parent / "local.yaml").read_text())
    cfg = load_app_config(doc["applications"][0]["args"])
    assert cfg.prefill.resources.custom == {"prefill_slot": 1.0}
    assert cfg.decode.resources.custom == {"decode_slot": 1.0}
    assert cfg.decode.resources.num_gpus == 0
    assert cfg.routing.policy == "colocated"


# ---- typos name their field --------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, mutate",
    [
        ("modle_cache", lambda a: a.update(modle_cache=".cache")),
        ("ingress.num_replica", lambda a: a.update(ingress={"num_replica": 2})),
        ("prefill.engine.max_model_length", lambda a: a["prefill"]["engine"].update(max_model_length=2048)),
        ("decode.resources.num_gpu", lambda a: a["decode"].update(resources={"num_gpu": 1})),
        ("routing.kv_wieght", lambda a: a.update(routing={"kv_wieght": 2.0})),
        ("decode.autoscaling.max_replica", lambda a: a["decode"].update(autoscaling={"max_replica": 2})),
    ],
)
def test_misspelled_field_names_its_dotted_path(where: str, mutate: Any) -> None:
    args = minimal_args()
    mutate(args)
    message = config_error(args)
    assert f"{where}:" in message
    assert "Extra inputs are not permitted" in message


def test_every_error_is_listed_not_only_the_first() -> None:
    args = minimal_args(ingress={"num_replica": 2})
    args["decode"]["engine"]["max_model_length"] = 1
    message = config_error(args)
    assert "ingress.num_replica:" in message
    assert "decode.engine.max_model_length:" in message


def test_wrong_value_names_its_field() -> None:
    args = minimal_args()
    args["decode"]["engine"]["max_model_len"] = "big"
    assert "decode.engine.max_model_len:" in config_error(args)
    assert "routing.policy:" in config_error(minimal_args(routing={"policy": "bogus"}))
    args = minimal_args()
    args["prefill"]["engine"]["gpu_memory_utilization"] = 1.5
    assert "prefill.engine.gpu_memory_utilization:" in config_error(args)


def test_missing_required_fields_are_named() -> None:
    message = config_error({"prefill": {"engine": {"model": "m"}}})
    assert "decode:" in message and "Field required" in message
    message = config_error({"prefill": {"engine": {}}, "decode": {"engine": {"model": "m"}}})
    assert "prefill.engine.model:" in message


def test_config_error_is_a_value_error_without_pydantic_noise() -> None:
    with pytest.raises(ValueError) as info:
        load_app_config(minimal_args(typo=1))
    assert isinstance(info.value, ConfigError)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "errors.pydantic.dev" not in str(info.value)


# ---- cross-field rules ---------------------------------------------------------------------------


def test_prefill_and_decode_must_serve_the_same_model() -> None:
    args = minimal_args()
    args["decode"]["engine"]["model"] = "other"
    message = config_error(args)
    assert "same model" in message
    assert "'m'" in message and "'other'" in message


def test_autoscaling_min_above_max_is_rejected_at_its_path() -> None:
    args = minimal_args()
    args["decode"]["autoscaling"] = {"min_replicas": 3, "max_replicas": 2}
    message = config_error(args)
    assert "decode.autoscaling:" in message
    assert "min_replicas must be <= max_replicas" in message


def test_autoscaling_initial_replicas_outside_bounds_is_rejected() -> None:
    args = minimal_args()
    args["prefill"]["autoscaling"] = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5}
    message = config_error(args)
    assert "prefill.autoscaling:" in message and "initial_replicas" in message


def test_decode_pool_without_replicas_is_rejected() -> None:
    args = minimal_args()
    args["decode"]["num_replicas"] = 0
    assert "decode pool needs at least one replica" in config_error(args)


def test_decode_with_zero_fixed_replicas_but_autoscaling_is_fine() -> None:
    args = minimal_args()
    args["decode"].update(num_replicas=0, autoscaling={"min_replicas": 0, "max_replicas": 2})
    cfg = load_app_config(args)
    assert cfg.decode.autoscaling is not None and cfg.decode.autoscaling.max_replicas == 2


def test_prefill_pool_may_be_empty() -> None:
    args = minimal_args()
    args["prefill"]["num_replicas"] = 0
    assert load_app_config(args).prefill.num_replicas == 0


# ---- defaults ------------------------------------------------------------------------------------


def test_defaults_are_sane_for_a_cpu_machine() -> None:
    cfg = load_app_config(minimal_args())
    assert cfg.name == "baton"
    assert cfg.routing.policy == "colocated"
    assert cfg.routing.kv_weight == 1.0 and 0 < cfg.routing.queue_weight < cfg.routing.kv_weight
    assert cfg.ingress.num_replicas == 1 and cfg.ingress.served_model_name is None
    assert 1 <= cfg.ingress.default_max_tokens < cfg.decode.engine.max_model_len
    for pool in (cfg.prefill, cfg.decode):
        assert pool.num_replicas == 1 and pool.autoscaling is None
        assert pool.resources.num_gpus == 0 and pool.resources.num_cpus == 1.0
        assert pool.resources.custom == {} and pool.resources.accelerator_type is None
        assert pool.max_ongoing_requests >= pool.engine.max_num_seqs
        e = pool.engine
        assert e.model == "m" and e.tokenizer is None
        assert e.max_model_len == 4096 and e.enable_prefix_caching and e.enforce_eager
        assert e.kv_cache_gib > 0 and 0 < e.gpu_memory_utilization <= 1
        assert e.cpu_threads == 1 and e.extra_engine_args == {}


def test_autoscaling_defaults_are_consistent() -> None:
    args = minimal_args()
    args["decode"]["autoscaling"] = {}
    a = load_app_config(args).decode.autoscaling
    assert a is not None
    assert a.min_replicas <= a.max_replicas and a.initial_replicas is None and a.target_ongoing_requests > 0


def test_config_is_frozen_and_load_is_idempotent() -> None:
    cfg = load_app_config(minimal_args())
    assert load_app_config(cfg) is cfg
    with pytest.raises(pydantic.ValidationError):
        cfg.name = "other"  # type: ignore[misc]
