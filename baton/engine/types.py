"""Typed messages between the ingress and the engine replicas (no vLLM import: the ingress uses them too)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True)
class MemoryFact:
    """One memory fact laid into a prompt: its tokens sit at prompt positions [start, start+len(token_ids)).

    context_ids: the tokens of the w facts that precede it in its source (context-window
    encoding: the fact's KV is computed after them, and only the fact's own tokens are kept)."""

    fact_id: str
    start: int
    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...] = ()
    context_fact_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryInjection:
    """Which prompt prefix is injected as KV instead of computed (InferScale).

    Prompt regions:  [0, anchor_len) anchor (system text before the memories; exact KV)
                     [anchor_len, end) the facts, back to back (position-free KV, re-rotated)
                     [end, prompt_len) computed by the engine (conversation and query)
    Invariant (check_integrity): the facts tile [anchor_len, end) without gaps."""

    user: str
    anchor_len: int
    facts: tuple[MemoryFact, ...]
    window: int
    model: str

    @property
    def end(self) -> int:
        return self.facts[-1].start + len(self.facts[-1].token_ids) if self.facts else self.anchor_len

    def check_integrity(self, prompt_len: int) -> None:
        pos = self.anchor_len
        for f in self.facts:
            if f.start != pos or not f.token_ids:
                raise ValueError(f"memory fact {f.fact_id} at {f.start} does not continue the layout at {pos}")
            pos += len(f.token_ids)
        if not 0 < self.anchor_len <= pos < prompt_len:
            raise ValueError(f"injected prefix [0, {pos}) must start with an anchor and leave a token to compute")


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
    cache_salt: str | None = None  # separates prefix-cache entries built from approximate (injected) KV


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
    turn_index: int | None = None  # the turn's index in its conversation (first delta; set by the ingress)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step; read by routers and metrics."""

    kv_usage: float = 0.0
    kv_resident: float = 0.0  # fraction of the pool holding KV: in use, or cached for reuse (max of the two)
    kv_capacity_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    pending_prefill_tokens: int = 0  # prompt tokens not yet computed, over running + waiting
    in_flight: int = 0
    healthy: bool = True
    reason: str = ""
    steps: int = 0

    def as_routing_stats(self) -> dict[str, Any]:
        return {
            "kv_usage": self.kv_usage,
            "kv_resident": self.kv_resident,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "in_flight": self.in_flight,
        }


class EngineUnavailable(RuntimeError):
    """The engine cannot serve (failed to start, died); the ingress answers 503 with this reason."""


class EngineRequestError(ValueError):
    """The engine rejected one request (bad parameters); the ingress answers 400 with this reason."""


class ConversationNotFound(LookupError):
    """The session id is not a conversation of this user; the ingress answers 404 (the same
    answer whether it belongs to someone else or to nobody)."""
