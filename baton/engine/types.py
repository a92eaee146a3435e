"""Typed messages between the ingress and the engine replicas (no vLLM import: the ingress uses them too)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv_transfer.injection import MemoryInjection

if TYPE_CHECKING:
    from kv_transfer.segments import CaptureResult


@dataclass(frozen=True)
class OutputConstraint:
    """Guided decoding (vLLM structured outputs): the output must match one of these, each the
    JSON text vLLM's StructuredOutputsParams takes (a tool call forced by `tool_choice`)."""

    json_schema: str | None = None  # a JSON Schema
    structural_tag: str | None = None  # an xgrammar structural tag (tagged JSON regions, e.g. <tool_call>...</tool_call>)

    def __post_init__(self) -> None:
        if (self.json_schema is None) == (self.structural_tag is None):
            raise ValueError("an output constraint is exactly one of json_schema or structural_tag")


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logprobs: bool = False  # report each sampled token's logprob (GenerationDelta.logprobs)
    # report the most likely tokens at each sampled position (GenerationDelta.top_logprobs): 0 none,
    # N > 0 the N most likely, -1 the whole vocabulary (the engine's max_logprobs must allow it)
    top_logprobs: int = 0
    constraint: OutputConstraint | None = None  # guided decoding (None: free text)
    skip_special_tokens: bool = True  # False keeps special tokens in the text (tool-call tags that are special tokens)


@dataclass(frozen=True)
class GenerationRequest:
    """One engine request: already tokenized by the ingress (chat template applied there)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    session_id: str | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    target_replica: str | None = None  # the replica that must serve it (chosen by the directory)
    memory: MemoryInjection | None = None  # memory facts to inject as KV (None: compute the whole prompt)
    # prefix-cache scope (vLLM's cache_salt): the tenant, an injected memory composition, a real-time tick
    # (deployments/salt.py); requests hit each other's KV only with equal salts
    cache_salt: str | None = None


@dataclass(frozen=True)
class StageTimes:
    """When one request passed each stage on its way to its first token: wall-clock seconds
    (time.time(), comparable across the processes of one machine; across nodes, up to their
    clock offset). Each layer stamps its own stages on the request's first delta
    (deployments/hop_timing.py turns them into the Server-Timing header); None: not passed
    (e.g. no remote prefill) or not known to the layer that reports it."""

    received: float | None = None  # the ingress got the request (before its body was read)
    prepared: float | None = None  # body parsed and validated, memories recalled, prompt templated and tokenized
    placed: float | None = None  # the directory's plan came back
    prefilled: float | None = None  # the prefill pool's handoff came back (remote prefill only)
    replica_received: float | None = None  # the decode replica's generate began
    engine_added: float | None = None  # the engine thread added it (after memory KV was resolved)
    engine_first: float | None = None  # the engine step that produced its first token returned
    ingress_first: float | None = None  # its first delta reached the ingress


@dataclass(frozen=True)
class GenerationDelta:
    """What one engine step produced for one request (new text and tokens only)."""

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    replica: str | None = None  # set on a request's first delta by the replica that serves it
    logprobs: tuple[float, ...] = ()  # per token in token_ids, when SamplingSpec.logprobs
    # per token in token_ids, when SamplingSpec.top_logprobs: {token id: logprob} of the most likely tokens
    top_logprobs: tuple[dict[int, float], ...] = field(default=(), compare=False)
    turn_index: int | None = None  # the turn's index in its conversation (first delta; set by the ingress)
    # the KV a capture request asked for (finished delta only; EngineRunner.generate(capture=...)).
    # Capture requests are made inside the replica: deltas sent to the ingress never carry one.
    capture: CaptureResult | None = None
    timing: StageTimes | None = field(default=None, compare=False)  # the first delta only (StageTimes); not content, so not compared


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step; read by the replica's metrics and
    turned into the router's ReplicaReport by deployments/replica_report.py."""

    kv_usage: float = 0.0
    kv_resident: float = 0.0  # fraction of the pool holding KV: in use, or cached for reuse (max of the two)
    kv_capacity_tokens: int = 0
    kv_block_tokens: int = 0  # tokens per KV block (prefix caching keeps whole blocks only); 0: unknown
    num_running: int = 0
    num_waiting: int = 0
    pending_prefill_tokens: int = 0  # prompt tokens not yet computed, over running + waiting
    in_flight: int = 0
    healthy: bool = True
    reason: str = ""
    steps: int = 0


class EngineUnavailable(RuntimeError):
    """The engine cannot serve (failed to start, died); the ingress answers 503 with this reason."""


class EngineRequestError(ValueError):
    """The engine rejected one request (bad parameters); the ingress answers 400 with this reason."""


class ConversationNotFound(LookupError):
    """The session id is not a conversation of this user; the ingress answers 404 (the same
    answer whether it belongs to someone else or to nobody)."""
