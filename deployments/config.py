"""User-facing configuration of a Baton application (what `cluster_configs/*.yaml` holds under `args`).

Every model forbids unknown fields, so a typo in YAML fails with the field's path in the error.
`load_app_config` is the one entry point: it validates a dict and states the cross-field rules.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from baton.engine.config import EngineConfig
from deployments.input_limits import DEFAULT_MAX_BODY_BYTES, InputLimits
from deployments.salt import PrefixCacheScope
from kv_transfer.config import kv_transfer_engine_arg, stack_supports_hma
from memory_store.config import MemoryConfig
from router.admission import AdmissionConfig
from router.chat_admission import ChatAdmissionConfig
from router.cliff import CliffAdmissionConfig
from router.directory_shards import MAX_SHARDS
from router.policy import DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS, DISAGGREGATED, Policy


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingConfig(_Strict):
    """Serve autoscaling for one pool; when set, `num_replicas` is ignored by Serve."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(8.0, gt=0, description="requests per replica Serve aims for")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.initial_replicas is not None and not (self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self


class ResourcesConfig(_Strict):
    """Ray resources of ONE replica. On CPU, custom resources (e.g. decode_slot) stand in for GPUs."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. H100 or L4 (GPU clusters)")
    custom: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica")
    memory_gib: float | None = Field(None, gt=0, description="Ray memory reservation per replica")
    cpu_cores: tuple[int, ...] | None = Field(
        None, min_length=1, description="CPU engines only (ignored on GPUs): core ids the pool's engines run on (their engine "
        "thread and every thread it starts, NIXL's included); torch threads = one per core unless engine.cpu_threads is set. "
        "None: not pinned")
    cpu_cores_per_replica: int | None = Field(
        None, ge=1, description="cut cpu_cores into slices of this many; each replica takes a free slice at start "
        "(baton/engine/cpu_cores.py). None: every replica runs on all of cpu_cores")

    @model_validator(mode="after")
    def _cores(self) -> ResourcesConfig:
        cores = self.cpu_cores or ()
        if any(c < 0 for c in cores) or len(set(cores)) != len(cores):
            raise ValueError(f"cpu_cores must be distinct core ids >= 0, not {list(cores)}")
        if self.cpu_cores_per_replica is not None and (not cores or self.cpu_cores_per_replica > len(cores)):
            raise ValueError("cpu_cores_per_replica needs cpu_cores with at least that many cores")
        return self


class PoolConfig(_Strict):
    """One replica pool of vLLM engines (prefill-heavy or decode-efficient)."""

    num_replicas: int = Field(1, ge=0)
    autoscaling: AutoscalingConfig | None = None
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    engine: EngineConfig
    max_ongoing_requests: int = Field(64, ge=1, description="Serve's per-replica cap; beyond it requests queue")
    max_queued_requests: int = Field(
        256, ge=1, description="requests queued for this pool across its replicas; beyond: 503 with Retry-After (bounded queue)")
    routing_stats_period_s: float = Field(1.0, gt=0)


class IngressConfig(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    served_model_name: str | None = Field(None, description="the id clients send as `model`; default: model folder name")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the client sends none")
    max_ongoing_requests: int = Field(256, ge=1)
    max_inflight_requests: int = Field(
        128, ge=1, description="generation requests one ingress replica serves at once; beyond: 429 with Retry-After")
    admission: ChatAdmissionConfig = Field(
        default_factory=ChatAdmissionConfig, description="fixed: max_inflight_requests alone; adaptive: a limit under it held to "
        "a time-to-first-token target (router/chat_admission.py)")
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1024, description="largest request body; beyond: 413 request_too_large, refused from its "
        "Content-Length before it is read (a chunked body is read only up to the limit)")
    max_messages: int = Field(1024, ge=1, description="messages per chat request; beyond: 400 too_many_messages")
    max_prompt_chars: int | None = Field(
        None, ge=1, description="characters of a prompt (chat messages, or a text completion prompt), counted before "
        "tokenization; beyond: 400 context_length_exceeded. Default: 32 × the context length")
    render_threads: int = Field(2, ge=1, le=64, description="threads that template and tokenize prompts, off the event loop")
    incremental_tokenization: bool = Field(True, description="a conversation's turn tokenizes only what it appended (deployments/token_prefix.py)")
    tool_call_parser: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="vLLM tool parser that reads this model's tool calls (a name vLLM's ToolParserManager knows: hermes, "
        "pythonic, llama3_json, ...; the builder checks it); none: requests with tools are refused (400)")
    chat_template: str | None = Field(
        None, min_length=1,
        description="a Jinja chat template file that replaces the model's own (relative to the repo root), e.g. one that "
        "renders tools: deployments/templates/chatml_tools.jinja")
    api_keys_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of an environment variable (set where Ray runs) holding comma-separated API keys, `key` "
        "(operator: any user, /baton/*) or `key=user` (acts only as that user); when set, every path but /health "
        "needs 'Authorization: Bearer <key>'. Keys never go in the YAML.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="serve without API keys although http_options.host is not loopback (deployments/exposure.py); "
        "without it such a config refuses to start",
    )

    def input_limits(self) -> InputLimits:
        return InputLimits(max_body_bytes=self.max_body_bytes, max_messages=self.max_messages,
                           max_prompt_chars=self.max_prompt_chars, render_threads=self.render_threads)

    @model_validator(mode="after")
    def _admission_under_cap(self) -> IngressConfig:
        if self.admission.min_limit > self.max_inflight_requests:
            raise ValueError(f"admission.min_limit ({self.admission.min_limit}) must be <= max_inflight_requests ({self.max_inflight_requests})")
        return self


class RoutingConfig(_Strict):
    """Where each turn of a conversation runs (see router/policy.py for the rules)."""

    policy: Policy = Field(
        "conversation",
        description="conversation: first turn prefilled on the prefill pool, KV moved once (NIXL), later turns pinned to "
        "that decoder; per_turn_pd: remote prefill + KV transfer every turn; conditional_pd: pinned like conversation, "
        "each turn prefilled on the prefill pool only when its uncached suffix exceeds conditional_pd_threshold_tokens "
        "(llm-d's P/D decider, Dynamo's conditional disaggregation); colocated: whole requests on the decode "
        "pool with conversation affinity; round_robin: whole requests, rotating",
    )
    conditional_pd_threshold_tokens: int = Field(
        DEFAULT_CONDITIONAL_PD_THRESHOLD_TOKENS, ge=0, description="conditional_pd: prompt tokens the decoder does not hold for "
        "the conversation above which a turn is prefilled on the prefill pool; at or below it, on the decoder")
    prefill_queue_limit_tokens: int = Field(16384, ge=0, description="disaggregated policies: when every prefill replica has more "
        "prompt tokens queued than this and the chosen decoder is idle (nothing waiting, at most conditional_pd_threshold_tokens "
        "queued), the turn is prefilled on the decoder instead (counted as prefill_fallback_local in /baton/stats)")
    conversation_ttl_s: float = Field(1800.0, gt=0, description="idle conversations lose their pin after this")
    pin_weight: float = Field(0.02, ge=0, description="decoder score per pinned conversation (new-conversation placement)")
    queue_weight: float = Field(0.05, ge=0, description="score per request in flight")
    kv_weight: float = Field(1.0, ge=0, description="weight of KV occupancy in load-based placement")
    prefill_token_weight: float = Field(1.0 / 8192, ge=0, description="load score per queued prefill token")
    replica_stale_after_s: float = Field(10.0, gt=0, description="a replica that has not reported this long is not placed on")
    pin_cache_sync_s: float = Field(0.5, ge=0, le=10.0, description="pinning policies: each ingress keeps the pins the directory "
        "gave it and serves a pinned conversation's later turns without asking the directory, syncing with it this often "
        "(router/pin_cache.py), using a pin while the last sync is at most two periods old. 0: every turn asks the directory")
    directory_shards: int = Field(1, ge=1, le=MAX_SHARDS, description="directory replicas, each owning the conversations whose session ids hash to it "
        "(router/directory_shards.py); ingresses ask a conversation's shard, engines' reports reach all. One directory takes one call "
        "at a time: shards lift the decisions/s it caps. Changing it moves ~1/K of the pins (not the owners)")
    report_relay_period_s: float = Field(0.0, ge=0, le=5.0, description="with directory_shards > 1: engines report to one shard, "
        "which relays to the others in one call each this often (router/report_relay.py); 0: engines report to every shard")
    ownership_db_path: str = Field(".cache/baton/conversations.sqlite3", min_length=1, description="SQLite file recording who "
        "owns each conversation (survives directory and cluster restarts; one file for every shard); relative to the repo "
        "root, on the node the directory runs on; ':memory:' keeps it in memory (tests)")

    @property
    def disaggregated(self) -> bool:
        return self.policy in DISAGGREGATED

    def resolved_ownership_db_path(self, root: Path) -> str:
        """`ownership_db_path` as an absolute path (relative ones from `root`); ':memory:' as is."""
        if self.ownership_db_path == ":memory:":
            return self.ownership_db_path
        p = Path(self.ownership_db_path).expanduser()
        return str(p if p.is_absolute() else Path(root) / p)


class RealtimeConfig(_Strict):
    """Real-time tick sessions (Metronome) on the decode pool: WebSocket /v1/realtime."""

    mode: Literal["bounded", "unbounded"] = Field(
        "bounded", description="bounded: sink + window KV per session (constant memory); unbounded: the whole history")
    sink_tokens: int = Field(16, ge=0, le=1024, description="S: the session's first tokens, kept for its life")
    window_tokens: int = Field(256, ge=1, le=8192, description="W: the most recent tokens kept")
    max_tokens_per_tick: int = Field(16, ge=1, le=512, description="reply tokens per tick (a session may ask for fewer)")
    tick_ms: int = Field(1000, ge=10, le=60_000, description="default tick period")
    max_input_chars: int = Field(4000, ge=1, description="longest input chunk accepted per tick")
    idle_timeout_s: float = Field(300.0, gt=0, description="a session that sends nothing this long is closed")
    max_frame_bytes: int = Field(64 * 1024, ge=1024, description="largest client frame; beyond: an error frame and close 1009")
    max_sessions_per_user: int = Field(4, ge=1, description="live sessions one user may hold at one ingress; beyond: refused (1008)")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="AIMD cap on live sessions per ingress")
    cliff: CliffAdmissionConfig = Field(
        default_factory=CliffAdmissionConfig, description="what a new session meets when its decoder's KV pool is forecast full soon")
    max_clock_skew_s: float = Field(
        1.0, ge=0, description="an input's sent_at may lie this far ahead of the server's clock (clock skew); further: refused")

    @model_validator(mode="after")
    def _frames_fit_inputs(self) -> RealtimeConfig:
        if self.max_frame_bytes < 4 * self.max_input_chars + 256:
            raise ValueError("max_frame_bytes must hold an input of max_input_chars (4 bytes a character, 256 for the rest)")
        return self


class IsolationConfig(_Strict):
    """What tenants share (deployments/salt.py)."""

    prefix_cache: PrefixCacheScope = Field(
        "tenant",
        description="tenant: every request's prefix-cache salt names its tenant (the API key's user, else `user`; callers "
        "with neither share one anonymous tenant), so no request hits KV computed for another tenant and "
        "usage.cached_tokens reveals nothing across tenants; shared: no tenant salt, trades isolation for cross-user "
        "system-prompt reuse (memory facts stay salted per user either way)",
    )


class ControlPlaneConfig(_Strict):
    """Where the ingress replicas, the conversation directory and the memory store run. On one node
    it does not matter; on a multi-node cluster they should sit on a node that stays (the head):
    the directory's and the store's SQLite files are on the disk of the node they run on, and a
    node that dies takes its ingress replicas' in-flight requests with it."""

    custom: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each of them asks for, e.g. {'node:__internal_head__': 0.001}: "
        "Ray's own head-node resource keeps them on the head")

    @model_validator(mode="after")
    def _positive(self) -> ControlPlaneConfig:
        bad = {k: v for k, v in self.custom.items() if not (v > 0) or not k}
        if bad:
            raise ValueError(f"control_plane.custom needs non-empty names with amounts > 0, not {bad}")
        return self

    def actor_options(self, num_cpus: float) -> dict[str, Any]:
        """Ray actor options for one of these deployments (offline env for the ones that load a tokenizer or embedder)."""
        opts: dict[str, Any] = {"num_cpus": num_cpus, "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}}
        if self.custom:
            opts["resources"] = dict(self.custom)
        return opts


class AppConfig(_Strict):
    name: str = "baton"
    model_cache: str = Field(".cache/models", description="folder that holds provisioned models (relative to the cwd)")
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    prefill: PoolConfig | None = Field(None, description="prefill-heavy pool (KV producers); none (or 0 replicas) for colocated/round_robin")
    decode: PoolConfig = Field(..., description="decode pool (KV consumers; the unified pool when not disaggregated)")
    memory: MemoryConfig | None = Field(None, description="per-user memory facts (InferScale); none: /v1/memories is off")
    realtime: RealtimeConfig | None = Field(None, description="real-time tick sessions (Metronome); none: /v1/realtime is off")
    isolation: IsolationConfig = Field(default_factory=IsolationConfig, description="what tenants share (prefix cache)")
    control_plane: ControlPlaneConfig = Field(
        default_factory=ControlPlaneConfig, description="where the ingress, directory and memory store run (multi-node clusters)")

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        if self.prefill is not None and self.prefill.engine.model != self.decode.engine.model:
            raise ValueError(
                f"prefill and decode pools must serve the same model "
                f"(prefill: {self.prefill.engine.model!r}, decode: {self.decode.engine.model!r})"
            )
        if not _pool_can_run(self.decode):
            raise ValueError("decode pool needs at least one replica: it serves every request")
        prefill_runs = self.prefill is not None and _pool_can_run(self.prefill)
        if self.routing.disaggregated and not prefill_runs:
            raise ValueError(f"routing.policy {self.routing.policy!r} prefills on the prefill pool: give it at least one replica")
        if not self.routing.disaggregated and prefill_runs:
            raise ValueError(
                f"routing.policy {self.routing.policy!r} serves whole requests on the decode pool: set prefill.num_replicas to 0 "
                f"(and give those engines to the decode pool)"
            )
        self._checkpoints_with_connectors()
        self._simulated_alone()
        return self

    def _simulated_alone(self) -> None:
        """A simulated engine (engine.kind simulated) has no KV connector: it cannot take memory
        KV or real-time windows, and its handoff params name no real NIXL peer, so a handoff
        needs both pools simulated."""
        pools = [p for p in (self.prefill, self.decode) if p is not None and _pool_can_run(p)]
        kinds = {p.engine.kind for p in pools}
        if "simulated" not in kinds:
            return
        if len(kinds) > 1:
            raise ValueError("prefill and decode pools must both be simulated or both vLLM (engine.kind): a simulated "
                             "handoff names no real NIXL peer")
        if self.memory is not None or self.realtime is not None:
            raise ValueError("engine.kind simulated has no KV connector, so memory (KV injection) and realtime (held "
                             "windows) cannot run on it: remove them from a simulated config")

    def _checkpoints_with_connectors(self) -> None:
        """Recurrent-state checkpoints (hybrid models) and the KV connectors their engines run.

        A handoff (a disaggregated policy) runs NIXL: vLLM 0.32's NixlConnector moves a hybrid
        model's conv/SSM state with its attention KV, and only under vLLM's hybrid KV cache
        manager (HMA), so the pool's connector stack must declare HMA (stack_supports_hma; else
        vLLM turns HMA off and a hybrid model fails at startup). CheckpointScheduler never reports
        a divergent hybrid hit, so vLLM's hit_diverged fallback cannot restore the junction states
        the plan dropped (docs/hybrid_pd.md). Memories and real-time windows inject position-free
        attention KV, which cannot carry recurrent state: on a hybrid model the segment connector
        turns itself off and every injection is recomputed, so that combination is refused."""
        pools = [(role, p) for role, p in (("prefill", self.prefill), ("decode", self.decode))
                 if p is not None and p.engine.checkpoints is not None]
        if not pools:
            return
        why = ["memory (KV injection)"] if self.memory is not None else []
        why += ["realtime (held windows)"] if self.realtime is not None else []
        if why:
            raise ValueError(
                f"engine.checkpoints (hybrid models) cannot take injected KV: {', '.join(why)} injects attention KV "
                f"segments, which carry no recurrent (conv/SSM) state; serve a hybrid model with checkpoints without "
                f"memory and realtime (routing.policy colocated or a disaggregated one)"
            )
        for role, pool in pools:
            kv = kv_transfer_engine_arg(role, handoff=self.routing.disaggregated, on_gpu=pool.resources.num_gpus > 0)
            if not stack_supports_hma(kv):
                names = [c.get("kv_connector") for c in (kv or {}).get("kv_connector_extra_config", {}).get("connectors", [kv])]
                raise ValueError(
                    f"{role}.engine.checkpoints (hybrid models) needs vLLM's hybrid KV cache manager, and the KV "
                    f"connectors routing.policy {self.routing.policy!r} configures ({names}) do not all declare SupportsHMA"
                )


def _pool_can_run(pool: PoolConfig) -> bool:
    return pool.num_replicas > 0 if pool.autoscaling is None else pool.autoscaling.max_replicas > 0


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names the offending field(s)."""


def load_app_config(args: dict[str, Any] | AppConfig) -> AppConfig:
    """Validate raw YAML `args` into an AppConfig, raising ConfigError with field paths."""
    if isinstance(args, AppConfig):
        return args
    try:
        return AppConfig.model_validate(args)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "<root>"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError("invalid Baton config:\n" + "\n".join(lines)) from None
