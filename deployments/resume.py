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
  constrained   (guided decoding: a forced tool call, a JSON schema) a grammar cannot start
                mid-output, so the continuation is a replay: the original request again (its
                prompt, its constraint, its memories), whose first `replay` tokens must equal the
                delivered ones and are not sent again (ReplaySplice); the client gets only what
                follows. A replay is exact only when the output is reproducible: greedy, or
                sampled with a seed. A constrained sampled request without a seed is not resumed
                (reason "constrained": the stream fails, as a decoder loss did before resumes). A
                replay whose tokens diverge from the delivered ones fails the stream
                (ReplayDiverged), never splices two different outputs.
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
# constrained  guided decoding, sampled without a seed: a replay would not reproduce the output
RefusalReason = Literal["limit", "unplaced", "exhausted", "constrained"]
# metric outcomes (deployments/metrics.py): a resumed stream that completed, one finished
# without a new decoder (exhausted), a refusal that fails the stream, a continuation that failed
ResumeOutcome = Literal["resumed", "finished", "refused", "failed"]


@dataclass(frozen=True)
class ResumePlan:
    """Continue the stream on another decoder with `request`.

    request        the continuation: prompt = original prompt + delivered tokens, max_tokens
                   reduced by the delivered count, id `<original id>-r<resume>`, memory None;
                   a replay (constrained output): the original request, id `<original id>-r<resume>`
    prompt_tokens  the original prompt's length (what the client's deltas report)
    delivered      tokens the client already has
    resume         1 for the request's first resume
    replay         the continuation's first `replay` tokens regenerate the delivered ones (0: none)
    """

    request: GenerationRequest
    prompt_tokens: int
    delivered: int
    resume: int
    replay: int = 0


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
    if request.sampling.constraint is not None:  # a grammar cannot start mid-output: replay it
        if request.sampling.temperature > 0 and request.sampling.seed is None:
            return ResumeRefused("constrained")
        replay = replace(request, request_id=f"{request.request_id}-r{resume}", kv_transfer_params=None, target_replica=None)
        plan = ResumePlan(replay, prompt_tokens=len(request.prompt_token_ids), delivered=len(delivered), resume=resume,
                          replay=len(delivered))
        check_plan(request, plan)
        return plan
    continuation = replace(
        request,
        request_id=f"{request.request_id}-r{resume}",
        prompt_token_ids=tuple(request.prompt_token_ids) + tuple(delivered),
        sampling=replace(request.sampling, max_tokens=budget - len(delivered)),
        memory=None,
        kv_transfer_params=None,
        target_replica=None,
    )
    plan = ResumePlan(continuation, prompt_tokens=len(request.prompt_token_ids), delivered=len(delivered), resume=resume)
    check_plan(request, plan)
    return plan


def check_plan(original: GenerationRequest, plan: ResumePlan) -> None:
    """The continuation asks for exactly the original's context budget, after its delivered
    tokens; a replay is the original request under a new id."""
    cont = plan.request
    if plan.replay:
        if replace(cont, request_id=original.request_id) != replace(original, kv_transfer_params=None, target_replica=None):
            raise ValueError("a replay must ask for the original request")
        if plan.replay != plan.delivered:
            raise ValueError("a replay regenerates exactly the delivered tokens")
        return
    if cont.prompt_token_ids[: plan.prompt_tokens] != tuple(original.prompt_token_ids):
        raise ValueError("a continuation's prompt must start with the original prompt")
    if len(cont.prompt_token_ids) + cont.sampling.max_tokens != len(original.prompt_token_ids) + original.sampling.max_tokens:
        raise ValueError("a continuation must keep the original's context budget")
    if cont.sampling.max_tokens < 1:
        raise ValueError("a continuation must have a token left to generate")


def client_delta(delta: GenerationDelta, plan: ResumePlan) -> GenerationDelta:
    """A continuation's delta as the client's stream reports it: the original prompt's length
    (the delivered tokens are completion, not prompt), cached tokens capped at it, and no
    replica, turn index or timing (those are set on a stream's first delta only)."""
    return replace(
        delta,
        prompt_tokens=plan.prompt_tokens,
        cached_tokens=min(delta.cached_tokens, plan.prompt_tokens),
        replica=None,
        turn_index=None,
        timing=None,
    )


def finish_delta(refusal: ResumeRefused, prompt_tokens: int) -> GenerationDelta:
    """The last delta of a stream that is complete although its decoder died before saying so."""
    if refusal.finish_reason is None:
        raise ValueError(f"a {refusal.reason!r} refusal does not finish the stream")
    return GenerationDelta(text="", token_ids=(), prompt_tokens=prompt_tokens, cached_tokens=0, finished=True,
                           finish_reason=refusal.finish_reason)


class ReplayDiverged(RuntimeError):
    """A replay's tokens differ from those the client already has: the stream cannot be spliced."""


class ReplaySplice:
    """Drops a replay's regenerated prefix, checking it: `feed(delta)` returns the part of the
    delta the client does not have yet (None while the replay is still behind), and raises
    ReplayDiverged when the replay's token ids or text differ from the delivered ones.

    Token ids are compared one by one; text as cumulative strings (a token's text can be held
    back by the detokenizer, the same way in both runs), and a delta is sent from the first
    token id and the first character beyond the delivered ones."""

    def __init__(self, delivered_ids: Sequence[int], delivered_text: str):
        self._ids, self._text = tuple(delivered_ids), delivered_text
        self._seen_ids: list[int] = []
        self._seen_text = ""

    def feed(self, delta: GenerationDelta) -> GenerationDelta | None:
        before_ids, before_text = len(self._seen_ids), len(self._seen_text)
        self._seen_ids.extend(delta.token_ids)
        self._seen_text += delta.text
        n, t = min(len(self._seen_ids), len(self._ids)), min(len(self._seen_text), len(self._text))
        if tuple(self._seen_ids[:n]) != self._ids[:n] or self._seen_text[:t] != self._text[:t]:
            raise ReplayDiverged(f"the replayed stream diverged from the {len(self._ids)} delivered tokens")
        new_ids = tuple(self._seen_ids[max(before_ids, len(self._ids)):])
        new_text = self._seen_text[max(before_text, len(self._text)):]
        if not new_ids and not new_text and not delta.finished:
            return None
        if delta.finished and len(self._seen_ids) < len(self._ids):
            raise ReplayDiverged(f"the replay finished after {len(self._seen_ids)} of the {len(self._ids)} delivered tokens")
        kept = len(new_ids)
        logprobs = delta.logprobs[len(delta.logprobs) - kept:] if kept and delta.logprobs else ()
        return replace(delta, token_ids=new_ids, text=new_text, logprobs=logprobs)
