"""The slice of vLLM's RequestOutput that Baton reads (baton/engine/deltas.py), for simulated engines.

Placeholder tokens: a fixed cycle of token ids, each detokenized as " x", so replies are valid text
for the API layer (chat, completions, streaming) whatever the tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLACEHOLDER_TOKEN_IDS = (1010, 1011, 1012, 1013)  # inside every tokenizer Baton ships (SmolLM2: 49152 ids)
PLACEHOLDER_TEXT = " x"


@dataclass(frozen=True)
class Logprob:
    logprob: float


@dataclass(frozen=True)
class CompletionOutput:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None


def placeholder_token(position: int) -> int:
    """The token id at output position `position`."""
    return PLACEHOLDER_TOKEN_IDS[position % len(PLACEHOLDER_TOKEN_IDS)]


def delta_output(request_id: str, prompt: list[int], cached: int, token_ids: tuple[int, ...], finish_reason: str | None,
                 want_logprobs: bool, kv_transfer_params: dict[str, Any] | None) -> RequestOutput:
    """One step's new tokens for one request (vLLM's RequestOutputKind.DELTA)."""
    logprobs = [{t: Logprob(0.0)} for t in token_ids] if want_logprobs else None
    comp = CompletionOutput(PLACEHOLDER_TEXT * len(token_ids), token_ids, finish_reason, logprobs)
    return RequestOutput(request_id, [comp], prompt, max(0, cached), finish_reason is not None, kv_transfer_params)
