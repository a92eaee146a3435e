"""The stream-resume planner (deployments/resume.py): which tokens a continuation re-prefills, how
much it may still generate, and when there is no resume (one per request; nothing left to do)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from baton.engine.types import GenerationDelta, GenerationRequest, OutputConstraint, SamplingSpec
from deployments.resume import (
    RESUME_LIMIT,
    ReplayDiverged,
    ReplaySplice,
    ResumePlan,
    ResumeRefused,
    check_plan,
    client_delta,
    finish_delta,
    plan_resume,
)
from kv_transfer.injection import MemoryFact, MemoryInjection

PROMPT = (11, 12, 13, 14)
MEMORY = MemoryInjection(user="alice", anchor_len=1, facts=(MemoryFact("f1", 1, (12, 13)),), window=0, model="m")
SAMPLING = SamplingSpec(max_tokens=10, temperature=0.7, top_p=0.9, top_k=5, seed=42, stop=("END",), presence_penalty=0.1,
                        frequency_penalty=0.2, ignore_eos=True, logprobs=True)


def original(**kw: object) -> GenerationRequest:
    fields: dict[str, object] = dict(request_id="chatcmpl-1", prompt_token_ids=PROMPT, sampling=SAMPLING, session_id="conv-1",
                                     user="alice", memory=MEMORY, cache_salt="salt-1", target_replica="d0", kv_transfer_params={"k": 1})
    fields.update(kw)
    return GenerationRequest(**fields)  # type: ignore[arg-type]


def plan_of(decision: ResumePlan | ResumeRefused) -> ResumePlan:
    assert isinstance(decision, ResumePlan), decision
    return decision


def test_the_continuation_prefills_the_prompt_and_the_delivered_tokens_and_generates_the_rest() -> None:
    plan = plan_of(plan_resume(original(), [101, 102, 103], resumes_used=0))
    cont = plan.request
    assert cont.prompt_token_ids == PROMPT + (101, 102, 103)
    assert cont.sampling == replace(SAMPLING, max_tokens=7)  # seed, stop strings, ignore_eos, penalties: unchanged
    assert cont.request_id == "chatcmpl-1-r1"
    assert (plan.prompt_tokens, plan.delivered, plan.resume) == (4, 3, 1)


def test_the_continuation_keeps_the_conversation_and_computes_memories_from_tokens() -> None:
    cont = plan_of(plan_resume(original(), [101], resumes_used=0)).request
    assert (cont.session_id, cont.user, cont.cache_salt) == ("conv-1", "alice", "salt-1")
    assert cont.memory is None  # the prompt holds the memory layout's tokens; the prefix is computed from them
    assert cont.target_replica is None and cont.kv_transfer_params is None  # placed afresh by the backend


def test_a_stream_that_delivered_nothing_resumes_with_its_own_prompt() -> None:
    cont = plan_of(plan_resume(original(), [], resumes_used=0)).request
    assert cont.prompt_token_ids == PROMPT and cont.sampling.max_tokens == 10


@pytest.mark.parametrize("used", [RESUME_LIMIT, RESUME_LIMIT + 3])
def test_one_resume_per_request(used: int) -> None:
    assert RESUME_LIMIT == 1
    decision = plan_resume(original(), [101, 102], resumes_used=used)
    assert decision == ResumeRefused("limit")
    assert decision.outcome == "refused" and decision.finish_reason is None


def test_a_higher_limit_builds_each_resume_from_the_original_request() -> None:
    plan = plan_of(plan_resume(original(), [101, 102, 103, 104], resumes_used=1, limit=2))
    assert plan.request.request_id == "chatcmpl-1-r2" and plan.resume == 2
    assert plan.request.prompt_token_ids == PROMPT + (101, 102, 103, 104) and plan.request.sampling.max_tokens == 6


def test_a_lost_decoder_placed_by_load_is_not_resumed() -> None:
    assert plan_resume(original(), [101], resumes_used=0, placed=False) == ResumeRefused("unplaced")


@pytest.mark.parametrize("used", [0, RESUME_LIMIT])
def test_nothing_left_to_generate_finishes_the_stream_with_length(used: int) -> None:
    delivered = list(range(100, 110))  # all 10 of max_tokens, whatever the resumes used
    decision = plan_resume(original(), delivered, resumes_used=used, placed=False)
    assert decision == ResumeRefused("exhausted", finish_reason="length")
    assert decision.outcome == "finished"
    last = finish_delta(decision, prompt_tokens=4)
    assert last == GenerationDelta(text="", token_ids=(), prompt_tokens=4, cached_tokens=0, finished=True, finish_reason="length")


def test_more_tokens_delivered_than_max_tokens_is_a_bug() -> None:
    with pytest.raises(ValueError, match="max_tokens 10"):
        plan_resume(original(), list(range(11)), resumes_used=0)


def test_a_refusal_without_a_finish_reason_cannot_finish_a_stream() -> None:
    with pytest.raises(ValueError, match="limit"):
        finish_delta(ResumeRefused("limit"), prompt_tokens=4)


@pytest.mark.parametrize("delivered", range(10))
def test_every_continuation_keeps_the_original_context_budget(delivered: int) -> None:
    plan = plan_of(plan_resume(original(), list(range(200, 200 + delivered)), resumes_used=0))
    assert len(plan.request.prompt_token_ids) + plan.request.sampling.max_tokens == len(PROMPT) + SAMPLING.max_tokens
    assert plan.request.sampling.max_tokens >= 1
    check_plan(original(), plan)


@pytest.mark.parametrize(
    "broken, message",
    [
        (lambda p: replace(p, request=replace(p.request, prompt_token_ids=(9,) + p.request.prompt_token_ids[1:])), "start with"),
        (lambda p: replace(p, request=replace(p.request, sampling=replace(p.request.sampling, max_tokens=99))), "budget"),
    ],
    ids=["prompt-changed", "budget-grown"],
)
def test_check_plan_refuses_a_continuation_that_is_not_one(broken: Callable[[ResumePlan], ResumePlan], message: str) -> None:
    plan = plan_of(plan_resume(original(), [101, 102], resumes_used=0))
    with pytest.raises(ValueError, match=message):
        check_plan(original(), broken(plan))


def test_a_continuations_delta_reports_the_original_prompt() -> None:
    plan = plan_of(plan_resume(original(), [101, 102], resumes_used=0))
    engine = GenerationDelta(text=" more", token_ids=(103,), prompt_tokens=6, cached_tokens=6, finished=True, finish_reason="stop",
                             replica="d1", logprobs=(-0.5,), turn_index=3)
    seen = client_delta(engine, plan)
    assert (seen.prompt_tokens, seen.cached_tokens) == (4, 4)  # delivered tokens are completion, never prompt nor cache
    assert seen.replica is None and seen.turn_index is None  # a stream's first delta carries those, once
    assert (seen.text, seen.token_ids, seen.finished, seen.finish_reason, seen.logprobs) == (" more", (103,), True, "stop", (-0.5,))
    assert client_delta(replace(engine, cached_tokens=2), plan).cached_tokens == 2


# ---- constrained output: a replay, spliced after the delivered tokens ---------------------------------------------

CONSTRAINED = replace(SAMPLING, temperature=0.0, seed=None, constraint=OutputConstraint(json_schema='{"type": "object"}'))


def test_a_constrained_stream_replays_the_original_request() -> None:
    plan = plan_of(plan_resume(original(sampling=CONSTRAINED), [101, 102], resumes_used=0))
    cont = plan.request
    assert cont.prompt_token_ids == PROMPT and cont.sampling == CONSTRAINED  # constraint and budget kept
    assert cont.memory == MEMORY  # the same prompt: its memories are injected as the first decoder did
    assert cont.request_id == "chatcmpl-1-r1" and cont.target_replica is None and cont.kv_transfer_params is None
    assert (plan.replay, plan.delivered, plan.resume) == (2, 2, 1)


def test_a_replay_is_checked_to_be_the_original_request() -> None:
    plan = plan_of(plan_resume(original(sampling=CONSTRAINED), [101], resumes_used=0))
    with pytest.raises(ValueError, match="original request"):
        check_plan(original(sampling=CONSTRAINED), replace(plan, request=replace(plan.request, prompt_token_ids=PROMPT + (101,))))
    with pytest.raises(ValueError, match="exactly the delivered"):
        check_plan(original(sampling=CONSTRAINED), replace(plan, replay=2))


def delta(ids: tuple[int, ...], text: str, finished: bool = False) -> GenerationDelta:
    return GenerationDelta(text=text, token_ids=ids, prompt_tokens=4, cached_tokens=0, finished=finished,
                           finish_reason="stop" if finished else None, logprobs=tuple(-0.1 * t for t in ids))


def test_the_splice_drops_the_regenerated_prefix_and_sends_the_rest() -> None:
    splice = ReplaySplice([1, 2, 3], "abc")
    assert splice.feed(delta((1,), "a")) is None
    assert splice.feed(delta((2,), "b")) is None
    straddling = splice.feed(delta((3, 4), "cd"))  # one engine step with the last delivered token and a new one
    assert straddling is not None and (straddling.token_ids, straddling.text, straddling.logprobs) == ((4,), "d", (-0.4,))
    last = splice.feed(delta((5,), "e", finished=True))
    assert last is not None and (last.token_ids, last.text, last.finished) == ((5,), "e", True)


def test_text_held_back_by_the_detokenizer_is_compared_as_it_comes() -> None:
    splice = ReplaySplice([1, 2], "xy")
    assert splice.feed(delta((1,), "")) is None  # held back in this run too
    got = splice.feed(delta((2, 3), "xyz"))
    assert got is not None and (got.token_ids, got.text) == ((3,), "z")


@pytest.mark.parametrize("bad", [delta((9,), "a"), delta((1,), "q")])
def test_a_replay_that_diverges_cannot_be_spliced(bad: GenerationDelta) -> None:
    with pytest.raises(ReplayDiverged):
        ReplaySplice([1, 2], "ab").feed(bad)


def test_a_replay_that_finishes_short_of_the_delivered_tokens_diverged() -> None:
    with pytest.raises(ReplayDiverged, match="finished after 1"):
        ReplaySplice([1, 2], "ab").feed(delta((1,), "a", finished=True))
