"""The one builder: validated config -> Serve Application (ingress + prefill pool + decode pool).

`serve run cluster_configs/<name>.yaml` calls `build_app(args)` with the YAML's `args`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ray.serve import Application
from ray.serve.config import AutoscalingConfig as ServeAutoscaling
from ray.serve.config import RequestRouterConfig

from baton.engine.args import EngineSpec, build_engine_spec, resolve_model_path
from baton.engine.config import EngineConfig
from deployments.config import AppConfig, ConfigError, PoolConfig, load_app_config
from deployments.directory_client import DirectoryShards
from deployments.exposure import bind_refusal, serve_grpc_enabled, serve_http_host
from deployments.ingress import Ingress, IngressSettings
from deployments.pool import EngineReplicaDeployment
from kv_transfer.config import PoolRole
from memory_store.deployment import MemoryStoreDeployment
from router.directory import ConversationDirectoryDeployment
from router.directory_shards import deployment_name
from router.directory_state import DirectorySettings
from router.scoring import LoadWeights
from router.serve_router import TargetedLoadRouter

logger = logging.getLogger("ray.serve")

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def project_path(p: str) -> str:
    """Relative paths in configs are relative to the project root (the builder's cwd is Ray's)."""
    return p if os.path.isabs(p) else str(PROJECT_ROOT / p)


def engine_paths(engine: EngineConfig) -> EngineConfig:
    """The engine config with its relative step_trace_dir taken from the project root."""
    if not engine.step_trace_dir:
        return engine
    return engine.model_copy(update={"step_trace_dir": project_path(engine.step_trace_dir)})


def ray_actor_options(pool: PoolConfig, env: dict[str, str]) -> dict[str, Any]:
    r = pool.resources
    opts: dict[str, Any] = {"num_cpus": r.num_cpus, "runtime_env": {"env_vars": env}}
    if r.num_gpus:
        opts["num_gpus"] = r.num_gpus
    if r.accelerator_type:
        opts["accelerator_type"] = r.accelerator_type
    if r.custom:
        opts["resources"] = dict(r.custom)
    if r.memory_gib:
        opts["memory"] = int(r.memory_gib * (1 << 30))
    return opts


def pool_options(name: str, pool: PoolConfig, spec: EngineSpec, cfg: AppConfig) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "name": name,
        "ray_actor_options": ray_actor_options(pool, spec.env),
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queued_requests,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 10.0,
        "request_router_config": RequestRouterConfig(
            request_router_class=TargetedLoadRouter,
            request_router_kwargs={"kv_weight": cfg.routing.kv_weight, "queue_weight": cfg.routing.queue_weight,
                                   "prefill_token_weight": cfg.routing.prefill_token_weight},
            request_routing_stats_period_s=pool.routing_stats_period_s,
            request_routing_stats_timeout_s=max(1.0, pool.routing_stats_period_s),
        ),
    }
    if pool.autoscaling is not None:
        a = pool.autoscaling
        opts["autoscaling_config"] = ServeAutoscaling(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            initial_replicas=a.initial_replicas,
            target_ongoing_requests=a.target_ongoing_requests,
            upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s,
        )
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


def check_tool_parser(name: str | None) -> str | None:
    """`ingress.tool_call_parser` if vLLM has a tool parser of that name (ConfigError otherwise)."""
    if name is None:
        return None
    from vllm.tool_parsers import ToolParserManager

    known = ToolParserManager.list_registered()
    if name not in known:
        raise ConfigError(f"ingress.tool_call_parser: vLLM has no tool parser {name!r} (known: {', '.join(known)})")
    return name


def chat_template_path(path: str | None) -> str | None:
    """`ingress.chat_template` as an absolute path to a file that exists (ConfigError otherwise)."""
    if path is None:
        return None
    resolved = project_path(path)
    if not os.path.isfile(resolved):
        raise ConfigError(f"ingress.chat_template: no file at {resolved}")
    return resolved


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    cfg = load_app_config(args)
    refusal = bind_refusal(serve_http_host(), cfg, serve_grpc_enabled())  # safe by default off loopback (deployments/exposure.py)
    if refusal is not None:
        raise refusal
    cache = project_path(cfg.model_cache)
    try:
        model_path = resolve_model_path(cfg.decode.engine.model, cache)
    except FileNotFoundError as e:
        raise ConfigError(f"decode.engine.model: {e}") from None
    cache_root = project_path(".cache")

    def spec(role: PoolRole, pool: PoolConfig) -> EngineSpec:
        on_gpu = pool.resources.num_gpus > 0
        return build_engine_spec(engine_paths(pool.engine), role=role, handoff=cfg.routing.disaggregated, model_path=model_path,
                                 on_gpu=on_gpu, cache_root=cache_root, segments=cfg.memory is not None or cfg.realtime is not None,
                                 cpu_cores=pool.resources.cpu_cores, cores_per_replica=pool.resources.cpu_cores_per_replica)

    r = cfg.routing
    directory = DirectoryShards([ConversationDirectoryDeployment.options(
        name=deployment_name(i, r.directory_shards), ray_actor_options=cfg.control_plane.actor_options(0)).bind(
        DirectorySettings(
            policy=r.policy,
            conversation_ttl_s=r.conversation_ttl_s,
            stale_after_s=r.replica_stale_after_s,
            # decoder choice weighs KV occupancy 1.0 and sees no queued prefill tokens (as before the
            # scorers were merged); kv_weight / prefill_token_weight tune the Serve router's ranking
            weights=LoadWeights(pin_weight=r.pin_weight, queue_weight=r.queue_weight, kv_weight=1.0),
            # a restarted directory gets its pins back from the decoders' reports: give them two periods
            rebuild_grace_s=2.0 * cfg.decode.routing_stats_period_s,
            conditional_pd_threshold_tokens=r.conditional_pd_threshold_tokens,
            prefill_queue_limit_tokens=r.prefill_queue_limit_tokens,
            shard=i,
            shards=r.directory_shards,
        ),
        r.resolved_ownership_db_path(PROJECT_ROOT),  # one file for every shard: an owner holds across any change of K
        r.report_relay_period_s,
    ) for i in range(r.directory_shards)], relay=r.report_relay_period_s > 0)
    store = None
    seg_bytes = 0
    if cfg.memory is not None:
        db_path = str(cfg.memory.resolved_db_path(PROJECT_ROOT))
        store_opts = cfg.control_plane.actor_options(0)
        if cfg.memory.store_gpus > 0:  # its segment arena then lives in GPU memory
            store_opts["num_gpus"] = cfg.memory.store_gpus
        store = MemoryStoreDeployment.options(ray_actor_options=store_opts).bind(cfg.memory, db_path)
        seg_bytes = cfg.memory.replica_cache_bytes
    decode_spec = spec("decode", cfg.decode)
    decode = EngineReplicaDeployment.options(**pool_options("decode", cfg.decode, decode_spec, cfg)).bind(
        "decode", decode_spec, directory, store, seg_bytes)
    prefill = None
    if r.disaggregated and cfg.prefill is not None:
        prefill_spec = spec("prefill", cfg.prefill)
        prefill = EngineReplicaDeployment.options(**pool_options("prefill", cfg.prefill, prefill_spec, cfg)).bind(
            "prefill", prefill_spec, directory, store, seg_bytes)
    settings = IngressSettings(
        model_id=cfg.ingress.served_model_name or os.path.basename(model_path.rstrip("/")),
        model_path=model_path,
        max_model_len=min(p.engine.max_model_len for p in (cfg.decode, cfg.prefill) if p is not None),
        default_max_tokens=cfg.ingress.default_max_tokens,
        disaggregated=r.disaggregated,
        api_keys_env=cfg.ingress.api_keys_env,
        max_inflight_requests=cfg.ingress.max_inflight_requests,
        admission=cfg.ingress.admission,
        memory=cfg.memory,
        realtime=cfg.realtime,
        input_limits=cfg.ingress.input_limits(),
        prefix_cache=cfg.isolation.prefix_cache,
        tool_call_parser=check_tool_parser(cfg.ingress.tool_call_parser),
        chat_template=chat_template_path(cfg.ingress.chat_template),
        incremental_tokenization=cfg.ingress.incremental_tokenization,
        policy=r.policy,
        pin_cache_sync_s=r.pin_cache_sync_s,
        conditional_pd_threshold_tokens=r.conditional_pd_threshold_tokens,
    )
    return Ingress.options(
        num_replicas=cfg.ingress.num_replicas,
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options=cfg.control_plane.actor_options(cfg.ingress.num_cpus),
    ).bind(decode, prefill, directory, settings, store)
