"""Resuming a stream whose decoder died, as a pure planner (deployments/backend.py applies it).

When the decoder serving a stream dies after some of its tokens reached the client, the ingress
asks another decoder to continue the same stream: the continuation's prompt is the original
prompt followed by the tokens already delivered, and it may generate only what is left of
max_tokens. The client sees one stream; the continuation's deltas are reported as the original
request's (`client_delta`).

What a resume promises:
  greedy (temperature 0)  the tokens an undisturbed run would have produced: the same model
                          over the same prefix picks the same argmax at every step (up to the
                          numerics of another batch, as any two greedy runs)
  sampled                 a continuation of the same prefix; the seed is kept, but the random
                          stream starts afresh, so the tokens differ from an undisturbed run
What does not cross the splice (stated, not hidden):
  penalties     presence/frequency penalties count generated tokens only; the delivered tokens
                are prompt for the continuation, so they no longer count
  stop strings  carried unchanged, but matched in the continuation's own text: a stop string
                that straddles the splice is missed, and the up to len(longest stop) - 1
                characters vLLM holds back while it checks them are not sent again
  memories      with memories injected as KV (`request.memory`), the continuation computes its
                whole prefix from tokens (memory=None): the prompt already holds the memory
                layout's tokens, so this is the simplest correct choice; the KV is exact where
                the first decoder's was approximate, so even greedy output may then differ.
                The cache salt stays: the conversation's later turns find this KV under it.
Invariants (checked; a violation is a bug, not a refusal):
  delivered tokens <= the original max_tokens
  continuation prompt + max_tokens == original prompt + max_tokens (the context budget the
  frontend validated is never exceeded)
Bounds: at most `limit` resumes per request (RESUME_LIMIT); only while the ingress holds the
stream (the backend asks the planner only for a lost decoder, never for a cancelled request).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from baton.engine.types import GenerationDelta, GenerationRequest

RESUME_LIMIT = 1

# limit      the request already used its resumes
# unplaced   the lost decoder was placed by load (no directory to re-place the conversation)
# exhausted  every token max_tokens allows was delivered: the stream finishes ("length")
RefusalReason = Literal["limit", "unplaced", "exhausted"]
# metric outcomes (deployments/metrics.py): a resumed stream that completed, one finished
# without a new decoder (exhausted), a refusal that fails the stream, a continuation that failed
ResumeOutcome = Literal["resumed", "finished", "refused", "failed"]


@dataclass(frozen=True)
class ResumePlan:
    """Continue the stream on another decoder with `request`.

    request        the continuation: prompt = original prompt + delivered tokens, max_tokens
                   reduced by the delivered count, id `<original id>-r<resume>`, memory None
    prompt_tokens  the original prompt's length (what the client's deltas report)
    delivered      tokens the client already has
    resume         1 for the request's first resume
    """

    request: GenerationRequest
    prompt_tokens: int
    delivered: int
    resume: int


@dataclass(frozen=True)
class ResumeRefused:
    """No resume. finish_reason: set when the stream is complete anyway (finish it with that
    reason instead of failing it); None: the stream fails with the decoder's error."""

    reason: RefusalReason
    finish_reason: str | None = None

    @property
    def outcome(self) -> ResumeOutcome:
        return "finished" if self.finish_reason is not None else "refused"


def plan_resume(
    request: GenerationRequest, delivered: Sequence[int], resumes_used: int, *, placed: bool = True, limit: int = RESUME_LIMIT
) -> ResumePlan | ResumeRefused:
    """Pure: how `request`'s stream goes on after its decoder died with `delivered` token ids sent
    to the client (in order), when the request already used `resumes_used` resumes. placed: the
    lost decoder was the directory's choice (False: placed by load, nothing to re-place with)."""
    budget = request.sampling.max_tokens
    if len(delivered) > budget:
        raise ValueError(f"{len(delivered)} tokens delivered for a request of max_tokens {budget}")
    if len(delivered) == budget:
        return ResumeRefused("exhausted", finish_reason="length")
    if resumes_used >= limit:
        return ResumeRefused("limit")
    if not placed:
        return ResumeRefused("unplaced")
    resume = resumes_used + 1
    continuation = replace(
        request,
        request_id=f"{request.request_id}-r{resume}",
        prompt_token_ids=tuple(request.prompt_token_ids) + tuple(delivered),
        # a grammar cannot restart mid-output: the continuation is unconstrained (guided decoding)
        sampling=replace(request.sampling, max_tokens=budget - len(delivered), constraint=None),
        memory=None,
        kv_transfer_params=None,
        target_replica=None,
    )
    plan = ResumePlan(continuation, prompt_tokens=len(request.prompt_token_ids), delivered=len(delivered), resume=resume)
    check_plan(request, plan)
    return plan


def check_plan(original: GenerationRequest, plan: ResumePlan) -> None:
    """The continuation asks for exactly the original's context budget, after its delivered tokens."""
    cont = plan.request
    if cont.prompt_token_ids[: plan.prompt_tokens] != tuple(original.prompt_token_ids):
        raise ValueError("a continuation's prompt must start with the original prompt")
    if len(cont.prompt_token_ids) + cont.sampling.max_tokens != len(original.prompt_token_ids) + original.sampling.max_tokens:
        raise ValueError("a continuation must keep the original's context budget")
    if cont.sampling.max_tokens < 1:
        raise ValueError("a continuation must have a token left to generate")


def client_delta(delta: GenerationDelta, plan: ResumePlan) -> GenerationDelta:
    """A continuation's delta as the client's stream reports it: the original prompt's length
    (the delivered tokens are completion, not prompt), cached tokens capped at it, and no
    replica or turn index (those are set on a stream's first delta only)."""
    return replace(
        delta,
        prompt_tokens=plan.prompt_tokens,
        cached_tokens=min(delta.cached_tokens, plan.prompt_tokens),
        replica=None,
        turn_index=None,
    )


def finish_delta(refusal: ResumeRefused, prompt_tokens: int) -> GenerationDelta:
    """The last delta of a stream that is complete although its decoder died before saying so."""
    if refusal.finish_reason is None:
        raise ValueError(f"a {refusal.reason!r} refusal does not finish the stream")
    return GenerationDelta(text="", token_ids=(), prompt_tokens=prompt_tokens, cached_tokens=0, finished=True,
                           finish_reason=refusal.finish_reason)
