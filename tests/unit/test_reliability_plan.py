"""The reliability bench without a cluster: its plan of cases (at least 36, each named once and
listed in RELIABILITY.md), its config, the client's retry loop and stream reading (an httpx mock
transport), the kill hook, and the soak's verdict."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import httpx
import pytest

from baton.bench import reliability as rel
from baton.bench import reliability_faults as faults
from baton.bench.reliability_client import Answer, Client, Tally, retry_until, with_one_retry
from baton.bench.reliability_load import soak_verdict
from deployments.config import load_app_config

ROOT = Path(__file__).resolve().parents[2]


def ctx(tmp_path: Path, quick: bool = True) -> rel.Ctx:
    return rel.Ctx(tmp_path, tmp_path / "out", rel.bench_args(tmp_path / "memories.sqlite3"), {}, "MARK", quick, 600.0)


def test_quick_runs_at_least_36_cases_each_named_once_and_listed_in_reliability_md(tmp_path: Path) -> None:
    quick = rel.case_plan(ctx(tmp_path))
    names = [c.name for c in quick]
    assert len(names) >= rel.MIN_CASES == 36 and len(set(names)) == len(names)
    full = [c.name for c in rel.case_plan(ctx(tmp_path, quick=False))]
    assert set(full) - set(names) == {"soak: agentic + memory + realtime"}
    doc = (ROOT / "RELIABILITY.md").read_text()
    missing = [n for n in full if f"| {n} |" not in doc]
    assert not missing, f"cases without a row in RELIABILITY.md's table: {missing}"
    assert {c.category for c in quick} == {"security", "bad_input", "overload", "faults"}
    after = [c.name for c in quick if c.after_cluster]
    assert after == ["exposure: serve run on 0.0.0.0 without keys is refused", "overload: adaptive vs fixed admission, same load"]
    assert names[len(names) - len(after) - 1] == "no prompt text in logs or metrics"  # the marker grep ends the shared cluster's run


def test_selection_by_category_and_the_admission_alias(tmp_path: Path) -> None:
    plan = rel.case_plan(ctx(tmp_path))
    assert [c.name for c in plan if rel.selected(c, {"admission"})] == ["overload: adaptive vs fixed admission, same load"]
    assert all(c.category == "faults" for c in plan if rel.selected(c, {"faults"}))
    assert all(rel.selected(c, None) for c in plan)


def test_the_bench_config_is_valid_with_its_fresh_files_and_short_realtime_limits(tmp_path: Path) -> None:
    args = rel.bench_args(tmp_path / "memories.sqlite3")
    cfg = load_app_config(args)
    assert cfg.routing.ownership_db_path == str(tmp_path / "conversations.sqlite3")
    assert cfg.realtime is not None and cfg.realtime.idle_timeout_s == rel.IDLE_TIMEOUT_S
    assert cfg.realtime.max_sessions_per_user == rel.SESSIONS_PER_USER
    assert cfg.ingress.api_keys_env == "BATON_API_KEYS" and cfg.ingress.num_replicas == rel.INGRESS_REPLICAS


def answer(status: int | None, retry_after: str | None = None) -> Answer:
    return Answer(status, None, "", {"retry-after": retry_after} if retry_after else {}, 0.1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def scripted(*answers: Answer) -> tuple[list[Answer], object]:
    queue = list(answers)
    return queue, lambda: queue.pop(0)


def test_retry_until_follows_retry_after_until_a_success() -> None:
    clock = Clock()
    _, send = scripted(answer(503, "2"), answer(None), answer(429, "1"), answer(200))
    out = retry_until(send, 60, sleep=clock.sleep, clock=clock)  # type: ignore[arg-type]
    assert not out.lost and out.attempts == 4 and out.statuses == [503, None, 429, 200]
    assert clock.slept == [2.0, 1.0, 1.0] and out.no_retry_after == 0


def test_retry_until_stops_at_a_final_answer_or_the_deadline_and_counts_missing_retry_after() -> None:
    clock = Clock()
    _, send = scripted(answer(503), answer(404))
    out = retry_until(send, 60, sleep=clock.sleep, clock=clock)  # type: ignore[arg-type]
    assert out.lost and out.statuses == [503, 404] and out.no_retry_after == 1
    clock = Clock()
    out = retry_until(lambda: answer(503, "5"), 12, sleep=clock.sleep, clock=clock)
    assert out.lost and out.attempts == 3 and clock.t < 12  # 0, 5, 10: the next wait would pass the deadline


def test_with_one_retry_keeps_both_statuses() -> None:
    _, send = scripted(answer(503, "0"), answer(200))
    out = with_one_retry(send)  # type: ignore[arg-type]
    assert not out.lost and out.attempts == 2 and out.statuses == [503, 200]


def sse_client(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Client:
    c = Client("http://x", Tally())
    c._http = httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(status, content=body, headers=headers or {})))
    return c


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(text: str | None = None, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"delta": {"content": text} if text else {}, "finish_reason": finish}]}


def test_stream_chat_calls_the_hook_per_chunk_and_judges_the_stream() -> None:
    calls: list[tuple[int, str | None]] = []
    c = sse_client(sse(chunk("a"), chunk("b"), chunk(finish="length"), {"choices": [], "usage": {"prompt_tokens": 3}}, "[DONE]"),
                   headers={"x-baton-replica": "d1"})
    a = c.stream_chat({"messages": []}, key="k", sid="s", on_chunk=lambda n, h: calls.append((n, h.get("x-baton-replica"))))
    assert a.ok and a.text == "ab" and calls == [(1, "d1"), (2, "d1")]
    assert a.body["usage"] == {"prompt_tokens": 3} and a.body["choices"][0]["finish_reason"] == "length"
    assert c.tally.classes == Counter({"2xx": 1})


def test_a_cut_stream_is_no_success_but_retryable_and_an_error_event_is_classed() -> None:
    c = sse_client(sse(chunk("a"), chunk(finish="stop")))
    cut = c.stream_chat({"messages": []}, key="k", sid=None)
    assert not cut.ok and cut.retryable and str(cut.verdict) == "no [DONE]" and c.tally.classes["stream_cut"] == 1
    c = sse_client(sse(chunk("a"), {"error": {"type": "service_unavailable", "message": "gone"}}, "[DONE]"))
    err = c.stream_chat({"messages": []}, key="k", sid=None)
    assert not err.ok and err.retryable and err.stream_error == {"type": "service_unavailable", "message": "gone"}
    c = sse_client(sse(chunk("a"), {"error": {"type": "server_error", "message": "bug"}}, "[DONE]"))
    bug = c.stream_chat({"messages": []}, key="k", sid=None)
    assert not bug.retryable and c.tally.server_errors == 1
    c = sse_client(b'{"error": {"message": "busy", "type": "x", "param": null, "code": "overloaded"}}', 429, {"retry-after": "1"})
    refused = c.stream_chat({"messages": []}, key="k", sid=None)
    assert refused.status == 429 and refused.retryable and refused.error_code == "overloaded"


def test_the_kill_hook_kills_the_serving_decoder_once_after_n_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[str] = []
    monkeypatch.setattr(faults, "kill_actor", lambda name, restart=False: killed.append(name))
    hook = faults.KillAt(3)
    for n in range(1, 7):
        hook(n, {"x-baton-replica": "abc"})
    assert killed == ["SERVE_REPLICA::baton#decode#abc"] and hook.chunks_before == 3 and hook.chunks_after == 3 and hook.mid_turn
    early = faults.KillAt(3)
    early(1, {"x-baton-replica": "abc"})
    assert early.killed is None and not early.mid_turn  # the stream ended before the kill: nothing was tested


def test_the_soak_fails_without_realtime_sessions_or_with_a_fact_missing() -> None:
    good = Counter({"sessions": 2, "sessions_ended": 2, "ticks": 12})
    assert soak_verdict(0, 0, good, ["f1", "f2"], {"f1", "f2", "other"}) == (True, [])
    ok, why = soak_verdict(0, 0, Counter(), ["f1"], {"f1"})
    assert not ok and why == ["no real-time session completed"]
    ok, why = soak_verdict(0, 0, good, ["f1", "f2"], {"f1"})
    assert not ok and why == ["1 of 2 added facts missing from GET /v1/memories"]
    assert not soak_verdict(0, 0, good, ["f1"], None)[0]
    assert not soak_verdict(0, 0, Counter({"sessions_ended": 2, "ticks": 11}), ["f1"], {"f1"})[0]
    assert not soak_verdict(0, 0, good + Counter({"tick_error:tick_failed": 1}), ["f1"], {"f1"})[0]
    assert soak_verdict(1, 2, good, ["f"], {"f"})[1] == ["1 lost turns", "2 server errors"]
