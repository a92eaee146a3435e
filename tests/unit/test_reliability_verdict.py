"""The reliability bench's verdicts (baton/bench/reliability_verdict.py): when a streamed answer is
a success, when a case passes, the RESULT line, and the metric sum the resume case reads. Pure:
no cluster, no HTTP."""
from __future__ import annotations

import json

import pytest

from baton.bench.reliability_verdict import (
    CaseResult,
    StreamSeen,
    check_names,
    judge_stream,
    metric_sum,
    result_line,
    settle,
    totals,
)


def feed(*events: object) -> StreamSeen:
    seen = StreamSeen()
    for e in events:
        seen.feed(f"data: {e if isinstance(e, str) else json.dumps(e)}")
        seen.feed("")  # SSE's blank separator lines carry nothing
    return seen


def chunk(text: str | None = None, finish: str | None = None) -> dict[str, object]:
    delta = {"content": text} if text is not None else {}
    return {"choices": [{"delta": delta, "finish_reason": finish}]}


ROLE = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}


def test_a_complete_stream_is_a_success_and_keeps_what_was_read() -> None:
    seen = feed(ROLE, chunk("Hel"), chunk("lo"), chunk(finish="length"), USAGE, "[DONE]")
    v = judge_stream(200, seen)
    assert v.ok and str(v) == "ok"
    assert seen.text == "Hello" and seen.texts == ["Hel", "lo"] and seen.finish_reasons == ["length"]
    assert seen.usage == {"prompt_tokens": 5, "completion_tokens": 2} and seen.done == 1 and not seen.cut


def test_completions_chunks_count_as_content() -> None:
    seen = feed({"choices": [{"text": "abc", "finish_reason": None}]}, {"choices": [{"text": "", "finish_reason": "stop"}]}, "[DONE]")
    assert judge_stream(200, seen).ok and seen.text == "abc"


@pytest.mark.parametrize(("events", "problem"), [
    ((chunk("hi"), chunk(finish="stop")), "no [DONE]"),  # cut: the client cannot tell it from a dropped connection
    ((chunk("hi"), "[DONE]"), "no finish_reason"),
    ((ROLE, chunk(finish="stop"), "[DONE]"), "no content chunk"),
    ((chunk("hi"), {"error": {"type": "service_unavailable", "message": "x"}}, "[DONE]"), "error event service_unavailable"),
    ((chunk("hi", "stop"), "[DONE]", "[DONE]"), "2 [DONE]s"),
    ((chunk("hi"), chunk(finish="stop"), chunk(finish="stop"), "[DONE]"), "2 finish_reasons"),
    ((chunk("hi"), "[DONE]", chunk(finish="stop")), "events after [DONE]"),
    ((chunk("hi", "stop"), "not json", "[DONE]"), "1 malformed events"),
])
def test_every_way_a_stream_falls_short_is_named(events: tuple[object, ...], problem: str) -> None:
    v = judge_stream(200, feed(*events))
    assert not v.ok and any(problem in p for p in v.problems), v.problems


def test_a_stream_that_never_started_is_judged_by_its_status() -> None:
    assert judge_stream(503, None).problems == ("status 503",)
    assert judge_stream(None, StreamSeen()).problems == ("status None",)
    assert judge_stream(200, None).problems == ("no stream read",)


def test_cut_means_no_done_and_no_error_event() -> None:
    assert feed(chunk("hi")).cut
    assert not feed(chunk("hi"), {"error": {"type": "server_error"}}).cut  # it said why: an error, not a cut
    assert not feed(chunk("hi", "stop"), "[DONE]").cut


def case(passed: bool = True, lost: int = 0, fives: int = 0, leaks: int = 0) -> CaseResult:
    return CaseResult("c", "faults", passed, lost, fives, leaks, "detail", 1.0)


def test_a_case_cannot_pass_while_its_counts_say_otherwise() -> None:
    assert settle(case()).passed
    for bad in (case(lost=1), case(fives=2), case(leaks=1)):
        out = settle(bad)
        assert not out.passed and "failed on its counts" in out.detail
    failed = case(passed=False)
    assert settle(failed) is failed  # a failed case stays as it was


def test_totals_and_the_result_line() -> None:
    rs = [settle(case()), settle(case(lost=1)), settle(case(fives=2, leaks=1)), case(passed=False)]
    t = totals(rs)
    assert (t.lost_turns, t.server_errors, t.isolation_leaks, t.cases, t.passed) == (1, 2, 1, 4, 1)
    assert result_line(t) == "RESULT lost_turns=1 server_errors=2 isolation_leaks=1 cases=4 passed=1"
    assert not t.clean
    assert totals([case(), case()]).clean and not totals([]).clean


def test_case_names_must_be_unique() -> None:
    assert check_names(["a", "b"]) == ["a", "b"]
    with pytest.raises(ValueError, match="'a'"):
        check_names(["a", "b", "a"])


def test_metric_sum_reads_rays_export_names_and_filters_labels() -> None:
    text = "\n".join([
        "# HELP ray_baton_stream_resumes_total streams whose decoder died",
        "# TYPE ray_baton_stream_resumes_total counter",
        'ray_baton_stream_resumes_total{Component="core_worker",outcome="resumed",replica="i1"} 2.0',
        'ray_baton_stream_resumes_total{Component="core_worker",outcome="resumed",replica="i2"} 1.0',
        'ray_baton_stream_resumes_total{Component="core_worker",outcome="failed",replica="i2"} 5.0',
        'ray_baton_stream_resumes_other{outcome="resumed"} 9.0',
        "baton_stream_resumes 4",
    ])
    assert metric_sum(text, "baton_stream_resumes", outcome="resumed") == 3.0
    assert metric_sum(text, "baton_stream_resumes") == 12.0
    assert metric_sum(text, "baton_missing") == 0.0
