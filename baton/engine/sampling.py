"""A GenerationRequest as vLLM's engine takes it: the prompt dict and the SamplingParams.

vLLM is imported on first use (the engine thread), never at module import.
"""
from __future__ import annotations

import json
from typing import Any

from baton.engine.types import GenerationRequest


def engine_inputs(req: GenerationRequest, kv_transfer_params: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
    """(prompt, SamplingParams) for `LLMEngine.add_request(req.request_id, prompt, params)`.
    Deltas only (RequestOutputKind.DELTA): each step reports the new tokens, not all so far."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
    if req.cache_salt:
        prompt["cache_salt"] = req.cache_salt
    return prompt, sampling_params(req, kv_transfer_params)


def sampling_params(req: GenerationRequest, kv_transfer_params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    s = req.sampling
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    c = s.constraint
    structured = None if c is None else StructuredOutputsParams(json=json.loads(c.json_schema) if c.json_schema else None,
                                                                structural_tag=c.structural_tag)
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        seed=s.seed,
        stop=list(s.stop) or None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        ignore_eos=s.ignore_eos,
        logprobs=s.top_logprobs if s.top_logprobs else (0 if s.logprobs else None),
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
        structured_outputs=structured,
        skip_special_tokens=s.skip_special_tokens,
    )
