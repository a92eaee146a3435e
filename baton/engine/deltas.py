"""GenerationDeltas from vLLM's RequestOutputs, and merging the ones a slow consumer let pile up."""
from __future__ import annotations

import asyncio
from typing import Any

from baton.engine.types import GenerationDelta


def delta_from_output(out: Any) -> GenerationDelta:
    """One step's output for one request (RequestOutputKind.DELTA: only the new tokens)."""
    comp = out.outputs[0] if out.outputs else None
    return GenerationDelta(
        text=comp.text if comp else "",
        token_ids=tuple(comp.token_ids) if comp else (),
        prompt_tokens=len(out.prompt_token_ids or ()),
        cached_tokens=int(out.num_cached_tokens or 0),
        finished=bool(out.finished),
        finish_reason=comp.finish_reason if comp else None,
        kv_transfer_params=getattr(out, "kv_transfer_params", None),
        logprobs=sampled_logprobs(comp),
        top_logprobs=top_logprobs(comp),
    )


def sampled_logprobs(comp: Any) -> tuple[float, ...]:
    """The sampled tokens' logprobs of a delta (vLLM lists {token: Logprob} per position)."""
    if comp is None or not comp.logprobs:
        return ()
    return tuple(float(pos[tok].logprob) for tok, pos in zip(comp.token_ids, comp.logprobs, strict=False))


def top_logprobs(comp: Any) -> tuple[dict[int, float], ...]:
    """Each position's {token: logprob} as vLLM lists it (the sampled token and the N most likely)."""
    if comp is None or not comp.logprobs:
        return ()
    return tuple({int(t): float(lp.logprob) for t, lp in pos.items()} for pos in comp.logprobs)


def coalesce(item: Any, pending: asyncio.Queue) -> Any:
    """Merge deltas that queued up while the consumer was busy into one, so a slow consumer
    (Serve streaming, HTTP) handles one message per wake-up instead of one per engine step.
    An exception or a finished delta ends the merge; nothing queued after it exists."""
    while isinstance(item, GenerationDelta) and not item.finished and not pending.empty():
        nxt = pending.get_nowait()
        if isinstance(nxt, BaseException):
            pending.put_nowait(nxt)  # deliver the tokens first, the error on the next get
            break
        item = GenerationDelta(
            text=item.text + nxt.text,
            token_ids=item.token_ids + nxt.token_ids,
            prompt_tokens=nxt.prompt_tokens or item.prompt_tokens,
            cached_tokens=max(item.cached_tokens, nxt.cached_tokens),
            finished=nxt.finished,
            finish_reason=nxt.finish_reason,
            kv_transfer_params=nxt.kv_transfer_params or item.kv_transfer_params,
            replica=item.replica or nxt.replica,
            logprobs=item.logprobs + nxt.logprobs,
            top_logprobs=item.top_logprobs + nxt.top_logprobs,
            timing=item.timing or nxt.timing,
        )
    return item
