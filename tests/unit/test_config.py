"""User config (deployments/config.py): every shipped YAML validates; a typo anywhere fails with
the dotted path of the field; cross-field rules (same model, a decode pool that runs, a prefill
pool exactly when routing.policy prefills remotely) say what is wrong; defaults are servable on CPU."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from deployments.config import AppConfig, ConfigError, PoolConfig, RoutingConfig, load_app_config
from router.policy import DISAGGREGATED

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


# the tiny random-weight LFM2's chat template renders no tools: a request with tools gets 400
# tools_unavailable there, rather than tools the model never sees
WITHOUT_TOOLS = {"local_hybrid.yaml", "local_hybrid_pd.yaml"}


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_every_cluster_config_validates(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    apps = doc["applications"]
    assert apps, f"{path.name} declares no application"
    for app in apps:
        assert app["import_path"] == "deployments.app:build_app"
        cfg = load_app_config(app["args"])
        assert isinstance(cfg, AppConfig)
        if cfg.prefill is not None:
            assert cfg.prefill.engine.model == cfg.decode.engine.model
        decode_runs = cfg.decode.num_replicas > 0 or (cfg.decode.autoscaling is not None and cfg.decode.autoscaling.max_replicas > 0)
        assert decode_runs
        # every config of an instruct model serves OpenAI `tools` with a parser vLLM has (the builder's check)
        from deployments.app import check_tool_parser

        if path.name in WITHOUT_TOOLS:
            assert cfg.ingress.tool_call_parser is None
            continue
        assert cfg.ingress.tool_call_parser is not None, f"{path.name}: no ingress.tool_call_parser"
        assert check_tool_parser(cfg.ingress.tool_call_parser) == cfg.ingress.tool_call_parser


def ray_start_resources(text: str) -> tuple[float, dict[str, float]]:
    """The CPUs and custom resources the header comment tells users to give `ray start`, summed
    over its `ray start` lines (a head and its worker nodes)."""
    cpus, offered = 0.0, {}
    for line in (ln for ln in text.splitlines() if ln.startswith("#") and "ray start" in ln):
        n = re.search(r"--num-cpus (\d+)", line)
        custom = re.search(r"--resources '(\{.*?\})'", line)
        assert n and custom, f"`ray start` without --num-cpus N --resources '{{...}}': {line}"
        cpus += float(n.group(1))
        for k, v in json.loads(custom.group(1)).items():
            offered[k] = offered.get(k, 0.0) + float(v)
    assert offered, "the header names no `ray start --num-cpus N --resources '{...}'`"
    return cpus, offered


def replicas_at_most(pool: PoolConfig | None) -> int:
    if pool is None:
        return 0
    return pool.autoscaling.max_replicas if pool.autoscaling is not None else pool.num_replicas


@pytest.mark.parametrize("name", ["local.yaml", "local_hybrid_pd.yaml", "local_multinode.yaml"])
def test_local_config_fits_the_resources_its_comment_gives_ray(name: str) -> None:
    """A local config's header tells users which custom resources to give `ray start`; every
    replica of every pool must fit in them (and run on CPU)."""
    text = (CLUSTER_CONFIGS[0].parent / name).read_text()
    cpus, offered = ray_start_resources(text)
    cfg = load_app_config(yaml.safe_load(text)["applications"][0]["args"])
    asked: dict[str, float] = {}
    asked_cpus = cfg.ingress.num_cpus * cfg.ingress.num_replicas
    for pool in (cfg.prefill, cfg.decode):
        if pool is None:
            continue
        assert pool.resources.num_gpus == 0
        asked_cpus += pool.resources.num_cpus * replicas_at_most(pool)
        for name, amount in pool.resources.custom.items():
            asked[name] = asked.get(name, 0.0) + amount * replicas_at_most(pool)
    assert asked and all(asked[name] <= offered.get(name, 0.0) for name in asked), (asked, offered)
    assert asked_cpus <= cpus, (asked_cpus, cpus)
    assert cfg.decode.resources.custom, "the decode pool must claim a slot of its own"


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


# policy, the prefill pool as written ("absent" = no prefill key), and None when valid, else what the error names
POLICY_RULES: list[tuple[str, Any, str | None]] = [
    ("conversation", {"num_replicas": 1}, None),
    ("conversation", {"num_replicas": 0, "autoscaling": {"min_replicas": 0, "max_replicas": 2}}, None),
    ("conversation", "absent", "routing.policy 'conversation' prefills on the prefill pool"),
    ("conversation", {"num_replicas": 0}, "routing.policy 'conversation' prefills on the prefill pool"),
    ("per_turn_pd", {"num_replicas": 3}, None),
    ("per_turn_pd", "absent", "routing.policy 'per_turn_pd' prefills on the prefill pool"),
    ("per_turn_pd", {"num_replicas": 0}, "routing.policy 'per_turn_pd' prefills on the prefill pool"),
    ("conditional_pd", {"num_replicas": 1}, None),
    ("conditional_pd", "absent", "routing.policy 'conditional_pd' prefills on the prefill pool"),
    ("colocated", "absent", None),
    ("colocated", {"num_replicas": 0}, None),
    ("colocated", {"num_replicas": 1}, "routing.policy 'colocated' serves whole requests on the decode pool"),
    ("colocated", {"num_replicas": 0, "autoscaling": {"min_replicas": 0, "max_replicas": 1}}, "routing.policy 'colocated' serves whole"),
    ("round_robin", "absent", None),
    ("round_robin", {"num_replicas": 0}, None),
    ("round_robin", {"num_replicas": 2}, "routing.policy 'round_robin' serves whole requests on the decode pool"),
]


@pytest.mark.parametrize("policy, prefill, error", POLICY_RULES, ids=[f"{p}-{'absent' if f == 'absent' else f}" for p, f, _ in POLICY_RULES])
def test_the_policy_decides_whether_a_prefill_pool_runs(policy: str, prefill: Any, error: str | None) -> None:
    args = minimal_args(routing={"policy": policy})
    if prefill == "absent":
        del args["prefill"]
    else:
        args["prefill"].update(prefill)
    if error is None:
        cfg = load_app_config(args)
        assert cfg.routing.policy == policy
        assert cfg.routing.disaggregated == (policy in ("conversation", "per_turn_pd", "conditional_pd"))
        assert (cfg.prefill is None) == (prefill == "absent")
    else:
        message = config_error(args)
        assert error in message
        assert "prefill" in message  # says which pool to change


def test_a_whole_request_policy_tells_where_the_prefill_engines_should_go() -> None:
    message = config_error(minimal_args(routing={"policy": "colocated"}))
    assert "set prefill.num_replicas to 0" in message and "decode pool" in message


def test_an_unused_prefill_pool_must_still_serve_the_same_model() -> None:
    args = minimal_args(routing={"policy": "colocated"})
    args["prefill"].update(num_replicas=0, engine={"model": "other"})
    assert "same model" in config_error(args)


@pytest.mark.parametrize("policy", ["conversation", "per_turn_pd", "conditional_pd", "colocated", "round_robin"])
def test_decode_must_run_under_every_policy(policy: str) -> None:
    args = minimal_args(routing={"policy": policy})
    args["decode"]["num_replicas"] = 0
    if policy in ("colocated", "round_robin"):
        del args["prefill"]
    assert "decode pool needs at least one replica" in config_error(args)


@pytest.mark.parametrize(
    "field, value",
    [("conversation_ttl_s", 0), ("replica_stale_after_s", 0), ("conditional_pd_threshold_tokens", -1), ("prefill_queue_limit_tokens", -1),
     ("pin_weight", -0.1), ("queue_weight", -1), ("kv_weight", -1), ("prefill_token_weight", -1e-3)],
)
def test_routing_numbers_are_bounded(field: str, value: float) -> None:
    assert f"routing.{field}:" in config_error(minimal_args(routing={field: value}))


def test_routing_disaggregated_property() -> None:
    assert {p: RoutingConfig(policy=p).disaggregated for p in ("conversation", "per_turn_pd", "conditional_pd", "colocated", "round_robin")} == {  # type: ignore[arg-type]
        "conversation": True, "per_turn_pd": True, "conditional_pd": True, "colocated": False, "round_robin": False,
    }


def test_the_ownership_file_is_durable_by_default_and_resolved_from_the_repo_root(tmp_path: Path) -> None:
    r = load_app_config(minimal_args()).routing
    assert r.ownership_db_path == ".cache/baton/conversations.sqlite3"
    assert r.resolved_ownership_db_path(tmp_path) == str(tmp_path / ".cache/baton/conversations.sqlite3")
    assert RoutingConfig(ownership_db_path="/srv/own.db").resolved_ownership_db_path(tmp_path) == "/srv/own.db"
    assert RoutingConfig(ownership_db_path=":memory:").resolved_ownership_db_path(tmp_path) == ":memory:"
    assert "routing.ownership_db_path:" in config_error(minimal_args(routing={"ownership_db_path": ""}))


# ---- defaults ------------------------------------------------------------------------------------


def test_defaults_are_sane_for_a_cpu_machine() -> None:
    cfg = load_app_config(minimal_args())
    assert cfg.name == "baton"
    r = cfg.routing
    assert r.policy == "conversation" and r.disaggregated
    assert r.kv_weight == 1.0 and 0 < r.queue_weight < r.kv_weight
    assert 0 < r.pin_weight < 1 and r.prefill_token_weight == pytest.approx(1 / 8192)
    assert r.conversation_ttl_s > 0 and r.replica_stale_after_s > cfg.decode.routing_stats_period_s  # several reports may be lost
    assert cfg.ingress.num_replicas == 1 and cfg.ingress.served_model_name is None
    assert cfg.ingress.default_max_tokens >= 1 and cfg.ingress.default_max_tokens < cfg.decode.engine.max_model_len
    assert cfg.prefill is not None
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


def test_the_prefill_pool_defaults_to_absent() -> None:
    cfg = load_app_config({"routing": {"policy": "colocated"}, "decode": {"engine": {"model": "m"}}})
    assert cfg.prefill is None and not cfg.routing.disaggregated


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


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_a_config_with_grpc_uses_api_keys(path: Path) -> None:
    """Serve binds its gRPC proxy on every interface: a shipped config that serves gRPC must use
    keys (the exposure guard would refuse it otherwise), and the keyless local default has none."""
    doc = yaml.safe_load(path.read_text())
    ingress = doc["applications"][0]["args"]["ingress"]
    if path.name == "local.yaml":
        assert "grpc_options" not in doc and not ingress.get("allow_unauthenticated")
    if "grpc_options" in doc:
        assert ingress.get("api_keys_env") and not ingress.get("allow_unauthenticated")


def _hybrid(**top: Any) -> dict[str, Any]:
    args = minimal_args(routing={"policy": "colocated"}, **top)
    del args["prefill"]
    args["decode"]["engine"]["checkpoints"] = {"strategy": "dp", "budget": 8}
    return args


@pytest.mark.parametrize(("change", "named"), [
    ({"memory": {}}, "memory (KV injection)"),
    ({"realtime": {}}, "realtime (held windows)"),
])
def test_checkpoints_with_injected_kv_are_refused_by_what_injects_it(change: dict[str, Any], named: str) -> None:
    assert load_app_config(_hybrid()).decode.engine.checkpoints is not None  # colocated, no memory or realtime: runs
    message = config_error({**_hybrid(), **change})
    assert "engine.checkpoints" in message and named in message and "recurrent" in message


@pytest.mark.parametrize("policy", sorted(DISAGGREGATED))
def test_checkpoints_run_with_a_nixl_handoff_whose_connectors_declare_hma(policy: str) -> None:
    args = {**_hybrid(), "routing": {"policy": policy}, "prefill": {"num_replicas": 1, "engine": {"model": "m", "checkpoints": {}}}}
    cfg = load_app_config(args)
    assert cfg.decode.engine.checkpoints is not None and cfg.prefill is not None and cfg.prefill.engine.checkpoints is not None


def test_the_hybrid_pd_config_hands_off_and_keeps_checkpoints_on_its_decoder() -> None:
    from baton.engine.args import build_engine_spec
    from kv_transfer.config import stack_supports_hma

    doc = yaml.safe_load((CLUSTER_CONFIGS[0].parent / "local_hybrid_pd.yaml").read_text())
    cfg = load_app_config(doc["applications"][0]["args"])
    assert cfg.routing.policy == "conversation" and cfg.prefill is not None and cfg.prefill.num_replicas >= 1
    assert cfg.prefill.engine.model == cfg.decode.engine.model == "tiny-lfm2"
    assert cfg.decode.engine.checkpoints is not None and cfg.memory is None and cfg.realtime is None
    for role, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        spec = build_engine_spec(pool.engine, role=role, handoff=True, model_path="/m", on_gpu=False, cache_root="/c")
        assert stack_supports_hma(spec.engine_kwargs["kv_transfer_config"])
        assert spec.env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"


def test_checkpoints_with_a_handoff_are_refused_when_a_connector_lacks_hma(monkeypatch: pytest.MonkeyPatch) -> None:
    import kv_transfer.config as kv_config

    monkeypatch.setattr(kv_config, "HMA_CONNECTORS", frozenset({"SegmentConnector"}))  # as if NIXL declared no HMA
    args = {**_hybrid(), "routing": {"policy": "conversation"}, "prefill": {"num_replicas": 1, "engine": {"model": "m"}}}
    message = config_error(args)
    assert "decode.engine.checkpoints" in message and "SupportsHMA" in message and "CountingNixlConnector" in message


# ---- control plane placement (multi-node) ------------------------------------------------------


def test_the_control_plane_asks_for_its_custom_resources() -> None:
    cfg = load_app_config(minimal_args(control_plane={"custom": {"node:__internal_head__": 0.001}}))
    opts = cfg.control_plane.actor_options(0.5)
    assert opts["resources"] == {"node:__internal_head__": 0.001} and opts["num_cpus"] == 0.5
    assert opts["runtime_env"]["env_vars"]["HF_HUB_OFFLINE"] == "1"
    assert "resources" not in load_app_config(minimal_args()).control_plane.actor_options(0)  # default: anywhere


@pytest.mark.parametrize("custom", [{"head": 0}, {"head": -1.0}, {"": 1.0}])
def test_control_plane_resources_must_be_named_and_positive(custom: dict[str, float]) -> None:
    assert "control_plane.custom" in config_error(minimal_args(control_plane={"custom": custom}))


def test_a_misspelled_control_plane_field_is_named() -> None:
    assert "control_plane.resources" in config_error(minimal_args(control_plane={"resources": {"head": 1}}))
